"""Routed experts on the CPU computed by one compiled call per layer (numba, kernels/cpu_numba.py) when a step has few
rows.

Decoding multiplies each of a token's top-k experts by one row. As torch calls that is three products per expert and
layer, each with a fixed cost, and torch's weight-only int8 kernel reads its matrix at about half the memory
bandwidth. The kernel computes the layer's whole routed step of a decoding step (one row per sequence: gate/up rows,
SiLU(gate) * up, down rows, the routing-weighted sum) in one call, reading each chosen expert once, its output rows
split over torch's thread count; bench/expert_step.py measures both. Prefill multiplies matrices with torch's
product (efficient there), each quantized expert dequantized by a kernel (`dequantized`: 6-8 G weights/s for int8
and int4, 2-3 for FP8, against 0.15-0.3 in torch's operations on an AVX2 EPYC), in fp32, or rounded to bf16 by the
kernel where torch multiplies bf16 (bench/prefill_weights.py measures that). The choice is made per step kind,
not per row count, so that a sequence decodes to the same tokens whatever batch it is in (a row's result from the
kernel does not depend on the other rows, while a prefill's path would then depend on how many rows a batch's last
chunk has).

Applied at load by prepare_cpu as a module swap of CPU expert stores in int8, int4 (int4.quantize_int4's layout, made
for this kernel), FP8 (as released: 128x128 block scales, decoded in the kernel by shifting bits, so FP8
checkpoints need no converted cache) and bf16, reading the store's tensors as they are. bf16 experts are summed in
fp32 from their exact weights (torch's bf16 products round the activations to bf16), and the kernel saves torch's
per-expert calls: in bench/expert_step.py its step ran 1.17-1.34x as fast as torch's products for one row,
1.8x for four. fp32 experts (the reference path) keep torch's products.

numba compiles the kernel on first use and keeps it in its on-disk cache: in this package's __pycache__ when that is
writable, else in the user's cache directory (numba's own choice; NUMBA_CACHE_DIR overrides it). Nothing is swapped,
and the torch path runs unchanged, when numba is not installed, when the kernel fails to compile or to reproduce a
small product, or when the environment sets A3B_NO_NUMBA=1. Tensors without data numpy can read (torch's fake
tensors, which check a model's shapes and devices without computing) keep the torch path too: a store made of them
is not swapped, and a decoding step given them runs the store's products.
"""
from __future__ import annotations

from functools import cache
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu_linear import many_rows_product, many_rows_weight_dtype
from ..kernels.arrays import Matrix, RoutedExperts, plain_cpu
from ..kernels.numba_threads import LOCK, checked_module, numba_allowed, set_threads
from .stores import CpuFloatExperts, QuantizedExperts
from .table import BF16, FORMATS, INT4, INT8

# the formats the kernels read, by their code; quantized stores in these are swapped, and bf16 CpuFloatExperts
FORMAT_CODES = {fmt: fmt.kernel_code for fmt in FORMATS.values() if fmt.kernel_code is not None}
KERNEL_FORMATS = tuple(fmt for fmt in FORMAT_CODES if fmt.quantized)


def kernels_enabled() -> bool:
    """True when routed-expert kernels are used: not switched off by A3B_NO_NUMBA=1, and numba compiles them."""
    return numba_allowed() and compiled_kernels() is not None


@cache
def compiled_kernels() -> ModuleType | None:
    """cpu_numba.py compiled and checked against torch on a small step, or None (with a warning) if it fails."""
    def load() -> ModuleType:
        from ..kernels import cpu_numba
        return cpu_numba
    return checked_module(load, check_kernels, "the CPU expert kernels",
                          "torch's products (slower decoding on the CPU)")


