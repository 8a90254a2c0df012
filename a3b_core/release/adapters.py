"""LoRA adapters as PEFT saves them: a folder with adapter_config.json and adapter_model.safetensors (or that
.safetensors file given by itself, its adapter_config.json beside it), read as data only: safetensors, never a pickle,
and nothing from the folder runs.

An adapter is read into the factors of each module it adapts, keyed by the module's name in the transformers model
PEFT wrapped (`model.language_model.layers.0.self_attn.q_proj`), with the scaling PEFT gives it (lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern matched as PEFT matches them), and the whole
modules it replaces (modules_to_save, and the embedding weights PEFT saves with save_embedding_layers).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import AdapterError
from .safetensors import PICKLE_SUFFIXES, read_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20
# PEFT options that change what a LoRA computes, each refused when set: their forward is not base + scale * B A x
UNSUPPORTED_OPTIONS = {"use_dora": "DoRA", "lora_bias": "a LoRA bias", "fan_in_fan_out": "fan_in_fan_out (Conv1D "
                       "weights)", "use_qalora": "QA-LoRA", "trainable_token_indices": "trainable tokens",
                       "layer_replication": "layer replication", "use_bdlora": "BD-LoRA",
                       "alora_invocation_tokens": "activated LoRA (aLoRA)"}
_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")
_EMBEDDING_FACTOR = re.compile(r"^(?P<module>.+)\.(?P<which>lora_embedding_A|lora_embedding_B)$")
_REPLACED = re.compile(r"^(?P<module>.+?)(\.base_layer)?\.weight$")


@dataclass(frozen=True)
class Factors:
    """One adapted weight: delta W = scale * b @ a, with a [r, in] and b [out, r] (embedding: a [r, vocab],
    b [hidden, r]). An expert stack's factors as PEFT keeps them: a [E * r, in] expert-major, b [out, r * E]
    expert-minor."""
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class Adapter:
    """An adapter's factors by adapted module (a module may have several: the parameters of an expert stack) and the
    weights of the modules it replaces, by module name."""
    path: Path
    factors: dict[str, list[Factors]]
    embedding_factors: dict[str, Factors]
    replaced: dict[str, torch.Tensor]
    config: AdapterConfig


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(adapter_config.json, weights .safetensors) of an adapter folder or of a weights file given by itself."""
    path = Path(path).expanduser()
    if path.is_dir():
        folder, weights = path, path / ADAPTER_WEIGHTS
        if not weights.is_file():
            pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
            if pickles:
                raise AdapterError(f"{folder}: holds only a pickle adapter ({', '.join(pickles[:3])}), which can run "
                                   "arbitrary code and is never loaded. Save the adapter as safetensors (PEFT's "
                                   "save_pretrained does by default) and pass that folder.")
            raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS} found. Pass a LoRA adapter folder as PEFT saves it "
                               f"({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}) or its .safetensors file.")
    elif path.suffix in PICKLE_SUFFIXES:
        raise AdapterError(f"{path}: a pickle adapter can run arbitrary code and is never loaded. Save the adapter "
                           "as safetensors (PEFT's save_pretrained does by default) and pass that.")
    elif path.suffix == ".safetensors" and path.is_file():
        folder, weights = path.parent, path
    else:
        raise AdapterError(f"{path}: LoRA adapter not found. Pass a folder holding {ADAPTER_CONFIG} and "
                           f"{ADAPTER_WEIGHTS}, or such a .safetensors file with its {ADAPTER_CONFIG} beside it.")
    config = folder / ADAPTER_CONFIG
    if not config.is_file():
        raise AdapterError(f"{config}: missing. A LoRA adapter needs the {ADAPTER_CONFIG} it was saved with (its r, "
                           "lora_alpha and options); copy it from where the adapter came from.")
    return config, weights


