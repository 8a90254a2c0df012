"""Routed-expert stores: one layer's experts in one format, quantized (FP8 as released, or converted to int8 or
int4 at load: a QuantizedStack per fused matrix, its layout the format's) or float on the CPU. Every store offers
the same interface as the model's own float experts: `device` (where the layer's experts are computed),
`gate_up(e, x)` and `down(e, x)` (x @ W_e^T), so the MoE layer's loop does not care how the weights are stored.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import PlacementError
from ..kernels.arrays import BlockExperts, plain_cpu
from ..kernels.cpu_linear import linear
from .table import format_named

# QuantizedStack.set may fill a matrix a part at a time at multiples of this many rows: a whole FP8 scale block.
SET_ROWS_MULTIPLE = 128


class CpuFloatExperts(nn.Module):
    """Float experts on the CPU, their products of one or two rows through the matrix-vector kernel (cpu_linear.py).
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
    """E matrices [E, out, in] in a quantized format, stored as its layout says (formats/int8.py, int4.py, fp8.py)
    in the buffers `q` and `scale`; `matmul(e, x)` = x @ W_e^T."""

    def __init__(self, fmt: str, shape: tuple[int, int, int], device: torch.device | str = "cpu",
                 stored: tuple = ()):
        """`stored`: what a format kept as released needs to know of the checkpoint's layout (GGUF: the block types
        of its parts, formats/gguf.py)."""
        super().__init__()
        self.fmt, self.shape = format_named(fmt), shape
        if not self.fmt.quantized:
            raise ValueError(f"{fmt!r} is no quantized format")
        self.layout = self.fmt.layout(shape, *stored)
        q, scale = self.layout.empty(device)
        self.q, self.scale = nn.Buffer(q), nn.Buffer(scale)

    def set(self, e: int, w: torch.Tensor, first_row: int = 0) -> None:
        """Quantizes one expert's fp32 matrix [out, in] into slot e; or, from `first_row` on, some of its rows [n, in]
        (n a multiple of SET_ROWS_MULTIPLE unless they end the matrix), which quantize as they would in the whole."""
        rows = slice(first_row, first_row + w.shape[0])
        if first_row % SET_ROWS_MULTIPLE or (rows.stop != self.shape[1] and w.shape[0] % SET_ROWS_MULTIPLE):
            raise ValueError(f"rows {rows.start}:{rows.stop} of {self.shape[1]}: a part must start and end at "
                             f"multiples of {SET_ROWS_MULTIPLE} rows (or at the matrix's end)")
        self.layout.set(self.q, self.scale, e, rows, w)

    def set_released(self, e: int, *stored: object) -> None:
        """Stores a matrix as released (no requantization): FP8 (e4m3 matrix, block scales), GGUF (its parts)."""
        self.layout.set_released(self.q, self.scale, e, *stored)

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's matrix [out, in] in `dtype` (fp32 products rounded to it once)."""
        return self.layout.dequantize(self.q, self.scale, e, dtype)

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.q.device.type == "cpu":
            out = self.layout.cpu_product(self.q, self.scale, e, x)
            if out is not None:
                return out
        compute = torch.bfloat16 if x.dtype == torch.float32 and self.layout.bf16_products else x.dtype
        return linear(x.to(compute), self.dequantize(e, compute)).to(x.dtype)


class QuantizedExperts(nn.Module):
    def __init__(self, fmt: str, num_experts: int, hidden: int, inter: int, device: torch.device | str = "cpu",
                 stored: Mapping[str, tuple] | None = None):
        """`stored`: QuantizedStack's, per stack (gate_up_proj, down_proj)."""
        super().__init__()
        self.fmt = format_named(fmt)
        stored = stored or {}
        self.gate_up_proj = QuantizedStack(fmt, (num_experts, 2 * inter, hidden), device, stored.get("gate_up_proj", ()))
        self.down_proj = QuantizedStack(fmt, (num_experts, hidden, inter), device, stored.get("down_proj", ()))

    @property
    def device(self) -> torch.device:
        return self.gate_up_proj.q.device

    def gate_up(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.gate_up_proj.matmul(e, x)

    def down(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.matmul(e, x)

    def takes(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> bool:
        """Whether routed_step computes these decoding rows: only where the layout computes whole routed steps (GGUF
        blocks, by their kernels) and the tensors are plain CPU ones."""
        layout = getattr(self.gate_up_proj, "layout", None)  # a stack repacked for torch's kernels has none
        return hasattr(layout, "takes_step") and plain_cpu(self.gate_up_proj.q, x, top_i, top_p) and \
            layout.takes_step(self.down_proj.layout, x)

    def routed_step(self, x: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for the rows of x [N, H] (top_i, top_p [N, k]), in one step."""
        return self.gate_up_proj.layout.routed_step(self.gate_up_proj.q, self.down_proj.layout, self.down_proj.q, x,
                                                    top_i, top_p)

    def step_experts(self) -> BlockExperts | None:
        """The experts as the fused decoding steps read them, where the layout offers that (GGUF blocks of coded
        types) and they are plain CPU tensors; else None."""
        layout = getattr(self.gate_up_proj, "layout", None)
        if not hasattr(layout, "step_experts") or not plain_cpu(self.gate_up_proj.q, self.down_proj.q):
            return None
        return layout.step_experts(self.gate_up_proj.q, self.down_proj.layout, self.down_proj.q)


ExpertMatrix = Callable[[str, int], torch.Tensor]  # (which, expert) -> fp32 [out, in]; which: gate_up_proj / down_proj
Released = Callable[[str, int], "tuple | None"]  # (which, expert) -> QuantizedStack.set_released's arguments


def convert_experts(fmt: str, shape: tuple[int, int, int], matrix: ExpertMatrix, released: Released,
                    device: torch.device, cache_file: Path | None, release: Callable[[], None],
                    stored: Mapping[str, tuple] | None = None) -> QuantizedExperts:
    """One layer's routed experts (num_experts, hidden, intermediate) in `fmt`, on the CPU, to be computed on
    `device` (`stored`: QuantizedExperts'). A format kept as released takes the released matrices where `released`
    has them; a converted one
    comes from `cache_file` when it holds it, else it is converted one expert at a time from `matrix` and written to
    it (a cache that cannot be written only costs the next load a conversion). `release()` then drops the
    checkpoint's pages: the converted copy is all that stays."""
    fmt = format_named(fmt)
    if fmt.cpu_only and device.type != "cpu":
        raise PlacementError(f"{fmt} routed experts can only be computed by the CPU (its {fmt} kernels), not on "
                             f"{device}; keep them in RAM, or put fp8/bf16 experts on the GPU.")
    experts = QuantizedExperts(fmt, *shape, "cpu", stored)
    state = experts.state_dict()
    cached = read_cache(cache_file) if fmt.converted else {}
    if cached.keys() == state.keys() and all(cached[k].shape == state[k].shape for k in state):
        experts.load_state_dict(cached)
        return experts
    for which, stack in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
        for e in range(shape[0]):
            kept = released(which, e) if fmt.as_released else None
            if kept is not None:
                stack.set_released(e, *kept)
            else:
                stack.set(e, matrix(which, e))
    release()
    if fmt.converted and cache_file is not None:
        try:
            write_atomically(cache_file, lambda tmp: save_file(experts.state_dict(), tmp))
        except OSError:
            pass
    return experts


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
