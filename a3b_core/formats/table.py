"""Every weight format the engine holds, one entry each, and the choices the options offer from them.

A WeightFormat is its name (a str: options, plans, cache folders and the nodes spell formats by name) carrying what
the engine asks of it: the torch dtype of a float format, the layout class of a quantized one (how a stack of
matrices is stored, quantized, dequantized and multiplied on the CPU, and how the numba kernels read it), the numba
kernels' code for it, and whether it is converted at load (and cached) or kept as the checkpoint stores it. The
planner, the loader, the stores and the kernels ask these; a new format is one more entry here and its layout.
"""
from __future__ import annotations

import torch

from ..errors import GenerationError
from ..kernels import arrays
from .fp8 import Fp8Blocks
from .gguf import GgufBlocks
from .int4 import Int4Groups
from .int8 import Int8Rows

Layout = type[Int8Rows] | type[Int4Groups] | type[Fp8Blocks] | type[GgufBlocks]


class WeightFormat(str):
    """A weight format: its name, and its facts as keyword arguments (see the module docstring)."""
    dtype: torch.dtype | None  # a float format's dtype; None for a quantized one
    layout: Layout | None  # a quantized format's storage (formats/int8.py, int4.py, fp8.py, gguf.py); None for floats
    kernel_code: int | None  # how the numba kernels know its layout (kernels/arrays.py); None: they do not read it
    converted: bool  # quantized from the checkpoint's floats at load and cached on disk (weight-only, per row/group)
    as_released: bool  # kept as the checkpoint stores it, its block scales too (tensors stored unquantized: bf16)
    cpu_only: bool  # only the CPU's kernels compute it

    def __new__(cls, name: str, *, dtype: torch.dtype | None = None, layout: Layout | None = None,
                kernel_code: int | None = None, converted: bool = False, as_released: bool = False,
                cpu_only: bool = False) -> WeightFormat:
        fmt = super().__new__(cls, name)
        fmt.dtype, fmt.layout, fmt.kernel_code = dtype, layout, kernel_code
        fmt.converted, fmt.as_released, fmt.cpu_only = converted, as_released, cpu_only
        return fmt

    @property
    def quantized(self) -> bool:
        return self.layout is not None

    def tensor_bytes(self, numel: int, stored: torch.dtype) -> int:
        """Bytes a weight tensor of `numel` elements, stored in the checkpoint as `stored`, takes in this format."""
        if self.dtype is not None:
            return numel * self.dtype.itemsize
        return self.layout.stored_bytes(numel, stored)

    def scale_bytes(self, numel: int) -> int:
        """Bytes a checkpoint's scale tensor takes: kept (fp32) beside weights held as released, else gone."""
        return numel * 4 if self.as_released else 0


FP32 = WeightFormat("fp32", dtype=torch.float32)
BF16 = WeightFormat("bf16", dtype=torch.bfloat16, kernel_code=arrays.BF16)
FP16 = WeightFormat("fp16", dtype=torch.float16)
FP8 = WeightFormat("fp8", layout=Fp8Blocks, kernel_code=arrays.FP8, as_released=True)
INT8 = WeightFormat("int8", layout=Int8Rows, kernel_code=arrays.INT8, converted=True)
INT4 = WeightFormat("int4", layout=Int4Groups, kernel_code=arrays.INT4, converted=True, cpu_only=True)
GGUF = WeightFormat("gguf", layout=GgufBlocks, as_released=True, cpu_only=True)  # a GGUF file's block types
FORMATS: dict[str, WeightFormat] = {fmt: fmt for fmt in (FP32, BF16, FP16, FP8, INT8, INT4, GGUF)}

FLOAT_FORMATS = {fmt: fmt.dtype for fmt in FORMATS.values() if fmt.dtype is not None}  # how float weights are held
FORMAT_OF_DTYPE = {dtype: fmt for fmt, dtype in FLOAT_FORMATS.items()}
CONVERTED_FORMATS = tuple(fmt for fmt in FORMATS.values() if fmt.converted)
WEIGHT_FORMATS = ("auto", FP8, INT8, INT4, BF16, FP32, GGUF)  # what routed experts in RAM may be held in
# how the text model's dense matrices on the CPU are held; "auto": the compute dtype (FP8 as released where the plan
# keeps it on a GPU), int8/int4: weight-only, as the routed experts' stores (formats/dense.py)
DENSE_FORMATS = ("auto", *CONVERTED_FORMATS)
KV_FORMATS = ("auto", *FLOAT_FORMATS, INT8)  # "auto": the compute dtype; int8: models/kv_cache.py's scaled rows


def format_named(name: str) -> WeightFormat:
    """The format of this name (ValueError if there is none)."""
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; formats: {', '.join(FORMATS)}")
    return FORMATS[name]


def checked_kv_format(kv_dtype: str | None) -> str:
    """A KV cache format name (None means "auto"), refused with a GenerationError if unknown."""
    if kv_dtype is not None and kv_dtype not in KV_FORMATS:
        raise GenerationError(f"kv_dtype is {kv_dtype!r}; use one of {', '.join(KV_FORMATS)} (auto: the compute "
                              "dtype; int8: about half the memory of a bfloat16 cache).")
    return kv_dtype or "auto"
