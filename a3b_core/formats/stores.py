"""Routed-expert stores: one layer's experts in one storage format, FP8 as released or converted to int8 or int4
(weight-only), and the CPU form of float experts. Every store offers the same interface as the model's own float
experts: `device` (where the layer's experts are computed), `gate_up(e, x)` and `down(e, x)` (x @ W_e^T), so the MoE
layer's loop does not care how the weights are stored. int8 uses torch's CPU weight-only kernel, which wants bf16
activations, for few rows; int4 is held in a layout of its own (quantize_int4), which the numba kernels read with
contiguous loads (kernel_experts.py) and which is repacked for torch's int4 kernel where they are not used
(TorchInt4Stack).
Products of many rows, and FP8's, dequantise the expert used. Also Fp8Linear, a dense layer kept FP8.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import PlacementError
from ..kernels.cpu_linear import linear, many_rows_product
from ..release.safetensors import dequantize_fp8
from ..runtime import devices

FP8_BLOCK = 128
CONVERTED_FORMATS = ("int8", "int4")  # converted once at load and cached; FP8 is kept as released
# torch's int8 CPU kernel costs about one whole matrix-vector product per input row (27 us per row at 1024x1024 on
# an AVX-512 EPYC), so from this many rows on, dequantising to bf16 and one bf16 product is faster (2.2x at 128).
INT8_KERNEL_MAX_ROWS = 32
# int8 matrices are stored as column chunks of this many inputs, one kernel call each: the kernel reads a [out, 512]
# matrix faster per byte than a [out, 1024] one (+10-12% decode with int8 experts on an AVX-512 EPYC).
INT8_K_CHUNK = 512
# QuantizedStack.set may fill a matrix a part at a time at multiples of this many rows: a whole FP8 scale block.
SET_ROWS_MULTIPLE = 128


class CpuFloatExperts(nn.Module):
    """Float experts on the CPU, their products of one or two rows through the matrix-vector kernel (products.py).
    Same tensors, same names as the model's own float experts, whose place it takes."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    @property
    def device(self) -> torch.device:
        return self.gate_up_proj.device

    # the product runs in the experts' own dtype (the plan's format, which may differ from the compute dtype)
    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(self.gate_up_proj.dtype), self.gate_up_proj[e])

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(self.down_proj.dtype), self.down_proj[e])


