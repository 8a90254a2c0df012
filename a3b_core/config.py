"""config.json: read as JSON, its checked fields, and the model config every family's parser returns.

Each model family parses its own fields (models/<family>/config.py) with the checks here, which refuse anything a
real release never has (NaN, huge numbers, wrong types) with a ConfigError that names the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import A3BError, ConfigError

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