def read_adapter(path: str | Path) -> Adapter:
    """The adapter at `path` (a folder or its .safetensors file), checked: a LoRA as PEFT saves it, every factor paired
    and finite, ranks as its config says."""
    config_path, weights_path = adapter_files(path)
    config = read_adapter_config(config_path)
    read_header(weights_path)  # bounds and dtypes checked before any tensor is read
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors' own errors have no common base
        raise AdapterError(f"{weights_path}: cannot be read as safetensors ({exc}). Save the adapter again.") from exc
    where = str(weights_path)
    factor_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    replaced: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{where}: tensor '{key}' is not finite floating-point data (NaN, inf or integers); "
                               "the adapter is broken. Train or download it again.")
        if (match := _FACTOR.match(name)) or (match := _EMBEDDING_FACTOR.match(name)):
            kind = "embedding" if match["which"].startswith("lora_embedding") else "linear"
            factor_parts.setdefault((kind, match["module"]), {})[match["which"][-1]] = tensor.float()
        elif "lora_" in name or ".modules_to_save." in name:
            raise AdapterError(f"{where}: tensor '{key}' is not a LoRA factor this pack reads (lora_A / lora_B / "
                               "lora_embedding_A / lora_embedding_B weights). The adapter uses a PEFT feature "
                               "that is not supported; use a plain LoRA adapter.")
        elif match := _REPLACED.match(name):
            replaced[match["module"]] = tensor
        else:
            raise AdapterError(f"{where}: tensor '{key}' is neither a LoRA factor nor a module's weight. This is not "
                               "a PEFT LoRA adapter; pass one saved by PEFT's save_pretrained.")
    factors: dict[str, list[Factors]] = {}
    embedding_factors: dict[str, Factors] = {}
    for (kind, module), parts in factor_parts.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"{where}: module '{module}' has lora_{''.join(parts)} but not its pair (every "
                               "adapted module needs lora_A and lora_B). The file is incomplete: save the adapter "
                               "again.")
        a, b = parts["A"], parts["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: module '{module}' has factors of shapes {tuple(a.shape)} (A) and "
                               f"{tuple(b.shape)} (B), which do not multiply (A [r, in], B [out, r]). The file is "
                               "corrupt: save the adapter again.")
        factor = Factors(a, b)
        if kind == "embedding":
            embedding_factors[module] = factor
        else:
            # nested wrappers (several parameters of one expert stack) add `.base_layer` between module and factor
            factors.setdefault(module.replace(".base_layer", ""), []).append(factor)
    if not factors and not embedding_factors and not replaced:
        raise AdapterError(f"{where}: holds no LoRA factors. Pass an adapter saved by PEFT's save_pretrained.")
    return Adapter(weights_path, factors, embedding_factors, replaced, config)


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of adapter_config.json that set an adapter's scaling."""
    path: Path
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    base_model: str

    def pattern_value(self, patterns: dict, module: str, default: float) -> float:
        """PEFT's pattern lookup: the first key matching the end of the module's name, dot-separated."""
        for key, value in patterns.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    def scale(self, key: str, rank: int) -> float:
        """PEFT's scaling of the weight named `key` (a module's name; an expert stack's `<module>.<parameter>`),
        whose factors have rank `rank` (checked against the config's r for it)."""
        r = int(self.pattern_value(self.rank_pattern, key, self.r))
        alpha = float(self.pattern_value(self.alpha_pattern, key, self.alpha))
        if rank != r:
            raise AdapterError(f"{self.path}: gives '{key}' r = {r}, but the adapter's weights have rank {rank} there. "
                               f"The config does not belong to these weights: use the {ADAPTER_CONFIG} saved with "
                               "them.")
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def read_adapter_config(path: Path) -> AdapterConfig:
    """adapter_config.json, checked: a LoRA without options that change its forward (refused by name)."""
    where = str(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{where}: {path.stat().st_size} bytes, far more than any adapter config; it is not "
                               f"an {ADAPTER_CONFIG}. Use the one saved with the adapter.")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterError(f"{where}: cannot be read as JSON ({exc}). Use the {ADAPTER_CONFIG} saved with the "
                           "adapter.") from exc
    if not isinstance(raw, dict):
        raise AdapterError(f"{where}: is not a JSON object. Use the {ADAPTER_CONFIG} saved with the adapter.")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type!r}; only LoRA adapters (peft_type LORA) are "
                           "supported. Use a LoRA adapter of this model.")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if raw.get(key) not in (None, False, [], {}, "none"):
            raise AdapterError(f"{where}: {key} is set ({what}), which this pack does not compute. Use a plain LoRA "
                               "adapter, or merge this one into the model with PEFT and load the merged model.")
    try:
        r, alpha = int(raw["r"]), float(raw["lora_alpha"])
        rank_pattern = {str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()}
        alpha_pattern = {str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AdapterError(f"{where}: needs r (a positive integer) and lora_alpha (a number), and rank_pattern / "
                           f"alpha_pattern as objects of numbers ({exc!r}). Use the {ADAPTER_CONFIG} saved with the "
                           "adapter.") from exc
    if r <= 0 or any(v <= 0 for v in rank_pattern.values()) or not math.isfinite(alpha) \
            or not all(math.isfinite(v) for v in alpha_pattern.values()):
        raise AdapterError(f"{where}: r and the rank_pattern values must be positive integers and lora_alpha "
                           f"finite (r {r}, lora_alpha {alpha}). Use the {ADAPTER_CONFIG} saved with the adapter.")
    for key in (*rank_pattern, *alpha_pattern):  # PEFT matches them as regular expressions
        try:
            re.compile(key)
        except re.error as exc:
            raise AdapterError(f"{where}: the pattern {key!r} in rank_pattern / alpha_pattern is not a valid regular "
                               f"expression ({exc}). Use the {ADAPTER_CONFIG} saved with the adapter.") from exc
    mapping = raw.get("auto_mapping")
    base_model = str(mapping.get("base_model_class") or "") if isinstance(mapping, dict) else ""
    return AdapterConfig(path, r, alpha, bool(raw.get("use_rslora")), rank_pattern, alpha_pattern, base_model)
