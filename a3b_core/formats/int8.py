"""int8, weight-only: symmetric, one bf16 scale per output row. Converted from the checkpoint's floats at load.

Products of few rows use torch's CPU weight-only int8 kernel, which wants bf16 activations; from
INT8_KERNEL_MAX_ROWS rows on, the matrix is dequantized once and multiplied in bf16. The numba kernels read the
same bytes (kernels/cpu_numba.py).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.cpu_linear import linear

# torch's int8 CPU kernel costs about one whole matrix-vector product per input row (27 us per row at 1024x1024 on
# an AVX-512 EPYC), so from this many rows on, dequantizing to bf16 and one bf16 product is faster (2.2x at 128).
INT8_KERNEL_MAX_ROWS = 32
# int8 matrices are stored as column chunks of this many inputs, one kernel call each: the kernel reads a [out, 512]
# matrix faster per byte than a [out, 1024] one (+10-12% decode with int8 experts on an AVX-512 EPYC).
INT8_K_CHUNK = 512
SCALE_GROUP = 128  # the planner's estimate: one bf16 scale per this many weights (a row has at least as many)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w ~ q * scale."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Rows:
    """A stack of E int8 matrices [E, out, in]: q int8 [E, in / chunk, out, chunk] (column chunks of INT8_K_CHUNK
    inputs, or the whole row where the input size is no multiple of it), scale bf16 [E, out]."""
    bf16_products = True  # fp32 inputs are multiplied in bf16, as torch's int8 kernel does

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape
        self.chunk = INT8_K_CHUNK if shape[2] % INT8_K_CHUNK == 0 else shape[2]

    def empty(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        e, out, inp = self.shape
        return (torch.empty(e, inp // self.chunk, out, self.chunk, dtype=torch.int8, device=device),
                torch.empty(e, out, dtype=torch.bfloat16, device=device))

    def set(self, q: torch.Tensor, scale: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        wq, wscale = quantize_int8(w)
        q[e, :, rows].copy_(wq.view(wq.shape[0], -1, self.chunk).transpose(0, 1))  # [chunks, rows, chunk]
        scale[e, rows].copy_(wscale)

    @staticmethod
    def matrix(q: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's int8 matrix [out, in], its chunks put back side by side (in int8: converting the reassembled
        matrix is 7x faster than converting while reassembling)."""
        return torch.cat(q[e].unbind(), dim=1)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.matrix(q, e).float() * scale[e].float()[:, None]).to(dtype)

    def cpu_product(self, q: torch.Tensor, scale: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= INT8_KERNEL_MAX_ROWS:  # many rows (prefill): dequantize once, one bf16 product
            return linear(x.to(torch.bfloat16), self.matrix(q, e) * scale[e][:, None])  # int8 * bf16: bf16
        parts = x.to(torch.bfloat16).split(self.chunk, dim=-1)
        out = torch._weight_int8pack_mm(parts[0].contiguous(), q[e, 0], scale[e])
        for part, chunk in zip(parts[1:], q[e, 1:]):
            out = out + torch._weight_int8pack_mm(part.contiguous(), chunk, scale[e])
        return out

    @staticmethod
    def kernel_arrays(q: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """q as int8 [E, chunks, out, chunk], scale as fp32 [E, out, 1]."""
        return q.numpy(), scale.float().numpy()[:, :, None].copy()

    @staticmethod
    def stored_bytes(numel: int, stored: torch.dtype) -> int:
        return numel + -(-numel // SCALE_GROUP) * 2
