"""Routed experts on the CPU computed by one compiled call per layer (numba, cpu_kernels.py) when a step has few rows.

Decoding multiplies each of a token's top-k experts by one row. As torch calls that is three products per expert and
layer, each with a fixed cost, and torch's weight-only int8 kernel reads its matrix at about half the memory
bandwidth. The kernel computes the layer's whole routed step (gate/up rows, SiLU(gate) * up, down rows, the
routing-weighted sum) for up to KERNEL_MAX_ROWS rows in one call, reading each chosen expert once, its output rows
split over torch's thread count; bench/expert_step.py measures both. More rows (prefill) take the store's own torch
products: there the products are matrix-matrix and already efficient.

Applied at load by prepare_cpu as a module swap of CPU expert stores: int8 and FP8 (as released: 128x128 block scales,
decoded in the kernel through a table, so FP8 checkpoints need no converted cache) use the store's tensors as they
are; int4 is re-laid-out from torch's kernel layout into contiguous rows once (kernel_int4_rows) and computes many
rows by decoding an expert to fp32 (the kernel's decoder) and one product.

numba compiles the kernel on first use and keeps it in its on-disk cache: in this package's __pycache__ when that is
writable, else in the user's cache directory (numba's own choice; NUMBA_CACHE_DIR overrides it). Nothing is swapped,
and the torch path runs unchanged, when numba is not installed, when the kernel fails to compile or to reproduce a
small product, or when the environment sets A3B_NO_NUMBA=1.
"""
from __future__ import annotations

import os
import threading
import warnings
from functools import cache
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .experts import CpuFloatExperts, QuantizedExperts, QuantizedStack

# From this many rows on, a step keeps torch's products: the kernel dots every decoded weight row with each row that
# routed to its expert, one fp32 dot at a time, which costs about as much as torch's matrix-matrix products by ~8 rows
# (batched decode and per-image mode stay below it; prefill is far above)
KERNEL_MAX_ROWS = 8
KERNEL_FORMATS = ("int8", "fp8", "int4")
INT4_ROW_BLOCK = 32  # torch's CPU int4 layout packs 32 output rows per block (checked against torch at load)
_LOCK = threading.Lock()  # numba's thread pools do not all accept calls from two threads at once


def kernels_enabled() -> bool:
    """True when routed-expert kernels are used: not switched off by A3B_NO_NUMBA=1, and numba compiles them."""
    return os.environ.get("A3B_NO_NUMBA", "0") in ("", "0") and compiled_kernels() is not None


@cache
def compiled_kernels() -> ModuleType | None:
    """cpu_kernels.py compiled and checked against torch on a small step, or None (with a warning) if it fails."""
    try:
        from . import cpu_kernels
    except ImportError:
        return None
    try:
        check_kernels(cpu_kernels)
    except Exception as exc:  # numba's compile errors have many types; any failure means the torch path
        warnings.warn(f"a3b_core: numba could not compile the CPU expert kernels ({exc}); using torch's products "
                      "(slower decoding on the CPU). Set A3B_NO_NUMBA=1 to skip the attempt.", stacklevel=2)
        return None
    return cpu_kernels


def check_kernels(kernels: ModuleType) -> None:
    """One routed step of two rows on tiny int8 experts equals the same step in fp64."""
    g = torch.Generator().manual_seed(0)
    experts = QuantizedExperts("int8", 4, 32, 16)
    for e in range(4):
        experts.gate_up_proj.set(e, torch.randn(32, 32, generator=g))
        experts.down_proj.set(e, torch.randn(32, 16, generator=g))
    x = torch.randn(2, 32, generator=g)
    ids, weights = torch.tensor([[1, 3], [3, 0]]), torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    got = KernelExperts(experts, kernels).routed_step(x, ids, weights).double()
    want = torch.zeros(2, 32, dtype=torch.float64)
    for t in range(2):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            gate, up = (experts.gate_up_proj.dequantize(e).double() @ x[t].double()).chunk(2)
            want[t] += w * experts.down_proj.dequantize(e).double() @ (F.silu(gate) * up)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
        raise ValueError("the kernel's result differs from the reference")


def _empty(dtype: type, ndim: int) -> np.ndarray:
    """A placeholder for the arrays a format does not use (cpu_kernels takes every array in every call)."""
    return np.zeros((0,) * (ndim - 1) + ((2,) if ndim == 4 else (0,)), dtype)


class KernelMatrices(nn.Module):
    """One fused matrix stack of a layer's experts as the kernel reads it, and its numpy views: a quantised stack's
    buffers under its names `q` and `scale` (int4's re-laid-out), or a bf16 stack [E, out, in] as `weight`."""

    def __init__(self, fmt: str, stack: QuantizedStack | torch.Tensor):
        super().__init__()
        self.arrays = {"q": _empty(np.uint8, 4), "q16": _empty(np.uint16, 3), "scale": _empty(np.float32, 3),
                       "sz": _empty(np.uint16, 4)}
        if fmt == "bf16":
            self.weight = stack
            self.shape = tuple(stack.shape)
            self.arrays["q16"] = stack.detach().view(torch.int16).numpy().view(np.uint16)
            return
        self.shape = stack.shape
        if fmt == "int4":
            self.q = nn.Buffer(kernel_int4_rows(stack.q, stack.group))
            self.scale = nn.Buffer(stack.scale.transpose(1, 2).contiguous())  # [E, out, groups, 2]: a row's in a row
        else:
            self.q, self.scale = stack.q, stack.scale
        q = self.q.view(torch.uint8).numpy()
        if fmt == "int8":
            self.arrays["q"] = q  # [E, chunks, out, chunk]
            self.arrays["scale"] = self.scale.float().numpy()[:, :, None].copy()
        elif fmt == "fp8":
            self.arrays["q"] = q[:, None]
            self.arrays["scale"] = self.scale.numpy()
        else:
            self.arrays["q"] = q[:, None]
            self.arrays["sz"] = self.scale.view(torch.int16).numpy().view(np.uint16)


