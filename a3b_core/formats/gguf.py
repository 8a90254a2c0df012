"""GGUF block-quantized matrices (Q8_0, Q4_K, Q6_K, ... as llama.cpp's quantizer writes them), kept as the file
stores them: no conversion, no cache, and products computed from the blocks by kernels/gguf_blocks.py. The routed
experts of a quantized GGUF are held this way on the CPU; the blocks are the file's, so they take what the file
takes.

A stack's matrices may hold parts of different types: llama.cpp quantizes a layer's gate and up halves separately
(one fused gate_up matrix here) and may give the down matrix more bits than both (Q4_K_M).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.gguf_blocks import blocks_product, dequantize_blocks
from ..release.gguf_file import BlockType

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
        flat, out, first = q[e].numpy(), [], 0
        for (block_type, rows), nbytes in zip(self.parts, self.part_bytes):
            out.append((block_type, flat[first:first + nbytes].reshape(rows, -1)))
            first += nbytes
        return out

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([dequantize_blocks(t.type_id, blocks, self.shape[2])
                          for t, blocks in self._blocks(q, e)]).to(dtype)

    def cpu_product(self, q: torch.Tensor, scale: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        out = torch.cat([blocks_product(t.type_id, blocks, rows) for t, blocks in self._blocks(q, e)], dim=-1)
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    @staticmethod
    def stored_bytes(numel: int, stored: BlockType) -> int:
        return stored.stored_bytes(numel)
