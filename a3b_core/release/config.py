"""config.json: read as JSON, its checked fields, and the model config every family's parser returns.

Each model family parses its own fields (models/<family>/config.py) with the checks here, which refuse anything a
real release never has (NaN, huge numbers, wrong types) with a ConfigError that names the field.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import A3BError, ConfigError

# Far above any release (40 to 64 decoder layers, 27 vision blocks): a per-layer list or module is only ever built
# for a count below this, so a wrong count cannot cost minutes and gigabytes before the weights refute it.
MAX_LAYERS = 1000
# Every size and token id of a real model is far below this; it keeps float and int64 arithmetic on them exact.
MAX_INT = 2**31 - 1


@dataclass(frozen=True)
class StoredLayers:
    """How many decoder layers and vision blocks the weight files hold (highest index + 1; None: no such weights),
    so that config.json's counts are checked against them before anything is built from the counts."""
    text: int | None
    vision: int | None


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    text: Any  # the family's text config
    vision: Any  # the family's vision config, or None for a text-only model
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    quantization: dict | None  # config.json's quantization_config, as given
    fp8_block: tuple[int, int] = (128, 128)  # quantization_config.weight_block_size
    caption_prompt: str | None = None  # a3b_caption_prompt: the request the model was trained to caption with
    default_thinking: bool | None = None  # a3b_default_thinking: whether prompts think when the caller does not say


def field(src: dict, key: str, where: str, *, default: Any = ..., types: type | tuple = (int,)) -> Any:
    if key not in src or src[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: the field '{key}' is missing. Use the config.json that came with the model.")
        return default
    value = src[key]
    types = types if isinstance(types, tuple) else (types,)
    if (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ConfigError(f"{where}: the field '{key}' is {value!r}; expected {type_names(types)}. Use the "
                          "config.json that came with the model.")
    return value


def type_names(types: tuple) -> str:
    return " or ".join(t.__name__ for t in types)


def shown(value: Any) -> str:
    """repr(value) for a message, with integers too long to read given by their number of digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        digits = int(math.log10(abs(value))) + 1
        if abs(value) >= 10**digits:  # log10 rounds near powers of 10
            digits += 1
        elif abs(value) < 10**(digits - 1):
            digits -= 1
        return f"a {digits}-digit number"
    return repr(value)


def positive(src: dict, key: str, where: str, default: Any = ...) -> int:
    value = field(src, key, where, default=default)
    if not 0 < value <= MAX_INT:
        expected = "a positive integer" if value <= 0 else f"at most {MAX_INT}"
        raise ConfigError(f"{where}: the field '{key}' is {shown(value)}; expected {expected}. Use the config.json "
                          "that came with the model.")
    return value


def positive_real(value: Any, key: str, where: str, maximum: float = math.inf) -> float:
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
        raise ConfigError(f"{where}: '{key}' is {shown(value)}; expected a positive finite number{bound}. Use the "
                          "config.json that came with the model.")
    return number


def layer_count(src: dict, key: str, where: str, stored: int | None, what: str) -> int:
    """A count of layers or blocks, checked against what the weights hold (when known), then against MAX_LAYERS."""
    value = field(src, key, where)
    if stored is not None and value != stored:
        raise ConfigError(f"{where}: '{key}' is {shown(value)} but the weights hold {stored} {what}. This config.json "
                          "does not belong to these weights: use the config.json of the same release.")
    if not 0 < value <= MAX_LAYERS:
        raise ConfigError(f"{where}: '{key}' is {shown(value)}; expected 1 to {MAX_LAYERS} {what} (no supported "
                          "model has more). Use the config.json that came with the model.")
    return value


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


# ------------------------------------------------------------------------------ field groups every family has
@dataclass(frozen=True)
class Rope:
    rotary_dim: int  # the leading channels of each head that are rotated
    theta: float
    section: tuple[int, int, int]  # M-RoPE: frequencies of the t, h, w axes
    interleaved: bool  # as config.json says (a family may always interleave)


def rope_config(text: dict, top: dict, where: str, head_dim: int, partial_default: float, theta_default: float,
                section_default: list[int] | None = None) -> Rope:
    """The rotary embedding: rope_parameters (or rope_scaling) of the text config, or of the top level."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or top.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: 'rope_parameters' must be an object, got {rope!r}.")

    def given(key: str, default: Any) -> Any:
        return rope.get(key, text.get(key, top.get(key, default)))

    partial = positive_real(given("partial_rotary_factor", partial_default), "partial_rotary_factor", where,
                            maximum=1.0)
    theta = positive_real(given("rope_theta", theta_default), "rope_theta", where)
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"{where}: partial_rotary_factor {partial} gives a rotary dimension of {rotary_dim} for "
                          f"head_dim {head_dim}; expected an even number between 2 and head_dim.")
    section = rope.get("mrope_section") or section_default or [rotary_dim // 2, 0, 0]
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section)):
        raise ConfigError(f"{where}: mrope_section is {section!r}; expected three non-negative integers (t, h, w). "
                          "Use the config.json that came with the model.")
    if sum(section) != rotary_dim // 2:
        raise ConfigError(f"{where}: mrope_section {list(section)} sums to {sum(section)}; expected rotary_dim/2 = "
                          f"{rotary_dim // 2}. Use the config.json that came with the model.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only the default, unscaled rotary "
                          "embedding); remove the rope scaling entry or use the release's config.json.")
    return Rope(rotary_dim, theta, tuple(section), bool(rope.get("mrope_interleaved", False)))


