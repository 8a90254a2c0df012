"""config.json -> frozen dataclasses, accepting every key spelling Qwen3.5-family releases use."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import A3BError, ConfigError

SUPPORTED_MODEL_TYPES = {
    "qwen3_5_moe": True, "qwen3_5_moe_text": True,  # value: is MoE
    "qwen3_5": False, "qwen3_5_text": False,
}
# Far above any release (40 to 64 decoder layers, 27 vision blocks): a per-layer list or module is only ever built
# for a count below this, so a wrong count cannot cost minutes and gigabytes before the weights refute it.
MAX_LAYERS = 1000
# Every size and token id of a real model is far below this; it keeps float and int64 arithmetic on them exact.
MAX_INT = 2**31 - 1


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int  # 0 for a dense model
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    intermediate_size: int  # dense MLP width (dense models only)
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    out_hidden_size: int = 2048
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class StoredLayers:
    """How many decoder layers and vision blocks the weight files hold (highest index + 1; None: no such weights),
    so that config.json's counts are checked against them before anything is built from the counts."""
    text: int | None
    vision: int | None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    quantization: dict | None  # config.json's quantization_config, as given
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size
    caption_prompt: str | None = None  # a3b_caption_prompt: the request the model was trained to caption with


def _field(src: dict, key: str, where: str, *, default: Any = ..., types: type | tuple = (int,)) -> Any:
    if key not in src or src[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: the field '{key}' is missing. Use the config.json that came with the model.")
        return default
    value = src[key]
    types = types if isinstance(types, tuple) else (types,)
    if (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ConfigError(f"{where}: the field '{key}' is {value!r}; expected {_type_names(types)}. Use the "
                          "config.json that came with the model.")
    return value


def _type_names(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)


def _shown(value: Any) -> str:
    """repr(value) for a message, with integers too long to read given by their number of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        digits = int(math.log10(abs(value))) + 1
        if abs(value) >= 10**digits:  # log10 rounds near powers of 10
            digits += 1
        elif abs(value) < 10**(digits - 1):
            digits -= 1
        return f"a {digits}-digit number"
    return repr(value)


def _positive(src: dict, key: str, where: str, default: Any = ...) -> int:
    value = _field(src, key, where, default=default)
    if not 0 < value <= MAX_INT:
        expected = "a positive integer" if value <= 0 else f"at most {MAX_INT}"
        raise ConfigError(f"{where}: the field '{key}' is {_shown(value)}; expected {expected}. Use the config.json "
                          "that came with the model.")
    return value


def _positive_real(value: Any, key: str, where: str, maximum: float = math.inf) -> float:
    """A positive finite number (JSON's NaN, Infinity and 1e999 are refused, and so are integers too big for a
    float), at most `maximum`."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            pass
    if number is None or not math.isfinite(number) or not 0 < number <= maximum:
        bound = "" if maximum == math.inf else f" up to {maximum:g}"
        raise ConfigError(f"{where}: '{key}' is {_shown(value)}; expected a positive finite number{bound}. Use the "
                          "config.json that came with the model.")
    return number


def _layer_count(src: dict, key: str, where: str, stored: int | None, what: str) -> int:
    """A count of layers or blocks, checked against what the weights hold (when known), then against MAX_LAYERS."""
    value = _field(src, key, where)
    if stored is not None and value != stored:
        raise ConfigError(f"{where}: '{key}' is {_shown(value)} but the weights hold {stored} {what}. This config.json "
                          "does not belong to these weights: use the config.json of the same release.")
    if not 0 < value <= MAX_LAYERS:
        raise ConfigError(f"{where}: '{key}' is {_shown(value)}; expected 1 to {MAX_LAYERS} {what} (no supported "
                          "model has more). Use the config.json that came with the model.")
    return value


def parse_text_config(text: dict, where: str, is_moe: bool, top: dict | None = None,
                      stored_layers: int | None = None) -> TextConfig:
    top = top or {}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or top.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: 'rope_parameters' must be an object, got {rope!r}.")
    num_layers = _layer_count(text, "num_hidden_layers", where, stored_layers, "decoder layers")
    vocab = _positive(text, "vocab_size", where)
    hidden = _positive(text, "hidden_size", where)
    num_heads = _positive(text, "num_attention_heads", where)
    head_dim = _positive(text, "head_dim", where, default=hidden // num_heads)

    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = _positive(text, "full_attention_interval", where, default=4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != num_layers
            or not all(t in ("full_attention", "linear_attention") for t in layer_types)):
        raise ConfigError(f"{where}: 'layer_types' must list {num_layers} entries, each 'full_attention' or "
                          f"'linear_attention'; got {layer_types!r}. Use the config.json that came with the model.")

    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", top.get("partial_rotary_factor", 0.25)))
    theta = rope.get("rope_theta", text.get("rope_theta", top.get("rope_theta", 10_000_000.0)))
    partial = _positive_real(partial, "partial_rotary_factor", where, maximum=1.0)
    theta = _positive_real(theta, "rope_theta", where)
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"{where}: partial_rotary_factor {partial} gives a rotary dimension of {rotary_dim} for "
                          f"head_dim {head_dim}; expected an even number between 2 and head_dim.")
    section = rope.get("mrope_section") or [rotary_dim // 2, 0, 0]
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)):
        raise ConfigError(f"{where}: mrope_section is {section!r}; expected three non-negative integers (t, h, w). "
                          "Use the config.json that came with the model.")
    section = tuple(section)
    if sum(section) != rotary_dim // 2:
        raise ConfigError(f"{where}: mrope_section {list(section)} sums to {sum(section)}; expected rotary_dim/2 = "
                          f"{rotary_dim // 2}.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only the default, unscaled rotary "
                          "embedding); remove the rope scaling entry or use the release's config.json.")

    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in eos_ids):
        shown = f"[{', '.join(map(_shown, eos))}]" if isinstance(eos, list) else _shown(eos)
        raise ConfigError(f"{where}: eos_token_id is {shown}; expected a token id or a list of token ids below "
                          f"vocab_size {vocab}. Use the config.json that came with the model.")
    experts = _positive(text, "num_experts", where) if is_moe else 0
    per_token = _positive(text, "num_experts_per_tok", where) if is_moe else 0
    if per_token > experts:
        raise ConfigError(f"{where}: num_experts_per_tok is {per_token} but there are only {experts} experts. Use "
                          "the config.json that came with the model.")
    num_kv = _positive(text, "num_key_value_heads", where, default=num_heads)
    key_heads, value_heads = (_positive(text, k, where) for k in ("linear_num_key_heads", "linear_num_value_heads"))
    for many, few, what in ((num_heads, num_kv, "num_attention_heads / num_key_value_heads"),
                            (value_heads, key_heads, "linear_num_value_heads / linear_num_key_heads")):
        if many % few:
            raise ConfigError(f"{where}: {what} is {many} / {few}; the first must be a multiple of the second "
                              "(grouped heads). Use the config.json that came with the model.")
    return TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        layer_types=tuple(layer_types),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        mrope_section=section,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=_positive(text, "linear_key_head_dim", where),
        linear_value_head_dim=_positive(text, "linear_value_head_dim", where),
        linear_conv_kernel_dim=_positive(text, "linear_conv_kernel_dim", where, default=4),
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=_positive(text, "moe_intermediate_size", where) if is_moe else 0,
        shared_expert_intermediate_size=_positive(text, "shared_expert_intermediate_size", where) if is_moe else 0,
        intermediate_size=0 if is_moe else _positive(text, "intermediate_size", where),
        rms_norm_eps=_positive_real(_field(text, "rms_norm_eps", where, default=1e-6, types=(int, float)),
                                    "rms_norm_eps", where),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        max_position_embeddings=_positive(text, "max_position_embeddings", where, default=262144),
        eos_token_ids=eos_ids,
    )


