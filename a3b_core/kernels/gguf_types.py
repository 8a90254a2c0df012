"""The GGUF block types computed from their blocks (gguf_file.READ_BLOCK_TYPES), by ggml type id: what the kernels
(gguf_numba.py) branch on and gguf_blocks.py checks."""
from __future__ import annotations

from ..release.gguf_file import BLOCK_TYPES as READ_BLOCK_TYPES

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23

# the types computed here: id -> (name, weights a block, bytes a block)
BLOCK_TYPES: dict[int, tuple[str, int, int]] = {
    t.type_id: (t.name, t.block_elements, t.block_bytes) for t in READ_BLOCK_TYPES.values()}
