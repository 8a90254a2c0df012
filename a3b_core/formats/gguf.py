"""GGUF block-quantized matrices (Q8_0, Q4_K, Q6_K, ... as llama.cpp's quantizer writes them), kept as the file
stores them: no conversion, no cache, and products computed from the blocks by kernels/gguf_blocks.py. The routed
experts of a quantized GGUF are held this way on the CPU, and so are its dense matrices (formats/dense.py's
QuantizedLinear, a stack of one matrix); the blocks are the file's, so they take what the file takes.

A stack's matrices may hold parts of different types: llama.cpp quantizes a layer's gate and up halves separately
(one fused gate_up matrix here) and may give the down matrix more bits than both (Q4_K_M).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.arrays import BlockExperts
from ..kernels.gguf_blocks import BlocksRows, blocks_product, coded, computes_step, dequantize_blocks, routed_step
from ..release.gguf_file import BLOCK_TYPES, BlockType

Parts = tuple[tuple[BlockType, int], ...]  # (block type, rows) of a matrix's parts, top to bottom


class GgufBlocks:
    """A stack of E matrices [E, out, in] in GGUF blocks: q uint8 [E, bytes per matrix] (each part's rows of blocks,
    one part after the other). No scale tensor (the scales are in the blocks): `scale` is empty."""
    bf16_products = False  # the kernels take fp32 rows

    def __init__(self, shape: tuple[int, int, int], parts: Parts):
        if sum(rows for _, rows in parts) != shape[1]:
            raise ValueError(f"the parts' rows {[rows for _, rows in parts]} do not add up to {shape[1]}")
        self.shape, self.parts = shape, parts
        self.part_bytes = [block_type.row_bytes(shape[2]) * rows for block_type, rows in parts]
        # adjacent parts of one type (Q4_K_M's gate and up halves) are one run of rows: one product, no concatenation
        self.runs: list[tuple[BlockType, int]] = []  # (block type, bytes)
        for (block_type, _), nbytes in zip(parts, self.part_bytes):
            if self.runs and self.runs[-1][0] == block_type:
                self.runs[-1] = (block_type, self.runs[-1][1] + nbytes)
            else:
                self.runs.append((block_type, nbytes))

    def empty(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(self.shape[0], sum(self.part_bytes), dtype=torch.uint8, device=device),
                torch.empty(0, dtype=torch.uint8, device=device))

    def set(self, q: torch.Tensor, scale: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        raise ValueError("GGUF blocks are kept as the file stores them; they are not quantized from floats here")

    def set_released(self, q: torch.Tensor, scale: torch.Tensor, e: int,
                     *parts: tuple[BlockType, torch.Tensor]) -> None:
        """Copies matrix e's parts (block type, bytes [rows, bytes per row]) as stored."""
        if [(t, b.shape[0]) for t, b in parts] != list(self.parts):
            raise ValueError(f"matrix {e} has parts {[(str(t), b.shape[0]) for t, b in parts]}, the stack "
                             f"{[(str(t), rows) for t, rows in self.parts]}")
        torch.cat([b.reshape(-1) for _, b in parts], out=q[e])

    def _blocks(self, q: torch.Tensor, e: int) -> list[tuple[BlockType, np.ndarray]]:
        """Matrix e's runs of rows (uint8 [rows, bytes per row]) with their block type, top to bottom."""
        flat, out, first = q[e].numpy(), [], 0
        for block_type, nbytes in self.runs:
            out.append((block_type, flat[first:first + nbytes].reshape(-1, block_type.row_bytes(self.shape[2]))))
            first += nbytes
        return out

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return joined([dequantize_blocks(t.type_id, blocks, self.shape[2], dtype) for t, blocks in self._blocks(q, e)])

    def cpu_product(self, q: torch.Tensor, scale: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        rows, exact = x.reshape(-1, x.shape[-1]), x.dtype == torch.float32
        out = joined([blocks_product(t.type_id, blocks, rows, exact) for t, blocks in self._blocks(q, e)], dim=-1)
        return out.reshape(*x.shape[:-1], -1)

    def rows_kernel(self, fmt: str, q: torch.Tensor, input_order: torch.Tensor | None,
                    side: tuple[np.ndarray, ...] = ()) -> BlocksRows | None:
        """The few-row products' kernel of a stack of one matrix of one type (a dense matrix of format `fmt`), or
        None; `side`: the LoRA side path the fused steps add (BlocksRows)."""
        if len(self.parts) != 1 or self.shape[0] != 1:
            return None
        (block_type, rows), = self.parts
        return BlocksRows.of(fmt, block_type.type_id, q.numpy().reshape(rows, -1), input_order, side)

    def step_types(self, down: GgufBlocks) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The type ids and bytes per row of the gate rows, the up rows (this stack's halves) and down's rows."""
        halves = [t for t, rows in self.parts for _ in range(rows // (self.shape[1] // 2))]
        (down_type, _), = down.parts
        return (tuple(t.type_id for t in (*halves, down_type)),
                (halves[0].row_bytes(self.shape[2]), halves[1].row_bytes(self.shape[2]),
                 down_type.row_bytes(down.shape[2])))

    def step_experts(self, q: torch.Tensor, down: GgufBlocks, down_q: torch.Tensor) -> BlockExperts | None:
        """The experts of this gate_up stack and `down` as the fused decoding steps read them, where their types are
        coded (gguf_blocks.coded); else None."""
        types, row_bytes = self.step_types(down)
        if not coded(types):
            return None
        return BlockExperts(np.array(types, np.int64), np.array(row_bytes, np.int64), q.numpy(), down_q.numpy(),
                            self.shape[1] // 2)

    def takes_step(self, down: GgufBlocks, x: torch.Tensor) -> bool:
        """Whether routed_step computes the decoding rows x with `down` as the down stack."""
        return computes_step(self.step_types(down)[0], x)

    def routed_step(self, q: torch.Tensor, down: GgufBlocks, down_q: torch.Tensor, x: torch.Tensor,
                    top_i: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for the rows of x [N, H] in one kernel call (q: this gate_up stack's,
        down_q: the down stack's)."""
        types, row_bytes = self.step_types(down)
        return routed_step(types, row_bytes, self.shape[1] // 2, q.numpy(), down_q.numpy(), x, top_i, top_p)

    @staticmethod
    def stored_bytes(numel: int, stored: BlockType) -> int:
        return stored.stored_bytes(numel)


def joined(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat of the tensors, or the one tensor itself (no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def q8_0_blocks(w: torch.Tensor) -> tuple[BlockType, torch.Tensor]:
    """A float matrix [rows, cols] in Q8_0 blocks as llama.cpp quantizes it (gguf-py), as set_released and
    ReleasedMatrix take a part: made-up weights for checks of the kernels."""
    from gguf import GGMLQuantizationType, quants
    blocks = quants.quantize(w.detach().float().numpy(), GGMLQuantizationType.Q8_0)
    return BLOCK_TYPES["Q8_0"], torch.from_numpy(np.ascontiguousarray(blocks))
