"""The numba kernel of kernel_experts.py: one layer's routed-expert step for a few rows in one compiled call.

Imported only when numba is installed (kernel_experts.py decides). Every weight row is decoded into fp32 in a small
buffer that stays in L1 (int8 bytes times their row's scale; FP8 e4m3 bytes through a 256-entry table, times their
128x128 block's scale), then dotted with each activation row that routed to its expert, so a chosen expert's weights
are read once per call whatever the number of rows, and each row's result is the same whatever other rows share the
call (batches decode as their rows would alone). fastmath lets LLVM reorder the fp32 sums (vectorised); the
error stays an fp32 rounding of a sum, far below the formats' own.

Arrays (all C-contiguous, so one compiled signature serves both formats and the compile is done once per machine):
    q       uint8 [E, chunks, out, width]: int8 as torch's store holds it (column chunks), FP8 e4m3 [E, 1, out, in]
    scale   float32: int8 [E, out, 1] (per row), FP8 [E, ceil(out/128), ceil(in/128)] (per 128x128 block, as released)
    lut     float32 [256]: FP8 e4m3 byte -> value
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

INT8, FP8 = 0, 1
FP8_BLOCK = 128  # the released FP8 checkpoints' scale blocks (backends.experts.FP8_BLOCK)
ROW_BLOCK = 16  # output rows per parallel work item: small enough to balance threads over one expert's rows
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorised); no assumption that values are finite


def set_threads(threads: int) -> None:
    """The kernels' thread count (numba's pool holds at most NUMBA_NUM_THREADS)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


@njit(cache=True, fastmath=FAST)
def decode_row(fmt, q, scale, lut, e, r, row):
    """Row r of expert e's matrix into `row` (fp32, scales applied)."""
    if fmt == INT8:
        width = q.shape[3]
        s = scale[e, r, 0]
        for c in range(q.shape[1]):
            src = q[e, c, r]
            for j in range(width):
                row[c * width + j] = np.float32(np.int8(src[j])) * s
    else:
        src = q[e, 0, r]
        n = row.shape[0]
        for cb in range(scale.shape[2]):
            s = scale[e, r // FP8_BLOCK, cb]
            for k in range(cb * FP8_BLOCK, min(n, cb * FP8_BLOCK + FP8_BLOCK)):
                row[k] = lut[src[k]] * s


@njit(cache=True, fastmath=FAST)
def dot(a, b):
    acc = np.float32(0.0)
    for k in range(a.shape[0]):
        acc += a[k] * b[k]
    return acc


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

    gate_up = np.empty((slots, 2 * inter), np.float32)
    blocks = (2 * inter + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        row = np.empty(hidden, np.float32)
        for r in range(b * ROW_BLOCK, min(2 * inter, b * ROW_BLOCK + ROW_BLOCK)):
            decode_row(fmt, gu_q, gu_scale, lut, experts[u], r, row)
            for s in range(slots):
                if expert_of[s] == u:
                    gate_up[s, r] = dot(row, x[s // top_k])

    act = np.empty((slots, inter), np.float32)
    for s in prange(slots):
        for i in range(inter):
            g = gate_up[s, i]
            act[s, i] = g / (1 + np.exp(-g)) * gate_up[s, inter + i]

    down = np.empty((slots, hidden), np.float32)
    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for b in prange(blocks):
        row = np.empty(inter, np.float32)
        for r in range(b * ROW_BLOCK, min(hidden, b * ROW_BLOCK + ROW_BLOCK)):
            for u in range(used):
                decode_row(fmt, dn_q, dn_scale, lut, experts[u], r, row)
                for s in range(slots):
                    if expert_of[s] == u:
                        down[s, r] = dot(row, act[s])

    # each row's experts summed in its routing's order: a row's result does not depend on the other rows of the call
    for t in range(tokens):
        for j in range(top_k):
            w = weights[t, j]
            for r in range(hidden):
                out[t, r] += w * down[t * top_k + j, r]
