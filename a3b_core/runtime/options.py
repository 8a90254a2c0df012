"""The engine's choices, spelled once: what loading and generation take, which the nodes and the CLI offer as they
are here, and the dataclasses that carry a set of choices."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import GenerationError
from ..media.image import RESIZE_MODES
from ..prompting.folder_template import BUILT_IN_TEMPLATE, CHAT_TEMPLATES

PRESET_NAMES = ("auto", "8gb", "12gb", "16gb", "24gb", "48gb", "cpu")  # VRAM budgets; placement.PRESETS sizes them
DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # how weights are held
FORMAT_OF_DTYPE = {dtype: fmt for fmt, dtype in FLOAT_FORMATS.items()}
QUANTIZED_FORMATS = ("fp8", "int8", "int4")
WEIGHT_FORMATS = ("auto", "fp8", "int8", "int4", "bf16", "fp32")  # what routed experts in RAM may be held in
# how the text model's dense matrices on the CPU are held; "auto": the compute dtype (FP8 as released where the plan
# keeps it on a GPU), int8/int4: weight-only, as the routed experts' stores (backends/dense.py)
DENSE_FORMATS = ("auto", "int8", "int4")
KV_FORMATS = ("auto", *FLOAT_FORMATS, "int8")  # "auto": the compute dtype
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty")


def checked_kv_format(kv_dtype: str | None) -> str:
    """A KV cache format name (None means "auto"), refused with a GenerationError if unknown."""
    if kv_dtype is not None and kv_dtype not in KV_FORMATS:
        raise GenerationError(f"kv_dtype is {kv_dtype!r}; use one of {', '.join(KV_FORMATS)} (auto: the compute "
                              "dtype; int8: about half the memory of a bfloat16 cache).")
    return kv_dtype or "auto"


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

    def as_kwargs(self) -> dict:
        return asdict(self)


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