def parse_vision_config(vision: dict, where: str, stored_blocks: int | None = None) -> VisionConfig:
    if vision.get("deepstack_visual_indexes"):
        raise ConfigError(f"{where}: vision_config.deepstack_visual_indexes is set; deepstack vision towers "
                          "(Qwen3-VL) are not supported, only Qwen3.5/3.6 models.")
    return VisionConfig(
        depth=_layer_count(vision, "depth", where, stored_blocks, "vision blocks"),
        hidden_size=_positive(vision, "hidden_size", where),
        num_heads=_positive(vision, "num_heads", where),
        intermediate_size=_positive(vision, "intermediate_size", where),
        patch_size=_positive(vision, "patch_size", where, default=16),
        temporal_patch_size=_positive(vision, "temporal_patch_size", where, default=2),
        spatial_merge_size=_positive(vision, "spatial_merge_size", where, default=2),
        in_channels=_positive(vision, "in_channels", where, default=3),
        num_position_embeddings=_positive(vision, "num_position_embeddings", where, default=2304),
        out_hidden_size=_positive(vision, "out_hidden_size", where),
        hidden_act=_field(vision, "hidden_act", where, default="gelu_pytorch_tanh", types=str),
    )


def parse_config(raw: dict, where: str = "config.json", stored: StoredLayers | None = None) -> ModelConfig:
    """config.json's object -> ModelConfig; with `stored`, the layer counts must match what the weights hold."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at the top level. Use the config.json that came with "
                          "the model.")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported. This pack runs Qwen3.5/3.6 models "
                          f"({', '.join(sorted(SUPPORTED_MODEL_TYPES))}); pick such a model folder.")
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: 'text_config' must be an object.")
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ConfigError(f"{where}: 'vision_config' must be an object.")

    def token(key: str, default: int) -> int:
        value = raw.get(key, text.get(key, default))
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            raise ConfigError(f"{where}: the field '{key}' is {_shown(value)}; expected an integer token id. Use the "
                              "config.json that came with the model.")
        return value

    quant = raw.get("quantization_config")
    quant = quant if isinstance(quant, dict) else None
    block = (quant or {}).get("weight_block_size") or [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size is {block!r}; expected two positive "
                          "integers such as [128, 128]. Use the config.json of the FP8 release.")
    return ModelConfig(
        model_type=model_type,
        text=parse_text_config(text, where, SUPPORTED_MODEL_TYPES[model_type], raw, stored.text if stored else None),
        vision=parse_vision_config(vision, where, stored.vision if stored else None) if vision else None,
        image_token_id=token("image_token_id", 248056),
        video_token_id=token("video_token_id", 248057),
        vision_start_token_id=token("vision_start_token_id", 248053),
        vision_end_token_id=token("vision_end_token_id", 248054),
        quantization=quant,
        fp8_block=tuple(block),
        caption_prompt=_field(raw, "a3b_caption_prompt", where, default=None, types=str),
    )


def inside_folder(folder: Path, path: Path, error: type[A3BError] = ConfigError) -> Path:
    """`path` resolved, refusing symlinks (or names) that lead outside the model folder. A model folder inside a
    Hugging Face cache snapshot may link anywhere in its own cache repository, where the download's files are."""
    resolved = path.resolve()
    repository = cache_repository(folder)
    allowed = repository or folder.resolve()
    if not resolved.is_relative_to(allowed):
        where = f"the model folder {folder}" + (f" and its Hugging Face cache repository {repository}"
                                                if repository else "")
        raise error(f"{path}: points outside {where} (to {resolved}). Copy the file into the folder instead of "
                    "linking to it.")
    return resolved


def cache_repository(folder: Path) -> Path | None:
    """The Hugging Face cache repository (<cache>/models--org--name, holding blobs/ and snapshots/<revision>/) whose
    snapshots/ the model folder really is in, or None."""
    for parent in folder.resolve().parents:
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return parent.parent
    return None


def read_config(folder: str | Path) -> dict:
    """config.json's JSON value, unchecked (parse_config checks it)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json is missing. Point the loader at the model folder itself (the one "
                          "holding config.json and the .safetensors files).")
    inside_folder(Path(folder), path, ConfigError)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8 or JSON, or an over-long integer
        raise ConfigError(f"{path}: cannot be parsed as JSON ({exc}). Re-download config.json.") from exc


def load_config(folder: str | Path, stored: StoredLayers | None = None) -> ModelConfig:
    return parse_config(read_config(folder), str(Path(folder) / "config.json"), stored)
