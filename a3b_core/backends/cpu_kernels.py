"""The numba kernel of kernel_experts.py: one layer's routed-expert step for a few rows in one compiled call.

Imported only when numba is installed (kernel_experts.py decides). Every weight row is decoded into fp32 in a small
buffer that stays in L1 (int8 and FP8 bytes with their scales, int4 nibbles with their group scale and zero, bf16 by
a shift), then dotted with each activation row that routed to its expert, so a chosen expert's weights are read once
per call whatever the number of rows. Both loops are plain contiguous loops that LLVM vectorises; fastmath lets it
reorder the fp32 sums (the error stays an fp32 rounding of a sum, far below the formats' own).

Arrays (all C-contiguous; the ones a format does not use are empty placeholders, so one compiled signature serves all
formats and the compile is done once per machine):
    q       uint8 [E, chunks, out, width]: int8 as torch's store holds it (column chunks), FP8 e4m3 [E, 1, out, in],
            int4 [E, 1, out, in/2] with byte j of group g holding inputs g*G + j (low nibble) and g*G + G/2 + j (high)
    q16     uint16 [E, out, in]: bf16 bits
    scale   float32: int8 [E, out, 1] (per row), FP8 [E, ceil(out/128), ceil(in/128)] (per 128x128 block, as released)
    sz      uint16 [E, out, groups, 2]: int4 bf16 bits of (scale, zero), w = (q - 8) * scale + zero
    lut     float32 [256]: FP8 e4m3 byte -> value
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

INT8, FP8, INT4, BF16 = 0, 1, 2, 3
FP8_BLOCK = 128  # the released FP8 checkpoints' scale blocks (backends.experts.FP8_BLOCK)
ROW_BLOCK = 16  # output rows per parallel work item: small enough to balance threads over one expert's rows
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorised); no assumption that values are finite


def set_threads(threads: int) -> None:
    """The kernels' thread count (numba's pool holds at most NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


@njit(cache=True, fastmath=FAST)
def decode_row(fmt, q, q16, scale, sz, lut, e, r, row, row_bits, sz_bits):
    """Row r of expert e's matrix into `row` (fp32, scales applied); `row_bits` is `row`'s uint32 view, `sz_bits` a
    scratch of 2 * groups uint32 (int4)."""
    n = row.shape[0]
    if fmt == INT8:
        width = q.shape[3]
        s = scale[e, r, 0]
        for c in range(q.shape[1]):
            src = q[e, c, r]
            for j in range(width):
                row[c * width + j] = np.float32(np.int8(src[j])) * s
    elif fmt == FP8:
        src = q[e, 0, r]
        for cb in range(scale.shape[2]):
            s = scale[e, r // FP8_BLOCK, cb]
            for k in range(cb * FP8_BLOCK, min(n, cb * FP8_BLOCK + FP8_BLOCK)):
                row[k] = lut[src[k]] * s
    elif fmt == INT4:
        src = q[e, 0, r]
        groups = sz.shape[2]
        half = n // groups // 2
        pairs = sz[e, r]
        for g in range(groups):
            sz_bits[2 * g] = np.uint32(pairs[g, 0]) << 16
            sz_bits[2 * g + 1] = np.uint32(pairs[g, 1]) << 16
        sz_f = sz_bits.view(np.float32)
        for g in range(groups):
            s = sz_f[2 * g]
            low = sz_f[2 * g + 1] - 8 * s
            for j in range(half):
                v = np.int32(src[g * half + j])
                row[2 * g * half + j] = np.float32(v & 15) * s + low
                row[2 * g * half + half + j] = np.float32(v >> 4) * s + low
    else:
        src16 = q16[e, r]
        for k in range(n):
            row_bits[k] = np.uint32(src16[k]) << 16


@njit(cache=True, fastmath=FAST)
def dot(a, b):
    acc = np.float32(0.0)
    for k in range(a.shape[0]):
        acc += a[k] * b[k]
    return acc


@njit(cache=True, fastmath=FAST, parallel=True)
def routed_step(fmt, inter, gu_q, gu_q16, gu_scale, gu_sz, dn_q, dn_q16, dn_scale, dn_sz, lut, x, ids, weights, out):
    """out[t] += sum over slots j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j];
    x [T, H] fp32, ids [T, k] int64, weights [T, k] fp32, out [T, H] fp32 (zeros)."""
    tokens, top_k = ids.shape
    hidden = x.shape[1]
    slots = tokens * top_k
    # each distinct expert once; slot s (token s // top_k) reads experts[expert_of[s]]
    experts = np.empty(slots, np.int64)
    expert_of = np.empty(slots, np.int64)
    used = 0
    for s in range(slots):
        e = ids[s // top_k, s % top_k]
        u = 0
        while u < used and experts[u] != e:
            u += 1
        if u == used:
            experts[used] = e
            used += 1
        expert_of[s] = u
    groups = max(1, gu_sz.shape[2], dn_sz.shape[2])

    gate_up = np.empty((slots, 2 * inter), np.float32)
    blocks = (2 * inter + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        row_bits = np.empty(hidden, np.uint32)
        row = row_bits.view(np.float32)
        sz_bits = np.empty(2 * groups, np.uint32)
        for r in range(b * ROW_BLOCK, min(2 * inter, b * ROW_BLOCK + ROW_BLOCK)):
            decode_row(fmt, gu_q, gu_q16, gu_scale, gu_sz, lut, experts[u], r, row, row_bits, sz_bits)
            for s in range(slots):
                if expert_of[s] == u:
                    gate_up[s, r] = dot(row, x[s // top_k])

    act = np.empty((slots, inter), np.float32)
    for s in prange(slots):
        for i in range(inter):
            g = gate_up[s, i]
            act[s, i] = g / (1 + np.exp(-g)) * gate_up[s, inter + i]

    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for b in prange(blocks):
        row_bits = np.empty(inter, np.uint32)
        row = row_bits.view(np.float32)
        sz_bits = np.empty(2 * groups, np.uint32)
        for r in range(b * ROW_BLOCK, min(hidden, b * ROW_BLOCK + ROW_BLOCK)):
            for u in range(used):
                decode_row(fmt, dn_q, dn_q16, dn_scale, dn_sz, lut, experts[u], r, row, row_bits, sz_bits)
                for s in range(slots):
                    if expert_of[s] == u:
                        out[s // top_k, r] += weights[s // top_k, s % top_k] * dot(row, act[s])


@njit(cache=True, fastmath=FAST, parallel=True)
def dequantize(fmt, q, q16, scale, sz, lut, e, out):
    """Expert e's whole matrix into out [rows, in] fp32 (the int4 kernel store's products of many rows)."""
    groups = max(1, sz.shape[2])
    for r in prange(out.shape[0]):
        row_bits = np.empty(out.shape[1], np.uint32)
        row = row_bits.view(np.float32)
        decode_row(fmt, q, q16, scale, sz, lut, e, r, row, row_bits, np.empty(2 * groups, np.uint32))
        out[r] = row
