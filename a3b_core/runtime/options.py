"""The engine's choices, spelled once: what loading and generation take, which the nodes and the CLI offer as they
are here, and the dataclasses that carry a set of choices."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import AdapterError
from ..formats.table import DENSE_FORMATS, KV_FORMATS, WEIGHT_FORMATS
from ..media.image import RESIZE_MODES
from ..prompting.folder_template import BUILT_IN_TEMPLATE, CHAT_TEMPLATES

__all__ = ["BUILT_IN_TEMPLATE", "CHAT_TEMPLATES", "COMPUTE_DTYPES", "DENSE_FORMATS", "DEVICE_CHOICES", "KV_FORMATS",
           "PRESET_NAMES", "RESIZE_MODES", "SAMPLER_FIELDS", "WEIGHT_FORMATS", "GenerationOptions", "LoadOptions",
           "parse_lora"]

PRESET_NAMES = ("auto", "8gb", "12gb", "16gb", "24gb", "48gb", "cpu")  # VRAM budgets; placement.PRESETS sizes them
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty")


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model (load_model's keyword arguments and their defaults)."""
    preset: str = "auto"
    compute_dtype: str = "auto"
    weight_format: str = "auto"
    dense_format: str = "auto"
    kv_cache: str = "auto"
    max_context: int | None = None
    device: str = "auto"
    chat_template: str = "auto"
    loras: tuple[tuple[str, float], ...] = ()  # (LoRA adapter folder or .safetensors file, strength)
    mmproj: str = "auto"  # a .gguf model's vision tower: auto (beside it), none, or the mmproj file's path

    def as_kwargs(self) -> dict:
        return asdict(self)


def parse_lora(text: str) -> tuple[str, float]:
    """(path, strength) of a `PATH[:STRENGTH]` LoRA choice, strength 1.0 when none is given. The text is split at its
    last ':' only when what follows is a number, so a Windows path (C:\\loras\\x) stays whole."""
    head, colon, tail = text.rpartition(":")
    try:
        path, strength = (head, float(tail)) if colon else (text, 1.0)
    except ValueError:  # what follows the last ':' is part of the path
        path, strength = text, 1.0
    if not path.strip():
        raise AdapterError(f"--lora {text!r} names no adapter; give PATH or PATH:STRENGTH (e.g. my_lora:0.8).")
    if not math.isfinite(strength):
        raise AdapterError(f"--lora {text!r}: the strength {tail!r} is not a finite number; give PATH:STRENGTH with "
                           "a number such as 0.8 (0 = off, negative inverts the adapter).")
    return path, strength


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate (generate's keyword arguments besides the prompt and the callbacks). Sampler values left as
    None take Qwen's recommendation for the prompt's thinking mode."""
    max_new_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int = 0
    stop: str | tuple[str, ...] = ()  # one stop text or several
    thinking_budget: int | None = None
    kv_dtype: str | None = None
    max_context: int | None = None

    def as_kwargs(self) -> dict:
        return asdict(self)
