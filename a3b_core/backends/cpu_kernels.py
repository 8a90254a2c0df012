"""The numba kernel of kernel_experts.py: one layer's routed-expert step for a few rows in one compiled call.

Imported only when numba is installed (kernel_experts.py decides). Each weight row is dotted with an activation row
in one loop over its contiguous bytes that converts them as it sums (int8 bytes, times their row's scale after the
sum; FP8 e4m3 bytes through a 256-entry table, each 128-column block's sum times its block's scale), which LLVM
vectorises; a parallel work item reads a block of consecutive rows of one expert, so the weights stream from memory
in long runs. A chosen expert's rows are read once per call however many activation rows routed to it (the repeats
hit the cache), and each row's result is the same whatever other rows share the call (batches decode as their rows
would alone). fastmath lets LLVM reorder the fp32 sums; the error stays an fp32 rounding of a sum, far below the
formats' own.

Arrays (all C-contiguous, so one compiled signature serves both formats and the compile is done once per machine):
    q       uint8 [E, chunks, out, width]: int8 as torch's store holds it (column chunks), FP8 e4m3 [E, 1, out, in]
    scale   float32: int8 [E, out, 1] (per row), FP8 [E, ceil(out/128), ceil(in/128)] (per 128x128 block, as released)
    lut     float32 [256]: FP8 e4m3 byte -> value
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

INT8, FP8, INT4 = 0, 1, 2
FP8_BLOCK = 128  # the released FP8 checkpoints' scale blocks (backends.experts.FP8_BLOCK)
ROW_BLOCK = 16  # int8/FP8 output rows per parallel work item: small enough to balance threads over an expert's rows
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorised); no assumption that values are finite


def set_threads(threads: int) -> None:
    """The kernels' thread count (numba's pool holds at most NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


@njit(cache=True, fastmath=FAST)
def row_dot(fmt, q, scale, lut, e, r, x):
    """Row r of expert e's matrix (scales applied) dotted with x, in fp32: the row's bytes are converted in the
    sum's own loop, a contiguous run that LLVM vectorises."""
    acc = np.float32(0.0)
    if fmt == INT8:
        width = q.shape[3]
        for c in range(q.shape[1]):
            src = q[e, c, r]
            part = x[c * width:(c + 1) * width]
            for j in range(width):
                acc += np.float32(np.int8(src[j])) * part[j]
        return acc * scale[e, r, 0]
    src = q[e, 0, r]
    n = x.shape[0]
    for cb in range(scale.shape[2]):
        block = np.float32(0.0)
        for k in range(cb * FP8_BLOCK, min(n, cb * FP8_BLOCK + FP8_BLOCK)):
            block += lut[src[k]] * x[k]
        acc += block * scale[e, r // FP8_BLOCK, cb]
    return acc


@njit(cache=True, fastmath=FAST)
def int4_rows(q, scale, e, nb, x, dst):
    """dst[:2 * half] = the rows of expert e's block nb dotted with x. torch's CPU int4 layout: a block is
    [in, half] bytes, byte i of input k holding q[row i, k] in its low nibble and q[row half + i, k] in its high one
    (two contiguous vector ops to unpack), w = (q - 8) * scale + zero per group of inputs, scale and zero bf16."""
    half = q.shape[3]
    groups = scale.shape[1]
    group = q.shape[2] // groups
    block = q[e, nb]
    low = np.empty(half, np.float32)
    high = np.empty(half, np.float32)
    bits = np.empty(4 * half, np.uint32)  # this group's (scale, zero) pairs of the block's rows, bf16 -> fp32 bits
    scale_zero = bits.view(np.float32)
    dst[:2 * half] = 0
    for g in range(groups):
        low[:] = 0
        high[:] = 0
        x_sum = np.float32(0.0)
        for k in range(g * group, (g + 1) * group):
            xk = x[k]
            x_sum += xk
            column = block[k]
            for i in range(half):
                low[i] += np.float32(column[i] & 15) * xk
                high[i] += np.float32(column[i] >> 4) * xk
        pairs = scale[e, g, nb * 4 * half:(nb + 1) * 4 * half]
        for i in range(4 * half):
            bits[i] = np.uint32(pairs[i]) << 16
        for i in range(half):
            # sum over k of ((q - 8) * scale + zero) * x = scale * sum(q * x) + (zero - 8 * scale) * sum(x)
            a, z = scale_zero[2 * i], scale_zero[2 * i + 1]
            dst[i] += a * low[i] + (z - 8 * a) * x_sum
            a, z = scale_zero[2 * (half + i)], scale_zero[2 * (half + i) + 1]
            dst[half + i] += a * high[i] + (z - 8 * a) * x_sum


@njit(cache=True, fastmath=FAST)
def rows_dot(fmt, q, scale, lut, e, first, end, x, dst):
    """dst[r - first] = row r of expert e's matrix dotted with x, for r in first..end (for int4 one whole block)."""
    if fmt == INT4:
        int4_rows(q, scale, e, first // (2 * q.shape[3]), x, dst)
    else:
        for r in range(first, end):
            dst[r - first] = row_dot(fmt, q, scale, lut, e, r, x)


@njit(cache=True, fastmath=FAST, parallel=True)
def routed_step(fmt, inter, gu_q, gu_scale, dn_q, dn_scale, lut, x, ids, weights, out):
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
    block = 2 * gu_q.shape[3] if fmt == INT4 else ROW_BLOCK
    act = np.empty((slots, inter), np.float32)
    blocks = (inter + block - 1) // block
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        first, end = b * block, min(inter, b * block + block)
        gate = np.empty(block, np.float32)
        up = np.empty(block, np.float32)
        for s in range(slots):
            if expert_of[s] == u:
                rows_dot(fmt, gu_q, gu_scale, lut, experts[u], first, end, x[s // top_k], gate)
                rows_dot(fmt, gu_q, gu_scale, lut, experts[u], inter + first, inter + end, x[s // top_k], up)
                for i in range(end - first):
                    act[s, first + i] = gate[i] / (1 + np.exp(-gate[i])) * up[i]

    # a work item is a block of output rows, read expert by expert: each row's experts summed in its routing's
    # order, so a row's result does not depend on the other rows of the call
    block = 2 * dn_q.shape[3] if fmt == INT4 else ROW_BLOCK
    blocks = (hidden + block - 1) // block
    for b in prange(blocks):
        first, end = b * block, min(hidden, b * block + block)
        down = np.empty(block, np.float32)
        for t in range(tokens):
            for j in range(top_k):
                s = t * top_k + j
                rows_dot(fmt, dn_q, dn_scale, lut, experts[expert_of[s]], first, end, act[s], down)
                for r in range(first, end):
                    out[t, r] += weights[t, j] * down[r - first]
