"""Block FP8 (e4m3) with one fp32 scale per 128x128 block, as the official FP8 releases store it: kept as released
(no conversion, no cache), dequantized per use. Also Fp8Linear, a dense layer kept FP8, and the one block-FP8
quantizer (the demo's FP8 release is written with it too)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..release.safetensors import FP8_DTYPES, dequantize_fp8

FP8_BLOCK = 128
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 matrix, scale_inv [ceil(out / 128), ceil(in / 128)] in `scale_dtype`), scale = the
    block's absmax / 448 (1 for an all-zero block), rounded to `scale_dtype` before dividing, so that dequantizing
    with the stored scale gives what was quantized."""
    out, inp = w.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = F.pad(w.float(), (0, cols * FP8_BLOCK - inp, 0, rows * FP8_BLOCK - out))
    blocks = padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    absmax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax)).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(padded.shape)[:out, :inp]
    return q.to(torch.float8_e4m3fn), scale


class Fp8Blocks:
    """A stack of E FP8 matrices [E, out, in]: q e4m3 [E, out, in], scale fp32 [E, ceil(out / 128), ceil(in / 128)]."""
    bf16_products = False  # dequantized in the input's dtype (fp32 inputs: the exact weights)

    def __init__(self, shape: tuple[int, int, int]):
        self.shape = shape

    def empty(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        e, out, inp = self.shape
        return (torch.empty(e, out, inp, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(e, -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK), device=device))

    def set(self, q: torch.Tensor, scale: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        wq, wscale = quantize_fp8(w)
        q[e, rows].copy_(wq)
        scale[e, rows.start // FP8_BLOCK:-(-rows.stop // FP8_BLOCK)].copy_(wscale)

    def set_released(self, q: torch.Tensor, scale: torch.Tensor, e: int, wq: torch.Tensor,
                     scale_inv: torch.Tensor) -> None:
        """Stores an FP8 matrix as released (no requantization)."""
        q[e].copy_(wq)
        scale[e].copy_(scale_inv.float())

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(q[e], scale[e], block=(FP8_BLOCK, FP8_BLOCK), dtype=dtype)

    def cpu_product(self, q: torch.Tensor, scale: torch.Tensor, e: int, x: torch.Tensor) -> None:
        return None  # no CPU product of its own: dequantized, then torch's product

    @staticmethod
    def kernel_arrays(q: torch.Tensor, scale: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """q's bytes as int8 [E, 1, out, in], scale as it is."""
        return q.view(torch.int8).numpy()[:, None], scale.numpy()

    @staticmethod
    def stored_bytes(numel: int, stored: torch.dtype) -> int:
        return numel * (1 if stored in FP8_DTYPES else 2)  # tensors the release stores unquantized stay bf16


class Fp8Linear(nn.Module):
    """A bias-free linear layer kept as released FP8 with its block scales and dequantized per use: on a GPU this
    halves the VRAM of the dense parts of an FP8 checkpoint."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.q = nn.Buffer(q.clone())
        self.scale = nn.Buffer(scale_inv.float().reshape(scale_inv.shape))
        self.block = block
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_fp8(self.q, self.scale, block=self.block, dtype=x.dtype))
