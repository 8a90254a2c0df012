"""The kernels of a decoding step's few rows that know no model (kernels/cpu_numba.py; step_kernels.py says what
each is worth): a dense matrix's product (DenseKernel) and an RMSNorm of bf16 rows (NormKernel), and how bf16 rows
pass to and from the kernels (as their bit patterns, int16).
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from torch import nn

from ..formats.dense import QuantizedLinear
from ..formats.kernel_stores import KERNEL_FORMATS, dequantized_product, kernel_arrays
from ..kernels.arrays import plain_cpu
from ..kernels.numba_threads import LOCK, set_threads
from ..formats.lora import LowRank, side_paths
from ..formats.table import BF16, format_named
from ..kernels.arrays import Matrix
from ..kernels.cpu_linear import GEMV_MAX_ROWS, CpuLinear, FusedLinear
from ..kernels.gguf_blocks import BlocksRows


class DenseKernel:
    """A dense matrix's product with few rows by the numba kernel (cpu_numba.matrix_rows), for the CpuLinear,
    FusedLinear or QuantizedLinear that holds the matrix and calls it (not a module: the matrix stays its owner's).
    Rows are summed in fp32 from the exact weights and rounded once to the input's dtype. A quantized matrix's
    products of more rows take its kernel-dequantized weights and torch's product, as the routed experts' do."""

    def __init__(self, fmt: str, stack: nn.Module | torch.Tensor, kernels: ModuleType, side: LowRank | None = None):
        self.fmt = format_named(fmt)
        self.code, self.kernels = self.fmt.kernel_code, kernels
        self.arrays = kernel_arrays(stack)
        self.quantized = self.fmt.quantized
        self.shape = tuple(stack.shape[1:])  # (out, in)
        # a LoRA side path, for the fused steps only: this kernel's own products are the module's, whose side path
        # its owner adds (runtime/adapters.py)
        self.side = side_arrays(side)

    @property
    def matrix(self) -> Matrix:
        """The matrix (with its side path, if any) as the fused steps read it."""
        return Matrix(self.code, *self.arrays, *self.side)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernel computes this product: a plain CPU tensor of few rows, or of any rows when quantized."""
        return (self.quantized or x.numel() <= GEMV_MAX_ROWS * x.shape[-1]) and plain_cpu(x)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() > GEMV_MAX_ROWS * x.shape[-1]:  # quantized (takes): no bias
            return dequantized_product(self.kernels, self.code, self.arrays, self.shape, 0, x)
        if x.dtype == torch.bfloat16 and bias is None:  # bf16 in and out as bit patterns: no torch conversions
            rows, out = bf16_arrays(x, self.shape[0])
            with LOCK:
                set_threads()
                self.kernels.bf16_matrix_rows(self.code, *self.arrays, rows, out.numpy())
            return bf16_tensor(out, (*x.shape[:-1], self.shape[0]))
        rows = x.detach().float().reshape(-1, x.shape[-1]).contiguous().numpy()
        out = torch.empty(*x.shape[:-1], self.shape[0])
        with LOCK:
            set_threads()
            self.kernels.matrix_rows(self.code, *self.arrays, rows, out.view(len(rows), -1).numpy())
        if bias is not None:
            out += bias
        return out.to(x.dtype)


class NormKernel:
    """An RMSNorm of a decoding step's bf16 rows by the numba kernel (cpu_numba.rms_norm_bf16), for the RMSNorm that
    calls it (models/layers.py): torch computes a norm in about ten small calls. Holds the norm's scale (weight plus
    offset) in fp32."""

    def __init__(self, norm: nn.Module, kernels: ModuleType):
        self.kernels = kernels
        self.scale = (norm.weight.detach().float() + norm.offset).contiguous().numpy()
        self.eps = np.float32(norm.eps)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether x is a decoding step's (one token per sequence: [B, 1, ...]) plain bf16 CPU tensor."""
        return x.dtype == torch.bfloat16 and x.dim() >= 3 and x.shape[1] == 1 and plain_cpu(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, out = bf16_arrays(x)
        self.kernels.rms_norm_bf16(rows, self.scale, self.eps, out.numpy())
        return bf16_tensor(out, x.shape)


def input_matrices(module: nn.Module) -> list[tuple[nn.Module | torch.Tensor, LowRank | None]]:
    """The matrices of the Linears named in `module.input_projections`, in order, with their LoRA side paths: each
    Linear, or its rows of the fused projection's bf16 weight that took their place (kernels/cpu_linear.py)."""
    fused = module.fused_projection
    if isinstance(fused, FusedLinear):
        sides = side_paths(fused)
        return [(w, sides.get(i)) for i, w in enumerate(fused.weight.split(fused.sizes))]
    return [with_side_path(module.get_submodule(name)) for name in module.input_projections]


def with_side_path(module: nn.Module) -> tuple[nn.Module, LowRank | None]:
    return module, side_paths(module).get(None)


def bf16_arrays(x: torch.Tensor, out_width: int | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """The bit patterns of x's bf16 rows (int16 [N, D], a numpy view) and an empty int16 tensor [N, out_width]
    (default D) for a kernel's output. The output is torch's own allocation, not numpy's: torch's kernels may assume
    its 64-byte alignment (its int8 weight-only product crashes on a row numpy allocated)."""
    rows = x.detach().contiguous().view(torch.int16).numpy()
    rows = rows.reshape(-1, rows.shape[-1])
    return rows, torch.empty((len(rows), out_width or rows.shape[1]), dtype=torch.int16)


def bf16_tensor(bits: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A kernel's output bit patterns (int16) as the bf16 tensor of `shape` they are."""
    return bits.view(torch.bfloat16).view(shape)


def side_arrays(side: LowRank | None) -> tuple[np.ndarray, ...]:
    """A LoRA side path's matrices as the fused steps read them (kernels.arrays.Matrix's side_a, side_b), or ()."""
    return () if side is None else tuple(t.detach().float().contiguous().numpy() for t in (side.a, side.b))


def dense_kernel(matrix: nn.Module | torch.Tensor, kernels: ModuleType, side: LowRank | None = None
                 ) -> DenseKernel | BlocksRows | None:
    """The few-row kernel of a bf16 weight or bias-free CpuLinear, or of a QuantizedLinear in a kernel format or in
    a GGUF file's blocks of a type its kernels multiply (BlocksRows), with the LoRA side path `side` for the fused
    steps; None where the kernels cannot read it."""
    if isinstance(matrix, QuantizedLinear):
        if not plain_cpu(*matrix.buffers()):
            return None
        if matrix.fmt in KERNEL_FORMATS:
            return DenseKernel(matrix.fmt, matrix.matrix, kernels, side)
        own = getattr(matrix.matrix.layout, "rows_kernel", None)  # a layout with kernels of its own (GGUF blocks)
        return None if own is None else own(matrix.fmt, matrix.matrix.q, matrix.input_order, side_arrays(side))
    if isinstance(matrix, CpuLinear) and matrix.bias is None:
        matrix = matrix.weight.data
    ok = isinstance(matrix, torch.Tensor) and matrix.dtype == torch.bfloat16 and plain_cpu(matrix) \
        and matrix.is_contiguous() and (side is None or plain_cpu(side.a, side.b))
    return DenseKernel(BF16, matrix[None], kernels, side) if ok else None
