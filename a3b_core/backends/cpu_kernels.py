"""The numba kernel of kernel_experts.py: one layer's routed-expert step for a few rows in one compiled call.

Imported only when numba is installed (kernel_experts.py decides). Each weight row is dotted with an activation row
in loops over its contiguous bytes that LLVM vectorises (int8: converted as they are summed, the sum times the row's
scale; FP8 e4m3 and bf16: turned into fp32 by shifting bits, with no table, FP8's 128-column block sums times their
block's scale); a parallel work item reads a block of consecutive rows of one expert, so the weights stream from
memory in long runs. A chosen expert's rows are read once per call however many activation rows routed to it (the
repeats hit the cache), and each row's result is the same whatever other rows share the call (batches decode as
their rows would alone). fastmath lets LLVM reorder the fp32 sums; the error stays an fp32 rounding of a sum, far
below the formats' own.

Arrays (all C-contiguous, so two compiled signatures serve the three formats, each compiled once per machine):
    q       int8 [E, chunks, out, width]: int8 as torch's store holds it (column chunks); FP8 e4m3 bytes
            [E, 1, out, in];
            int16 [E, 1, out, in]: bf16's bit patterns (turned into fp32 by a 16-bit shift)
    scale   float32: int8 [E, out, 1] (per row), FP8 [E, ceil(out/128), ceil(in/128)] (per 128x128 block, as released);
            bf16 has none (any float32 array of three dimensions)
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

INT8, FP8, BF16 = 0, 1, 2
FP8_BLOCK = 128  # the released FP8 checkpoints' scale blocks (backends.experts.FP8_BLOCK)
ROW_BLOCK = 16  # output rows per parallel work item: small enough to balance threads over one expert's rows
E4M3_BITS = np.int32(-0x78000001)  # 0x87FFFFFF: sign, fp32 exponent and mantissa bits an e4m3 byte fills
E4M3_SCALE = np.float32(2.0 ** 120)  # fp32's exponent bias less e4m3's
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorised); no assumption that values are finite


def set_threads(threads: int) -> None:
    """The kernels' thread count (numba's pool holds at most NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


# inlined where it is called (numba's own inlining): as a called function its loops ran 1.5x slower on an AVX2 EPYC
@njit(cache=True, fastmath=FAST, inline="always")
def row_dot(fmt, q, scale, e, r, x, bits):
    """Row r of expert e's matrix (scales applied) dotted with x, in fp32, in loops over the row's contiguous bytes
    that LLVM vectorises. `bits` is int32 scratch of at least the row's length (FP8, bf16)."""
    acc = np.float32(0.0)
    if fmt == INT8:
        width = q.shape[3]
        for c in range(q.shape[1]):
            src = q[e, c, r]
            part = x[c * width:(c + 1) * width]
            for j in range(width):
                acc += np.float32(src[j]) * part[j]
        return acc * scale[e, r, 0]
    src = q[e, 0, r]
    n = x.shape[0]
    if fmt == BF16:  # bf16 is the top half of fp32: the bits sign-extended, shifted into place
        for k in range(n):
            bits[k] = np.int32(src[k]) << 16
        values = bits[:n].view(np.float32)
        for k in range(n):
            acc += values[k] * x[k]
        return acc
    # e4m3 -> fp32 bits: the byte sign-extended and shifted so that its 7 low bits land at fp32's exponent and
    # mantissa and its sign at the top, the sign's copies in between cleared; the float is then 2^-120 of the value
    # (e4m3 subnormals become fp32 subnormals, exact). NaN codes (no released checkpoint holds them) read as 480.
    for k in range(n):
        bits[k] = (np.int32(src[k]) << 20) & E4M3_BITS
    values = bits[:n].view(np.float32)
    for cb in range(scale.shape[2]):
        block = np.float32(0.0)
        for k in range(cb * FP8_BLOCK, min(n, cb * FP8_BLOCK + FP8_BLOCK)):
            block += values[k] * x[k]
        acc += block * scale[e, r // FP8_BLOCK, cb]
    return acc * E4M3_SCALE


@njit(cache=True, fastmath=FAST, parallel=True)
def routed_step(fmt, inter, gu_q, gu_scale, dn_q, dn_scale, x, ids, weights, out):
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

    # a work item is a block of one expert's intermediate rows: its gate rows, its up rows (each a contiguous run
    # of weights), then SiLU(gate) * up
    act = np.empty((slots, inter), np.float32)
    blocks = (inter + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        first, end = b * ROW_BLOCK, min(inter, b * ROW_BLOCK + ROW_BLOCK)
        gate = np.empty(ROW_BLOCK, np.float32)
        bits = np.empty(hidden, np.int32)
        for s in range(slots):
            if expert_of[s] == u:
                for i in range(first, end):
                    gate[i - first] = row_dot(fmt, gu_q, gu_scale, experts[u], i, x[s // top_k], bits)
                for i in range(first, end):
                    g = gate[i - first]
                    act[s, i] = g / (1 + np.exp(-g)) * row_dot(fmt, gu_q, gu_scale, experts[u], inter + i,
                                                               x[s // top_k], bits)

    # a work item is a block of output rows, read expert by expert: each row's experts summed in its routing's
    # order, so a row's result does not depend on the other rows of the call
    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for b in prange(blocks):
        first, end = b * ROW_BLOCK, min(hidden, b * ROW_BLOCK + ROW_BLOCK)
        bits = np.empty(inter, np.int32)
        for t in range(tokens):
            for j in range(top_k):
                s = t * top_k + j
                for r in range(first, end):
                    out[t, r] += weights[t, j] * row_dot(fmt, dn_q, dn_scale, experts[expert_of[s]], r, act[s], bits)