class QuantizedStack(nn.Module):
    """E matrices [E, out, in] stored as int8 (per output row scale), int4 (group-wise fp32 scale and minimum,
    quantize_int4's layout) or FP8 (128x128 block scales); `matmul(e, x)` = x @ W_e^T."""

    def __init__(self, fmt: str, shape: tuple[int, int, int], device: torch.device | str = "cpu"):
        super().__init__()
        e, out, inp = shape
        self.fmt, self.shape = fmt, shape
        if fmt == "int8":
            self.chunk = INT8_K_CHUNK if inp % INT8_K_CHUNK == 0 else inp
            self.q = nn.Buffer(torch.empty(e, inp // self.chunk, out, self.chunk, dtype=torch.int8, device=device))
            self.scale = nn.Buffer(torch.empty(e, out, dtype=torch.bfloat16, device=device))
        elif fmt == "int4":
            self.group = int4_group_size(inp)
            self.q = nn.Buffer(torch.empty(e, out, inp // 2, dtype=torch.uint8, device=device))
            self.scale = nn.Buffer(torch.empty(e, out, inp // self.group, 2, device=device))
        elif fmt == "fp8":
            self.q = nn.Buffer(torch.empty(e, out, inp, dtype=torch.float8_e4m3fn, device=device))
            self.scale = nn.Buffer(torch.empty(e, -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK), device=device))
        else:
            raise ValueError(f"unknown quantised format {fmt!r}")

    def set(self, e: int, w: torch.Tensor, first_row: int = 0) -> None:
        """Quantises one expert's fp32 matrix [out, in] into slot e; or, from `first_row` on, some of its rows [n, in]
        (n a multiple of SET_ROWS_MULTIPLE unless they end the matrix), which quantise as they would in the whole."""
        rows = slice(first_row, first_row + w.shape[0])
        if first_row % SET_ROWS_MULTIPLE or (rows.stop != self.shape[1] and w.shape[0] % SET_ROWS_MULTIPLE):
            raise ValueError(f"rows {rows.start}:{rows.stop} of {self.shape[1]}: a part must start and end at "
                             f"multiples of {SET_ROWS_MULTIPLE} rows (or at the matrix's end)")
        if self.fmt == "int8":
            q, scale = quantize_int8(w)
            self.q[e, :, rows].copy_(q.view(q.shape[0], -1, self.chunk).transpose(0, 1))  # [chunks, out, chunk]
            self.scale[e, rows].copy_(scale)
        elif self.fmt == "int4":
            q, scale = quantize_int4(w, self.group)
            self.q[e, rows].copy_(q)
            self.scale[e, rows].copy_(scale)
        else:
            q, scale = quantize_fp8(w)
            self.q[e, rows].copy_(q)
            self.scale[e, rows.start // FP8_BLOCK:-(-rows.stop // FP8_BLOCK)].copy_(scale)

    def set_fp8(self, e: int, q: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Stores an FP8 matrix as released (no requantisation)."""
        self.q[e].copy_(q)
        self.scale[e].copy_(scale_inv.float())

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's matrix [out, in] in `dtype` (fp32 products rounded to it once)."""
        if self.fmt == "int8":
            return (self.int8_matrix(e).float() * self.scale[e].float()[:, None]).to(dtype)
        if self.fmt == "int4":
            return dequantize_int4(self.q[e], self.scale[e], dtype)
        return dequantize_fp8(self.q[e], self.scale[e], block=(FP8_BLOCK, FP8_BLOCK), dtype=dtype)

    def int8_matrix(self, e: int) -> torch.Tensor:
        """Expert e's int8 matrix [out, in], its chunks put back side by side (in int8: converting the
        reassembled matrix is 7x faster than converting while reassembling)."""
        return torch.cat(self.q[e].unbind(), dim=1)

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.q.device.type == "cpu":
            if self.fmt == "int8" and x.shape[0] < INT8_KERNEL_MAX_ROWS:
                parts = x.to(torch.bfloat16).split(self.chunk, dim=-1)
                out = torch._weight_int8pack_mm(parts[0].contiguous(), self.q[e, 0], self.scale[e])
                for part, q in zip(parts[1:], self.q[e, 1:]):
                    out = out + torch._weight_int8pack_mm(part.contiguous(), q, self.scale[e])
                return out
            if self.fmt == "int8":  # many rows (prefill): dequantise once, one bf16 product
                return linear(x.to(torch.bfloat16), self.int8_matrix(e) * self.scale[e][:, None])  # int8 * bf16: bf16
            if self.fmt == "int4":  # the kernels' layout, without them: dequantised, then one product
                return many_rows_product(x, self.dequantize(e))
        compute = torch.bfloat16 if x.dtype == torch.float32 and self.fmt != "fp8" else x.dtype
        return linear(x.to(compute), self.dequantize(e, compute)).to(x.dtype)


class QuantizedExperts(nn.Module):
    def __init__(self, fmt: str, num_experts: int, hidden: int, inter: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.fmt = fmt
        self.gate_up_proj = QuantizedStack(fmt, (num_experts, 2 * inter, hidden), device)
        self.down_proj = QuantizedStack(fmt, (num_experts, hidden, inter), device)

    @property
    def device(self) -> torch.device:
        return self.gate_up_proj.q.device

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up_proj.matmul(e, x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(e, x)


def int4_group_size(inp: int) -> int:
    for group in (128, 64, 32):
        if inp % group == 0:
            return group
    raise ValueError(f"int4 needs an input size divisible by 32; got {inp}")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8: w ~ q * scale."""
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


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


class TorchInt4Stack(nn.Module):
    """An int4 QuantizedStack repacked for torch's CPU int4 kernel (groups and values as they are, scales rounded to
    bf16): the products of int4 matrices where the numba kernels are not used. torch's packing depends on the
    instruction set, so it is made at load from the store's own layout, which is what the cache on disk holds."""

    def __init__(self, stack: QuantizedStack):
        super().__init__()
        self.fmt, self.shape, self.group = "int4", stack.shape, stack.group
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


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 block FP8 (e4m3) with one fp32 scale per block, as the official FP8 releases store it."""
    out, inp = w.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = F.pad(w, (0, cols * FP8_BLOCK - inp, 0, rows * FP8_BLOCK - out))
    blocks = padded.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:out, :inp].to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    """A bias-free linear layer kept as released FP8 with its block scales and dequantised per use: on a GPU this
    halves the VRAM of the dense parts of an FP8 checkpoint."""

    def __init__(self, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.q = nn.Buffer(q.clone())
        self.scale = nn.Buffer(scale_inv.float().reshape(scale_inv.shape))
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_fp8(self.q, self.scale, block=self.block, dtype=x.dtype))


ExpertMatrix = Callable[[str, int], torch.Tensor]  # (which, expert) -> fp32 [out, in]; which: gate_up_proj / down_proj
ReleasedFp8 = Callable[[str, int], "tuple[torch.Tensor, torch.Tensor] | None"]  # -> (e4m3 matrix, block scales)


def convert_experts(fmt: str, shape: tuple[int, int, int], matrix: ExpertMatrix, released_fp8: ReleasedFp8,
                    device: torch.device, cache_file: Path | None, release: Callable[[], None]) -> QuantizedExperts:
    """One layer's routed experts (num_experts, hidden, intermediate) in `fmt` on `device`. FP8 keeps the released
    matrices where `released_fp8` has them; int8/int4 come from `cache_file` when it holds them, else they are
    converted one expert at a time from `matrix` and written to it (a cache that cannot be written only costs the
    next load a conversion). `release()` then drops the checkpoint's pages: the converted copy is all that stays."""
    if fmt == "int4" and device.type != "cpu":
        raise PlacementError(f"int4 routed experts can only be computed by the CPU (its int4 kernels), not on "
                             f"{device}; keep them in RAM, or put fp8/bf16 experts on the GPU.")
    experts = QuantizedExperts(fmt, *shape, "cpu")
    state = experts.state_dict()
    cached = read_cache(cache_file) if fmt in CONVERTED_FORMATS else {}
    if cached.keys() == state.keys() and all(cached[k].shape == state[k].shape for k in state):
        experts.load_state_dict(cached)
        return devices.move(experts, device)
    for which, stack in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
        for e in range(shape[0]):
            stored = released_fp8(which, e) if fmt == "fp8" else None
            if stored is not None:
                stack.set_fp8(e, *stored)
            else:
                stack.set(e, matrix(which, e))
    release()
    if fmt in CONVERTED_FORMATS and cache_file is not None:
        try:
            write_atomically(cache_file, lambda tmp: save_file(experts.state_dict(), tmp))
        except OSError:
            pass
    return devices.move(experts, device)


def read_cache(cache_file: Path | None) -> dict[str, torch.Tensor]:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        return load_file(cache_file)
    except Exception:  # a damaged cache file (the library raises its own error type): convert again
        return {}


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
