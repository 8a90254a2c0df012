"""Checkpoint tensors -> module parameters: name prefixes, expert layouts, FP8, dtypes and shape checks.

Modules are built on the meta device and each parameter is materialised straight from the memory-mapped file, so
loading never holds a second copy of the weights.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from . import devices
from .checkpoint import FP8_DTYPES, Checkpoint
from .config import StoredLayers, TextConfig
from .errors import CheckpointError, PlacementError
from .experts import FLOAT_FORMATS, FP8_BLOCK, Fp8Linear, QuantizedExperts

TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")
VISION_PREFIXES = ("model.visual.", "visual.")

Progress = Callable[[int, int], None]


def _prefix_of(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...]) -> str | None:
    return next((prefix for prefix in prefixes if prefix + probe in ckpt), None)


def find_prefix(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...], what: str) -> str:
    prefix = _prefix_of(ckpt, probe, prefixes)
    if prefix is not None:
        return prefix
    raise CheckpointError(f"{ckpt.folder}: no '{probe}' tensor under any known prefix ({', '.join(map(repr, prefixes))}),"
                          f" so the {what} weights cannot be found. Is this a Qwen3.5/3.6 checkpoint?")


def stays_fp32(name: str, tensor_shape: tuple[int, ...]) -> bool:
    """Vectors (norm weights, biases, gates' scalars) and the DeltaNet conv kernels (tiny, and applied in fp32) are
    kept in fp32 whatever the compute dtype."""
    return len(tensor_shape) <= 1 or name.endswith("conv1d.weight")


def stored_layers(ckpt: Checkpoint) -> StoredLayers:
    """How many decoder layers and vision blocks the checkpoint holds, from its tensor names alone."""
    return StoredLayers(text=_block_count(ckpt, "embed_tokens.weight", TEXT_PREFIXES, "layers"),
                        vision=_block_count(ckpt, "pos_embed.weight", VISION_PREFIXES, "blocks"))


def _block_count(ckpt: Checkpoint, probe: str, prefixes: tuple[str, ...], blocks: str) -> int | None:
    """Highest `<prefix><blocks>.N.` index + 1 under the prefix that holds `probe`; None when no prefix does."""
    prefix = _prefix_of(ckpt, probe, prefixes)
    if prefix is None:
        return None
    numbered = re.compile(re.escape(prefix + blocks) + r"\.(\d+)\.")
    return max((int(match[1]) + 1 for match in map(numbered.match, ckpt.infos) if match), default=0)


def param_dtype(name: str, tensor_shape: tuple[int, ...], compute_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if stays_fp32(name, tensor_shape) else compute_dtype


def _set_param(root: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    setattr(module, leaf, nn.Parameter(value, requires_grad=False))


def _check_shape(ckpt: Checkpoint, source: str, expected: tuple[int, ...]) -> None:
    info = ckpt.infos.get(source)
    if info is not None and info.shape != expected:
        raise CheckpointError(f"{info.file}: tensor '{source}' has shape {list(info.shape)} but config.json implies "
                              f"{list(expected)}. The config.json does not belong to these weights: use the one from "
                              "the same release.")


def _checked(ckpt: Checkpoint, source: str, expected: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    _check_shape(ckpt, source, expected)
    return ckpt.weight(source, dtype)


def load_module(module: nn.Module, ckpt: Checkpoint, prefix: str, compute_dtype: torch.dtype,
                special: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor | None] = lambda *_: None,
                progress: Progress | None = None) -> None:
    """Fills every parameter of a meta-device `module` from `prefix + name` (or from `special`, if it answers)."""
    params = list(module.named_parameters())
    for n, (name, param) in enumerate(params):
        shape = tuple(param.shape)
        dtype = param_dtype(name, shape, compute_dtype)
        value = special(name, shape, dtype)
        if value is None:
            value = _checked(ckpt, prefix + name, shape, dtype)
        _set_param(module, name, value)
        if progress:
            progress(n + 1, len(params))


ExpertPlacement = Callable[[int], tuple[str, torch.device]]  # layer -> (expert format, device)


def load_text_model(module: nn.Module, cfg: TextConfig, ckpt: Checkpoint, compute_dtype: torch.dtype,
                    progress: Progress | None = None, expert_placement: ExpertPlacement | None = None,
                    cache_dirs: Mapping[str, Path] | None = None, keep_fp8: bool = False) -> str:
    """Fills a meta-device TextModel. Routed experts follow `expert_placement` (default: the compute dtype, on the
    CPU): float formats are loaded on the CPU (placing the model moves them), quantised ones are built on their
    device; int8/int4 are converted one expert at a time and cached under `cache_dirs[format]` for the next load.
    With `keep_fp8`, dense matrices stored as FP8 stay FP8 (Fp8Linear). A tied lm_head is the embedding's own
    Parameter. Returns the checkpoint's name prefix."""
    prefix = find_prefix(ckpt, "embed_tokens.weight", TEXT_PREFIXES, "language model")
    if keep_fp8:
        keep_fp8_linears(module, ckpt, prefix)
    placement = expert_placement or (lambda layer: (FORMAT_OF_DTYPE[compute_dtype], torch.device("cpu")))
    float_experts: dict[int, torch.dtype] = {}
    for layer, block in enumerate(module.layers):
        if not cfg.is_moe:
            continue
        fmt, device = placement(layer)
        if fmt in FLOAT_FORMATS:
            float_experts[layer] = FLOAT_FORMATS[fmt]
        else:
            cache_dir = (cache_dirs or {}).get(fmt)
            block.mlp.experts = load_quantized_experts(ckpt, f"{prefix}layers.{layer}.mlp.experts.", cfg, fmt, device,
                                                       cache_dir / f"layer{layer}.safetensors" if cache_dir else None)

    def special(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if name == "lm_head.weight":
            if "lm_head.weight" in ckpt:
                return _checked(ckpt, "lm_head.weight", shape, dtype)
            if cfg.tie_word_embeddings:
                return module.embed_tokens.weight
            raise CheckpointError(f"{ckpt.folder}: 'lm_head.weight' is missing and config.json does not tie it to "
                                  "the embeddings. The checkpoint is incomplete: download all of its shards.")
        if ".mlp.experts." in name:
            layer = int(name.split(".")[1])
            base, which = f"{prefix}layers.{layer}.mlp.experts.", name.rsplit(".", 1)[1]
            return load_experts(ckpt, base, cfg, which, float_experts[layer])
        return None

    load_module(module, ckpt, prefix, compute_dtype, special, progress)
    if "lm_head.weight" not in ckpt:
        module.lm_head.weight = module.embed_tokens.weight
    return prefix


def keep_fp8_linears(module: nn.Module, ckpt: Checkpoint, prefix: str) -> None:
    """Swaps each bias-free Linear whose checkpoint weight is FP8 (with block scales) for an Fp8Linear."""
    for name, child in list(module.named_modules()):
        source = f"{prefix}{name}.weight"
        if (isinstance(child, nn.Linear) and child.bias is None and source + "_scale_inv" in ckpt
                and ckpt.infos[source].dtype in FP8_DTYPES):
            _check_shape(ckpt, source, tuple(child.weight.shape))
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf,
                    Fp8Linear(ckpt.raw(source), ckpt.raw(source + "_scale_inv"), ckpt.fp8_block))


FORMAT_OF_DTYPE = {dtype: fmt for fmt, dtype in FLOAT_FORMATS.items()}
CONVERTED_EXPERT_FORMATS = ("int8", "int4")  # FP8 experts are kept as released: nothing to convert or cache


def load_experts(ckpt: Checkpoint, base: str, cfg: TextConfig, which: str, dtype: torch.dtype) -> torch.Tensor:
    """One layer's routed experts as the fused tensor `which` ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I])."""
    e = cfg.num_experts
    fused = base + which
    if fused in ckpt and ckpt.infos[fused].shape == expert_shape(cfg, which, fused=True):
        return ckpt.weight(fused, dtype)
    out = torch.empty(expert_shape(cfg, which, fused=True), dtype=dtype)
    for j in range(e):
        out[j] = expert_matrix(ckpt, base, cfg, which, j).to(dtype)
    return out


def expert_shape(cfg: TextConfig, which: str, fused: bool = False) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    shape = (2 * i, h) if which == "gate_up_proj" else (h, i)
    return (cfg.num_experts, *shape) if fused else shape


def expert_matrix(ckpt: Checkpoint, base: str, cfg: TextConfig, which: str, j: int) -> torch.Tensor:
    """Expert j's fp32 matrix [2I, H] (gate rows, then up) or [H, I], whatever the checkpoint layout: fused,
    fused-transposed (told apart by shape: H != I != 2I in every real model), or per-expert (FP8 or not)."""
    out_dim, in_dim = expert_shape(cfg, which)
    fused = base + which
    if fused in ckpt:
        shape = ckpt.infos[fused].shape
        if shape == (cfg.num_experts, out_dim, in_dim):
            return ckpt.raw(fused)[j].float()
        if shape == (cfg.num_experts, in_dim, out_dim):
            return ckpt.raw(fused)[j].t().float()
        raise CheckpointError(f"{ckpt.infos[fused].file}: tensor '{fused}' has shape {list(shape)}; expected "
                              f"{[cfg.num_experts, out_dim, in_dim]} (or its transpose) from config.json. Use the "
                              "config.json of this release.")
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    if which == "down_proj":
        return _checked(ckpt, f"{base}{j}.down_proj.weight", (h, i), torch.float32)
    return torch.cat([_checked(ckpt, f"{base}{j}.gate_proj.weight", (i, h), torch.float32),
                      _checked(ckpt, f"{base}{j}.up_proj.weight", (i, h), torch.float32)])


def load_quantized_experts(ckpt: Checkpoint, base: str, cfg: TextConfig, fmt: str, device: torch.device,
                           cache_file: Path | None) -> QuantizedExperts:
    if fmt == "int4" and device.type != "cpu":
        raise PlacementError(f"int4 routed experts can only be computed by the CPU (torch's CPU int4 kernel), not on "
                             f"{device}; keep them in RAM, or put fp8/bf16 experts on the GPU.")
    experts = QuantizedExperts(fmt, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, "cpu")
    state = experts.state_dict()
    if cache_file is not None and cache_file.is_file():
        try:
            cached = load_file(cache_file)
        except Exception:  # a damaged cache file (the library raises its own error type): convert again
            cached = {}
        if cached.keys() == state.keys() and all(cached[k].shape == state[k].shape for k in state):
            experts.load_state_dict(cached)
            return devices.move(experts, device)
    for which, stack in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
        for j in range(cfg.num_experts):
            if fmt == "fp8" and cfg.moe_intermediate_size % FP8_BLOCK == 0 and base + f"{j}.down_proj.weight_scale_inv" in ckpt:
                parts = ["down_proj"] if which == "down_proj" else ["gate_proj", "up_proj"]
                stack.set_fp8(j, *_stored_fp8(ckpt, [f"{base}{j}.{p}.weight" for p in parts]))
            else:
                stack.set(j, expert_matrix(ckpt, base, cfg, which, j))
    for name in [n for n in ckpt.infos if n.startswith(base)]:
        ckpt.release(name)  # the converted copy is all that stays
    if cache_file is not None:
        try:
            write_atomically(cache_file, lambda tmp: save_file(experts.state_dict(), tmp))
        except OSError:  # a read-only or full cache disk only costs the next load a conversion
            pass
    return devices.move(experts, device)


def _stored_fp8(ckpt: Checkpoint, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The released FP8 matrices (and block scales) of one expert, gate and up stacked when there are two
    (their scale blocks line up because the intermediate size is a multiple of the block)."""
    q = torch.cat([ckpt.raw(n) for n in names])
    scale = torch.cat([ckpt.raw(n + "_scale_inv").float() for n in names])
    return q, scale


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
