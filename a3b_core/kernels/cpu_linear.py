"""The text model's matrix products on the CPU: bf16 products of one or two rows as matrix-vector products, larger
bf16 products in fp32 where the CPU has no bf16 matrix kernel, products of many rows with a dequantized matrix, and
input projections fused into one matrix.

Where the CPU has AVX-512 bf16, torch hands every bf16 matmul to oneDNN, whose kernel for a single input row reads
the matrix more slowly than torch's own bf16 matrix-vector kernel (fp32 accumulation), which runs near the memory
bandwidth. That kernel runs once per input row, though, so it only pays up to GEMV_MAX_ROWS rows. Where oneDNN has
no bf16 kernel (CPUs without AVX-512, such as most desktop ones), torch multiplies bf16 matrices with a generic
kernel many times slower than its fp32 one, so products of more rows widen their operands to fp32 (the weights a
block of rows at a time) and round the result to bf16 once. The measurements are in the README's benchmark section.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

GEMV_MAX_ROWS = 2  # tuned on an AVX-512 (bf16) EPYC: at two rows the matrix-vector kernel still wins, at three not
WIDENED_ROWS = 4096  # weight rows widened to fp32 at a time: at 2048 inputs a 32 MiB copy, whatever the matrix


@cache
def bf16_matmul_is_native() -> bool:
    """Whether oneDNN multiplies bf16 matrices on this CPU (it needs AVX-512)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; bf16 inputs of up to GEMV_MAX_ROWS rows on the CPU go to the matrix-vector kernel, larger ones on a
    CPU without bf16 matrix kernels are multiplied in fp32. oneDNN's switch is process-wide, so it is off only for
    this call (a bf16 product on another thread in that instant would take the matrix-vector kernel too)."""
    if x.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    # torch._C's switch directly: torch.backends.mkldnn's property costs more than a small product's arithmetic
    if x.numel() <= GEMV_MAX_ROWS * x.shape[-1] and torch._C._get_mkldnn_enabled():
        torch._C._set_mkldnn_enabled(False)
        try:
            return F.linear(x, weight, bias)
        finally:
            torch._C._set_mkldnn_enabled(True)
    if not bf16_matmul_is_native():
        wide = x.float()
        parts = [F.linear(wide, rows.float()) for rows in weight.split(WIDENED_ROWS)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return (out if bias is None else out + bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def many_rows_weight_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype many_rows_product multiplies x's rows in: bf16 for bf16 rows where oneDNN multiplies bf16 (CPUs with
    AVX-512 bf16, where that is the faster product), else fp32. A dequantizing kernel writes its weights in it, so
    no copy converts them."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 and bf16_matmul_is_native() else torch.float32


def many_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T (weight a dequantized matrix, in fp32 or already in many_rows_weight_dtype) in x's dtype: in fp32
    from the exact weights, or in bf16 from them rounded to bf16."""
    if many_rows_weight_dtype(x) == torch.bfloat16:
        return F.linear(x, weight.bfloat16())
    return F.linear(x.float(), weight.float()).to(x.dtype)


class CpuLinear(nn.Module):
    """A Linear on the CPU, its product through `linear`; it holds the same weight (and bias) under the same names as
    the nn.Linear whose place it takes."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.rows_kernel = None  # step_kernels.DenseKernel: products of few rows, when the numba kernels load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None and self.rows_kernel.takes(x):
            return self.rows_kernel(x, self.bias)
        return linear(x, self.weight, self.bias)


def use_cpu_linears(module: nn.Module) -> None:
    """Swaps, in place, every CPU Linear of `module` for a CpuLinear holding the same weight and bias."""
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, CpuLinear(child.weight, child.bias))


class FusedLinear(nn.Module):
    """Several bias-free Linears that read the same input as one product, split into their outputs: fewer, larger
    products (the small ones, such as a router or a per-head gate, cost mostly call overhead)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.sizes = [w.shape[0] for w in weights]
        self.weight = nn.Buffer(torch.cat(weights), persistent=False)
        self.rows_kernel = None  # as CpuLinear's

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        kernel = self.rows_kernel is not None and self.rows_kernel.takes(x)
        return list((self.rows_kernel(x) if kernel else linear(x, self.weight)).split(self.sizes, dim=-1))


def fuse_input_projections(module: nn.Module, release: Callable[[str], None]) -> None:
    """Gives every submodule that lists `input_projections` (Linears reading the same input) one FusedLinear as
    `fused_projection` when they are all bf16 and on the CPU, and removes them; `release(name)` is told each removed
    Linear's name, whose source can then be dropped. The fp32 mode stays layer for layer the reference's."""
    for name in [name for name, child in module.named_modules() if hasattr(child, "input_projections")]:
        owner = module.get_submodule(name)
        linears = [owner.get_submodule(p) for p in owner.input_projections]
        if not all(isinstance(lin, nn.Linear) and lin.bias is None and lin.weight.dtype == torch.bfloat16
                   and lin.weight.device.type == "cpu" for lin in linears):
            continue
        owner.fused_projection = FusedLinear([lin.weight.data for lin in linears])
        del linears
        for p in owner.input_projections:
            parent, _, leaf = p.rpartition(".")
            setattr(owner.get_submodule(parent), leaf, None)
            release(f"{name}.{p}")