def check_kernels(kernels: ModuleType) -> None:
    """One routed step of two rows on tiny int8 and int4 experts, and on the int8 ones in bf16 (the kernels' three
    compiled signatures), equals the same step in fp64, with rows of 128 inputs (the vector code of int8's and int4's
    codes) and of 32 (their loops); the int8 and int4 experts dequantize to their own weights, in fp32 and rounded to
    bf16."""
    g = torch.Generator().manual_seed(0)
    matrices = [(torch.randn(64, 128, generator=g), torch.randn(128, 32, generator=g)) for _ in range(4)]
    stores = [QuantizedExperts(fmt, 4, 128, 32) for fmt in (INT8, INT4)]
    for store in stores:
        for e, (gate_up, down) in enumerate(matrices):
            store.gate_up_proj.set(e, gate_up)
            store.down_proj.set(e, down)
    int8 = stores[0]
    stores.append(CpuFloatExperts(*(nn.Parameter(torch.stack([stack.dequantize(e) for e in range(4)]).bfloat16())
                                    for stack in (int8.gate_up_proj, int8.down_proj))))
    x = torch.randn(2, 128, generator=g)
    ids, weights = torch.tensor([[1, 3], [3, 0]]), torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    for store in stores:
        got = KernelExperts(store, kernels).routed_step(x, ids, weights).double()
        want = torch.zeros(2, 128, dtype=torch.float64)
        for t in range(2):
            for e, w in zip(ids[t].tolist(), weights[t].tolist()):
                gate, up = (matrix(store.gate_up_proj, e).double() @ x[t].double()).chunk(2)
                want[t] += w * matrix(store.down_proj, e).double() @ (F.silu(gate) * up)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
            raise ValueError("the kernel's result differs from the reference")
    for store in stores[:2]:
        stack = store.gate_up_proj
        for dtype in (torch.float32, torch.bfloat16):
            weight = dequantized(kernels, store.fmt.kernel_code, kernel_arrays(stack), stack.shape[1:],
                                 1, dtype)
            if not torch.equal(weight, stack.dequantize(1).to(dtype)):
                raise ValueError("the dequantizing kernel's matrix differs from the store's")


def matrix(stack: nn.Module | torch.Tensor, e: int) -> torch.Tensor:
    """Expert e's matrix of a quantized stack or a float expert tensor, in fp32."""
    return stack[e].float() if isinstance(stack, torch.Tensor) else stack.dequantize(e)


def kernel_arrays(stack: nn.Module | torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' numpy views of a quantized stack (its layout's kernel_arrays) or of a bf16 tensor [E, out, in]
    (as int16 [E, 1, out, in] and an empty scale), as cpu_numba.py reads them."""
    if isinstance(stack, torch.Tensor):
        return stack.view(torch.int16).numpy()[:, None], np.empty((0, 0, 0), np.float32)
    return stack.layout.kernel_arrays(stack.q, stack.scale)


class KernelMatrices(nn.Module):
    """One fused matrix stack of a layer's experts as the kernel reads it: the store's tensors under the names `q`
    and `scale` (None for bf16), their numpy views `arrays` (kernel_arrays), and `shape` (E, out, in)."""

    def __init__(self, stack: nn.Module | torch.Tensor):
        super().__init__()
        self.shape = tuple(stack.shape)
        if isinstance(stack, torch.Tensor):  # bf16 experts' tensor, registered as a buffer as a quantized stack's are
            self.register_buffer("q", stack.data, persistent=False)
            self.scale = None
            self.arrays = kernel_arrays(self.q)
        else:
            self.q, self.scale = stack.q, stack.scale
            self.arrays = kernel_arrays(stack)

    @property
    def dtype(self) -> torch.dtype:
        """The stored elements' dtype (bf16 for float experts, as the tensor it replaces)."""
        return self.q.dtype