def kernel_int4_rows(packed: torch.Tensor, group: int) -> torch.Tensor:
    """torch's CPU int4 layout [E, out, in/2] (blocks of 32 output rows: per input, byte j holds row j in its low
    nibble and row 16 + j in its high one) -> contiguous rows [E, out, in/2], byte j of each group of `group` inputs
    holding input j (low nibble) and input group/2 + j (high): a row decodes with contiguous loads."""
    e, out, half_in = packed.shape
    rows = torch.empty_like(packed)
    for expert in range(e):  # one expert at a time: the unpacked nibbles take twice the packed bytes
        blocks = packed[expert].view(out // INT4_ROW_BLOCK, 2 * half_in, INT4_ROW_BLOCK // 2)
        nibbles = torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(out, 2 * half_in)
        halves = nibbles.view(out, -1, 2, group // 2)
        rows[expert] = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, half_in)
    return rows


@cache
def int4_layout_known() -> bool:
    """torch's int4 packing is the layout kernel_int4_rows reads (it is torch's internal format): a packed probe
    unpacks to its own values."""
    values = torch.randint(0, 16, (64, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
    if packed.shape != (64, 128) or packed.dtype != torch.uint8:
        return False
    rows = kernel_int4_rows(packed[None], 128)[0].view(64, 2, 64)
    unpacked = torch.cat([rows & 15, rows >> 4], dim=2).reshape(64, 256)  # one group of 128: low half, high half
    return torch.equal(unpacked.int(), values)


class KernelExperts(nn.Module):
    """A layer's routed experts on the CPU whose routed step of up to KERNEL_MAX_ROWS rows is one kernel call
    (`routed_step`); `gate_up(e, x)` / `down(e, x)` serve more rows as the store they replace did."""

    FORMAT_CODES = {"int8": 0, "fp8": 1, "int4": 2, "bf16": 3}  # cpu_kernels.INT8, FP8, INT4, BF16
    FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0).numpy()

    def __init__(self, store: QuantizedExperts | CpuFloatExperts, kernels: ModuleType):
        super().__init__()
        self.fmt = store.fmt if isinstance(store, QuantizedExperts) else "bf16"
        self.kernels = kernels
        self.gate_up_proj = KernelMatrices(self.fmt, store.gate_up_proj)
        self.down_proj = KernelMatrices(self.fmt, store.down_proj)
        self.inter = self.down_proj.shape[2]
        self.store_products = None if self.fmt == "int4" else (store.gate_up, store.down)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def routed_step(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
        """The routed experts' weighted sum for the rows of x [T, H] (None for more than KERNEL_MAX_ROWS rows)."""
        if x.shape[0] > KERNEL_MAX_ROWS:
            return None
        out = np.zeros(tuple(x.shape), np.float32)
        gu, dn = self.gate_up_proj.arrays, self.down_proj.arrays
        with _LOCK:
            self.kernels.set_threads(torch.get_num_threads())
            self.kernels.routed_step(self.FORMAT_CODES[self.fmt], self.inter, gu["q"], gu["q16"], gu["scale"],
                                     gu["sz"], dn["q"], dn["q16"], dn["scale"], dn["sz"], self.FP8_TABLE,
                                     x.detach().float().contiguous().numpy(), top_i.contiguous().numpy(),
                                     top_p.detach().float().contiguous().numpy(), out)
        return torch.from_numpy(out).to(x.dtype)

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.store_products is not None:
            return self.store_products[0](e, x)
        return self.product(self.gate_up_proj, e, x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.store_products is not None:
            return self.store_products[1](e, x)
        return self.product(self.down_proj, e, x)

    def product(self, matrices: KernelMatrices, e: int, x: torch.Tensor) -> torch.Tensor:
        """x @ W_e^T for int4's rows: W_e decoded to fp32 by the kernel's decoder, one bf16 product."""
        w = np.empty(matrices.shape[1:], np.float32)
        a = matrices.arrays
        with _LOCK:
            self.kernels.set_threads(torch.get_num_threads())
            self.kernels.dequantize(self.FORMAT_CODES[self.fmt], a["q"], a["q16"], a["scale"], a["sz"],
                                    self.FP8_TABLE, e, w)
        return F.linear(x.to(torch.bfloat16), torch.from_numpy(w).to(torch.bfloat16))


def swap_in_kernels(text: nn.Module) -> None:
    """Replaces each quantised CPU expert store of `text` by its KernelExperts, when kernels are enabled."""
    if not kernels_enabled():
        return
    kernels = compiled_kernels()
    for name, module in list(text.named_modules()):
        if not (isinstance(module, QuantizedExperts) and module.fmt in KERNEL_FORMATS
                and module.device.type == "cpu"):
            continue
        if module.fmt == "int4" and not (int4_layout_known() and module.gate_up_proj.shape[1] % INT4_ROW_BLOCK == 0
                                         and module.down_proj.shape[1] % INT4_ROW_BLOCK == 0):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(text.get_submodule(parent), leaf, KernelExperts(module, kernels))