def eos_token_ids(text: dict, top: dict, vocab: int, where: str) -> tuple[int, ...]:
    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in eos_ids):
        given = f"[{', '.join(map(shown, eos))}]" if isinstance(eos, list) else shown(eos)
        raise ConfigError(f"{where}: eos_token_id is {given}; expected a token id or a list of token ids below "
                          f"vocab_size {vocab}. Use the config.json that came with the model.")
    return eos_ids


def experts_per_token(text: dict, where: str) -> tuple[int, int]:
    """(num_experts, num_experts_per_tok) of a mixture-of-experts text config; transformers writes the expert count
    of some families as num_local_experts."""
    experts = positive(text, "num_experts" if "num_experts" in text or "num_local_experts" not in text
                       else "num_local_experts", where)
    per_token = positive(text, "num_experts_per_tok", where)
    if per_token > experts:
        raise ConfigError(f"{where}: num_experts_per_tok is {per_token} but there are only {experts} experts. Use "
                          "the config.json that came with the model.")
    return experts, per_token


def check_grouped(many: int, few: int, what: str, where: str) -> None:
    if many % few:
        raise ConfigError(f"{where}: {what} is {many} / {few}; the first must be a multiple of the second "
                          "(grouped heads). Use the config.json that came with the model.")


def token_id(raw: dict, text: dict, key: str, default: int, where: str) -> int:
    """A special token id of the top level (or the text config)."""
    value = raw.get(key, text.get(key, default))
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
        raise ConfigError(f"{where}: the field '{key}' is {shown(value)}; expected an integer token id. Use the "
                          "config.json that came with the model.")
    return value


def quantization(raw: dict, where: str) -> tuple[dict | None, tuple[int, int]]:
    """config.json's quantization_config (None if absent) and its FP8 block size (default 128 x 128)."""
    quant = raw.get("quantization_config")
    quant = quant if isinstance(quant, dict) else None
    block = (quant or {}).get("weight_block_size") or [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size is {block!r}; expected two positive "
                          "integers such as [128, 128]. Use the config.json of the FP8 release.")
    return quant, tuple(block)


def sections(raw: dict, where: str) -> tuple[dict, dict | None]:
    """The text config (text_config, or the top level of a text-only config) and vision_config (None if absent)."""
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: 'text_config' must be an object.")
    vision = raw.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ConfigError(f"{where}: 'vision_config' must be an object.")
    return text, vision


def model_config(raw: dict, where: str, stored: StoredLayers | None, is_moe: bool,
                 parse_text: Callable[[dict, str, bool, dict, int | None], Any],
                 parse_vision: Callable[[dict, str, int | None], Any], special_tokens: dict[str, int]) -> ModelConfig:
    """A config.json object parsed with a family's text and vision parsers (given the layer counts the weights hold,
    when `stored`), with what every family's config holds around those sections: the special token ids (top level,
    or the text config; `special_tokens` gives the family's defaults), the FP8 quantization, the caption request and
    the default thinking mode."""
    text, vision = sections(raw, where)
    text_config = parse_text(text, where, is_moe, raw, stored.text if stored else None)
    vision_config = parse_vision(vision, where, stored.vision if stored else None) if vision else None
    quant, block = quantization(raw, where)
    return ModelConfig(
        model_type=raw["model_type"], text=text_config, vision=vision_config,
        **{key: token_id(raw, text, key, default, where) for key, default in special_tokens.items()},
        quantization=quant, fp8_block=block,
        caption_prompt=field(raw, "a3b_caption_prompt", where, default=None, types=str),
        default_thinking=field(raw, "a3b_default_thinking", where, default=None, types=bool))