class KernelExperts(nn.Module):
    """A layer's int8, int4, FP8 or bf16 routed experts on the CPU whose decoding step is one kernel call
    (`routed_step`); `gate_up(e, x)` / `down(e, x)` serve prefill: a quantized expert dequantized by the kernel and
    torch's product (many_rows_product), bf16 experts and rows without data through the store's own products."""

    def __init__(self, store: QuantizedExperts | CpuFloatExperts, kernels: ModuleType):
        super().__init__()
        self.fmt, self.kernels = getattr(store, "fmt", BF16), kernels
        self.gate_up_proj = KernelMatrices(store.gate_up_proj)
        self.down_proj = KernelMatrices(store.down_proj)
        self.inter = store.down_proj.shape[2]
        self.store_products = {"gate_up": store.gate_up, "down": store.down}

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.product("gate_up", self.gate_up_proj, e, x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.product("down", self.down_proj, e, x)

    def product(self, which: str, matrices: KernelMatrices, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.fmt.quantized or not plain_cpu(x):
            return self.store_products[which](e, x)
        return dequantized_product(self.kernels, self.fmt.kernel_code, matrices.arrays, matrices.shape[1:], e, x)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def takes(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> bool:
        """Whether `routed_step` can compute these rows (plain CPU tensors); the caller uses gate_up/down if not."""
        return plain_cpu(x, top_i, top_p)

    def step_experts(self) -> RoutedExperts:
        """The experts as the fused decoding steps read them."""
        code = self.fmt.kernel_code
        return RoutedExperts(Matrix(code, *self.gate_up_proj.arrays), Matrix(code, *self.down_proj.arrays), self.inter)

    def routed_step(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for the rows of x [N, H] (top_i, top_p [N, k])."""
        out = np.zeros(tuple(x.shape), np.float32)
        with LOCK:
            set_threads()
            self.kernels.routed_step(self.fmt.kernel_code, self.inter, *self.gate_up_proj.arrays,
                                     *self.down_proj.arrays, x.detach().float().contiguous().numpy(),
                                     top_i.contiguous().numpy(), top_p.detach().float().contiguous().numpy(), out)
        return torch.from_numpy(out).to(x.dtype)


def dequantized(kernels: ModuleType, code: int, arrays: tuple[np.ndarray, np.ndarray], shape: tuple[int, int],
                e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Matrix e [out, in] of a quantized stack's kernel arrays (kernel_arrays), in fp32, or in bf16 (the fp32
    weights rounded to the nearest even, as torch rounds them)."""
    out = torch.empty(shape, dtype=dtype)
    with LOCK:
        set_threads()
        if dtype == torch.bfloat16:
            kernels.dequantize_bf16(code, *arrays, e, out.view(torch.int16).numpy())
        else:
            kernels.dequantize(code, *arrays, e, out.numpy())
    return out


def dequantized_product(kernels: ModuleType, code: int, arrays: tuple[np.ndarray, np.ndarray],
                        shape: tuple[int, int], e: int, x: torch.Tensor) -> torch.Tensor:
    """x times matrix e of a quantized stack's kernel arrays, for many rows (prefill): the matrix dequantized by the
    kernel in the dtype the product multiplies in (many_rows_weight_dtype), so no copy converts it, then torch's
    product."""
    return many_rows_product(x, dequantized(kernels, code, arrays, shape, e, many_rows_weight_dtype(x)))


def swap_in_kernels(text: nn.Module) -> None:
    """Replaces each int8, int4, FP8 or bf16 CPU expert store of `text` by its KernelExperts, when kernels are
    enabled."""
    if not kernels_enabled():
        return
    kernels = compiled_kernels()
    for name, module in list(text.named_modules()):
        quantized = isinstance(module, QuantizedExperts) and module.fmt in KERNEL_FORMATS
        bf16 = isinstance(module, CpuFloatExperts) and module.gate_up_proj.dtype == torch.bfloat16
        if not ((quantized or bf16) and plain_cpu(*module.buffers(), *(p.data for p in module.parameters()))):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(text.get_submodule(parent), leaf, KernelExperts(module, kernels))
