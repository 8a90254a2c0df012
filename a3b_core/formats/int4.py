"""int4, weight-only: asymmetric, groups of 128 inputs (64 or 32 where the input size asks), each with an fp32 scale
and minimum. Converted from the checkpoint's floats at load; computed by the CPU only.

The layout is made for the numba kernels (kernels/cpu_numba.py), which read it with contiguous loads; where they are
not used, TorchInt4Stack repacks it for torch's CPU int4 kernel.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..kernels.cpu_linear import many_rows_product

SCALE_GROUP = 128  # the planner's estimate: a scale and a minimum (8 bytes) per this many weights


def int4_group_size(inp: int) -> int:
    for group in (128, 64, 32):
        if inp % group == 0:
            return group
    raise ValueError(f"int4 needs an input size divisible by 32; got {inp}")


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4, w ~ q * scale + minimum per group of `group` inputs (q in 0..15), as
    (bytes uint8 [out, in / 2], scale and minimum fp32 [out, groups, 2]). A group's bytes are its own: byte j holds
    input j in its low nibble and input j + group / 2 in its high one, so that a kernel reads both halves of a group
    with contiguous loads, whatever the instruction set (the cache on disk is the same everywhere). The scales are
    fp32 because the kernel reads them as they are (bf16 ones, converted per row, cost it 8-13% on an AVX2 EPYC)."""
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :group // 2] | (q[..., group // 2:] << 4)
    return packed.reshape(out, inp // 2), torch.stack([scale, low], dim=-1)


def int4_values(packed: torch.Tensor, group: int) -> torch.Tensor:
    """The 4-bit values (0..15, uint8 [out, in]) of quantize_int4's bytes."""
    halves = packed.view(packed.shape[0], -1, group // 2)
    return torch.cat([halves & 15, halves >> 4], dim=-1).view(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scale_min: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_int4's matrix [out, in] in `dtype` (each weight one fp32 multiply-add, rounded to it once)."""
    out, groups = scale_min.shape[:2]
    values = int4_values(packed, 2 * packed.shape[1] // groups).view(out, groups, -1)
    return torch.addcmul(scale_min[..., 1:], values.float(), scale_min[..., :1]).view(out, -1).to(dtype)


class Int4Groups:
    """A stack of E int4 matrices [E, out, in]: q uint8 [E, out, in / 2] (quantize_int4's bytes), scale fp32
    [E, out, groups, 2] (scale and minimum)."""
    bf16_products = True  # fp32 inputs are multiplied in bf16

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape
        self.group = int4_group_size(shape[2])

    def empty(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        e, out, inp = self.shape
        return (torch.empty(e, out, inp // 2, dtype=torch.uint8, device=device),
                torch.empty(e, out, inp // self.group, 2, device=device))

    def set(self, q: torch.Tensor, scale: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        wq, wscale = quantize_int4(w, self.group)
        q[e, rows].copy_(wq)
        scale[e, rows].copy_(wscale)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(q[e], scale[e], dtype)

    def cpu_product(self, q: torch.Tensor, scale: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        """Without the kernels: dequantized, then one product."""
        return many_rows_product(x, self.dequantize(q, scale, e, torch.float32))

    @staticmethod
    def kernel_arrays(q: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """q as uint8 [E, 1, out, in / 2], each group's scale and minimum side by side [E, out, 2 * groups]."""
        return q.numpy()[:, None], scale.flatten(2).numpy()

    @staticmethod
    def stored_bytes(numel: int, stored: torch.dtype) -> int:
        return numel // 2 + -(-numel // SCALE_GROUP) * 8


class TorchInt4Stack(nn.Module):
    """An int4 QuantizedStack repacked for torch's CPU int4 kernel (groups and values as they are, scales rounded to
    bf16): the products of int4 matrices where the numba kernels are not used. torch's packing depends on the
    instruction set, so it is made at load from the store's own layout, which is what the cache on disk holds."""

    def __init__(self, stack: nn.Module):
        super().__init__()
        self.fmt, self.shape, self.group = stack.fmt, stack.shape, stack.layout.group
        # torch's kernel computes (q - 8) * scale + zero, its scales [groups, out, 2] per matrix
        scale, low = stack.scale.unbind(-1)
        self.scale = nn.Buffer(torch.stack([scale, low + 8 * scale], dim=-1).transpose(1, 2).to(torch.bfloat16)
                               .contiguous())
        self.q = nn.Buffer(torch.stack([torch._convert_weight_to_int4pack_for_cpu(int4_values(q, self.group).int(), 1)
                                        for q in stack.q]))

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        eye = torch.eye(self.shape[2], dtype=torch.bfloat16)  # the packing is the kernel's own: W through it
        return torch._weight_int4pack_mm_for_cpu(eye, self.q[e], self.group, self.scale[e]).t().to(dtype)

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.q[e], self.group, self.scale[e])
