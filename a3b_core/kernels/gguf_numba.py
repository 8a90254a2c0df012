"""numba kernels of kernels/gguf_blocks.py: GGUF block-quantized rows dequantized, and dotted with a few activation rows,
straight from their block bytes (layouts as gguf-py's gguf/quants.py reads them).

Every block is decoded the same way (decode_block): its integer codes into fp32 (exact), with a scale and an offset per
group of 16 or 32 codes, the group's weights being scale * code + offset (offset 0 where the type has no minimum). A
dot product then sums code * x per group and scales the sum once: scale * sum(code * x) + offset * sum(x), the groups'
sums of x computed once per call, so the inner loops are plain fp32 multiply-adds that LLVM vectorizes. A parallel
work item reads ROW_BLOCK consecutive rows, each block once for all activation rows of the call. Each row's result does
not depend on the other rows of the call.

The two entry points run in parallel (prange) and are called from Python only: a cached kernel calling a cached
parallel one can crash when loaded in a new process (see the comment at the top of cpu_numba.py).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import cpu_numba, gguf_vector
from .numba_threads import key_cache_on
from .gguf_vector import EXTRA_ROWS, VECTOR_TYPES, q4_k_vector_row, q6_k_vector_row, q8_0_vector_row
from .gguf_types import IQ4_NL, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_1, Q5_K, Q6_K, Q8_0

FAST = {"reassoc", "contract"}  # sums may be reordered (vectorized); no assumption that values are finite
ROW_BLOCK = 16  # output rows per parallel work item
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)

# see cpu_numba.py: start numba's thread pool on import, before any cached kernel loads
numba.get_num_threads()


@njit(cache=True, inline="always")
def half_at(row, at):
    """The fp16 value of row[at:at + 2] (little-endian) as fp32, exact, built from its bits."""
    bits = np.int32(row[at]) | (np.int32(row[at + 1]) << 8)
    exponent = (bits >> 10) & 31
    mantissa = bits & 1023
    if exponent == 0:
        value = np.float32(mantissa) * np.float32(2.0 ** -24)
    elif exponent == 31:
        value = np.float32(np.inf) if mantissa == 0 else np.float32(np.nan)
    else:
        value = np.int32(((exponent + 112) << 23) | (mantissa << 13)).view(np.float32)
    return -value if bits & 0x8000 else value


@njit(cache=True, inline="always")
def group_size(type_id):
    """The codes a scale covers: 16 in Q2_K, Q3_K and Q6_K, 32 elsewhere (a whole block of the 32-weight types)."""
    return 16 if type_id == Q2_K or type_id == Q3_K or type_id == Q6_K else 32


@njit(cache=True, inline="always")
def block_elems(type_id):
    return 32 if type_id <= Q8_0 or type_id == IQ4_NL else 256


@njit(cache=True, inline="always")
def has_offset(type_id):
    """True where the type's groups have a minimum (an offset added to every weight)."""
    return type_id == Q4_1 or type_id == Q5_1 or type_id == Q2_K or type_id == Q4_K or type_id == Q5_K


@njit(cache=True, inline="always")
def k_scale_min(row, at, j):
    """Group j's 6-bit scale and minimum of a Q4_K / Q5_K block's 12 scale bytes at row[at]."""
    if j < 4:
        return row[at + j] & 63, row[at + 4 + j] & 63
    low = row[at + 4 + j]
    return (low & 15) | ((row[at + j - 4] >> 2) & 48), (low >> 4) | ((row[at + j] >> 2) & 48)


@njit(cache=True, inline="always")
def legacy_block(type_id, row, at, codes):
    """Codes of a 32-weight block at row[at] (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and its (scale, offset)."""
    d = half_at(row, at)
    if type_id == Q8_0:
        for k in range(32):
            codes[k] = np.float32(np.int8(row[at + 2 + k]))
        return d, np.float32(0.0)
    if type_id == Q4_0 or type_id == Q4_1 or type_id == IQ4_NL:
        first = at + (4 if type_id == Q4_1 else 2)
        if type_id == IQ4_NL:
            for k in range(16):
                byte = row[first + k]
                codes[k], codes[16 + k] = IQ4_VALUES[byte & 15], IQ4_VALUES[byte >> 4]
            return d, np.float32(0.0)
        zero = 0 if type_id == Q4_1 else 8  # Q4_0's codes are signed: less 8
        for k in range(16):
            byte = row[first + k]
            codes[k], codes[16 + k] = np.int32(byte & 15) - zero, np.int32(byte >> 4) - zero
        return (d, half_at(row, at + 2)) if type_id == Q4_1 else (d, np.float32(0.0))
    # Q5_0, Q5_1: low nibbles as Q4's, each weight's fifth bit from a 32-bit mask
    first = at + (4 if type_id == Q5_1 else 2)
    high = np.uint32(row[first]) | (np.uint32(row[first + 1]) << 8) | (np.uint32(row[first + 2]) << 16) \
        | (np.uint32(row[first + 3]) << 24)
    zero = 0 if type_id == Q5_1 else 16  # Q5_0's codes are signed: less 16
    for k in range(16):
        byte = row[first + 4 + k]
        codes[k] = np.int32((byte & 15) | (((high >> k) & 1) << 4)) - zero
        codes[16 + k] = np.int32((byte >> 4) | (((high >> (16 + k)) & 1) << 4)) - zero
    return (d, half_at(row, at + 2)) if type_id == Q5_1 else (d, np.float32(0.0))


@njit(cache=True, inline="always")
def k_block(type_id, row, at, codes, scales, offsets):
    """Codes of a 256-weight block at row[at] (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), each group's scale and offset
    in scales and offsets."""
    if type_id == Q4_K or type_id == Q5_K:
        d, dmin = half_at(row, at), half_at(row, at + 2)
        for j in range(8):
            sc, m = k_scale_min(row, at + 4, j)
            scales[j], offsets[j] = d * np.float32(sc), -(dmin * np.float32(m))
        low = at + (16 if type_id == Q4_K else 48)
        for c in range(4):  # 32 bytes: low nibbles are group 2c, high nibbles group 2c + 1
            for k in range(32):
                byte = row[low + 32 * c + k]
                codes[64 * c + k], codes[64 * c + 32 + k] = byte & 15, byte >> 4
        if type_id == Q5_K:  # bit j of byte k is the fifth bit of group j's code k
            for j in range(8):
                for k in range(32):
                    codes[32 * j + k] += np.float32(((row[at + 16 + k] >> j) & 1) << 4)
    elif type_id == Q6_K:
        d = half_at(row, at + 208)
        for j in range(16):
            scales[j] = d * np.float32(np.int8(row[at + 192 + j]))
        for h in range(2):  # halves of 128: 64 low-nibble bytes, 32 bytes of 2-bit pairs
            for k in range(64):
                byte = row[at + 64 * h + k]
                codes[128 * h + k], codes[128 * h + 64 + k] = byte & 15, byte >> 4
            for s in range(4):
                for k in range(32):
                    codes[128 * h + 32 * s + k] += np.float32(((row[at + 128 + 32 * h + k] >> (2 * s)) & 3) << 4) - 32
    elif type_id == Q2_K:
        d, dmin = half_at(row, at + 80), half_at(row, at + 82)
        for j in range(16):
            byte = row[at + j]
            scales[j], offsets[j] = d * np.float32(byte & 15), -(dmin * np.float32(byte >> 4))
        for h in range(2):
            for s in range(4):
                for k in range(32):
                    codes[128 * h + 32 * s + k] = (row[at + 16 + 32 * h + k] >> (2 * s)) & 3
    elif type_id == Q3_K:
        d = half_at(row, at + 108)
        for j in range(16):
            low = (row[at + 96 + j % 8] >> (4 * (j // 8))) & 15
            high = (row[at + 104 + j % 4] >> (2 * (j // 4))) & 3
            scales[j] = d * np.float32(np.int32(low | (high << 4)) - 32)
        for h in range(2):  # 2-bit codes as Q2_K's, less 4 where the mask's bit is clear
            for s in range(4):
                for k in range(32):
                    code = np.int32((row[at + 32 + 32 * h + k] >> (2 * s)) & 3)
                    codes[128 * h + 32 * s + k] = code - 4 * (1 - np.int32((row[at + k] >> (4 * h + s)) & 1))
    else:  # IQ4_XS
        d = half_at(row, at)
        high = np.int32(row[at + 2]) | (np.int32(row[at + 3]) << 8)
        for j in range(8):
            low = (row[at + 4 + j // 2] >> (4 * (j % 2))) & 15
            scales[j] = d * np.float32(np.int32(low | (((high >> (2 * j)) & 3) << 4)) - 32)
            for k in range(16):
                byte = row[at + 8 + 16 * j + k]
                codes[32 * j + k], codes[32 * j + 16 + k] = IQ4_VALUES[byte & 15], IQ4_VALUES[byte >> 4]


@njit(cache=True, inline="always")
def decode_block(type_id, row, at, codes, scales, offsets):
    """Block at row[at] of the type: codes (fp32, 32 or 256), each group's scale and offset."""
    if block_elems(type_id) == 32:
        scales[0], offsets[0] = legacy_block(type_id, row, at, codes)
    else:
        k_block(type_id, row, at, codes, scales, offsets)


@njit(cache=True, inline="always")
def dequantize_row(type_id, row, dst):
    """dst (float32 [cols]) = the weights of one row's blocks (its bytes). Without fastmath: scale * code + offset
    rounds as gguf-py's does (no fused multiply-add)."""
    if type_id == Q4_K or type_id == Q6_K or type_id == Q8_0:  # straight loops, 3-4x faster than decode_block's
        coded_values(type_id, row, dst)
        return
    elems = block_elems(type_id)
    nbytes = row.shape[0] * elems // dst.shape[0]
    group = group_size(type_id)
    codes = np.zeros(elems, dtype=np.float32)
    scales = np.zeros(elems // group, dtype=np.float32)
    offsets = np.zeros(elems // group, dtype=np.float32)
    for b in range(dst.shape[0] // elems):
        decode_block(type_id, row, b * nbytes, codes, scales, offsets)
        for g in range(elems // group):
            first = b * elems + g * group
            for k in range(group):
                dst[first + k] = scales[g] * codes[g * group + k] + offsets[g]


@njit(cache=True, parallel=True)
def dequantize_rows(type_id, blocks, out):
    """out[r] = the weights of row r of blocks (uint8 [rows, row_bytes]), float32 [rows, cols]."""
    for r in prange(out.shape[0]):
        dequantize_row(type_id, blocks[r], out[r])


@njit(cache=True, parallel=True)
def dequantize_rows_bf16(type_id, blocks, out):
    """dequantize_rows' weights each rounded to bf16 to the nearest even (as torch rounds fp32 to bf16), into out
    int16 [rows, cols] (bf16 bit patterns), which torch's bf16 product reads with no conversion of its own. A work
    item is ROW_BLOCK rows, one fp32 row at a time."""
    rows, cols = out.shape
    for item in prange((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        row = np.empty((1, cols), np.float32)
        for r in range(item * ROW_BLOCK, min(rows, (item + 1) * ROW_BLOCK)):
            dequantize_row(type_id, blocks[r], row[0])
            cpu_numba.bf16_bits(row, out[r:r + 1])


@njit(cache=True, fastmath=FAST, parallel=True)
def product_rows(type_id, blocks, x, out):
    """out[t, r] = dot(row r of blocks' weights, x[t]) for blocks uint8 [rows, row_bytes] and x float32 [T, cols]:
    out float32 [T, rows]."""
    rows, cols, count = blocks.shape[0], x.shape[1], x.shape[0]
    elems = block_elems(type_id)
    nbytes = blocks.shape[1] * elems // cols
    group = group_size(type_id)
    groups = elems // group
    offset = has_offset(type_id)
    sums = np.zeros((count, cols // group), dtype=np.float32)  # each group's sum of x, for the offsets
    if offset:
        for t in range(count):
            for g in range(cols // group):
                total = np.float32(0.0)
                for k in range(group):
                    total += x[t, g * group + k]
                sums[t, g] = total
    for item in prange((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        codes = np.zeros(elems, dtype=np.float32)
        scales = np.zeros(groups, dtype=np.float32)
        offsets = np.zeros(groups, dtype=np.float32)
        acc = np.zeros(count, dtype=np.float32)
        for r in range(item * ROW_BLOCK, min(rows, (item + 1) * ROW_BLOCK)):
            row = blocks[r]
            acc[:] = 0.0
            for b in range(cols // elems):
                decode_block(type_id, row, b * nbytes, codes, scales, offsets)
                first = b * elems
                for t in range(count):
                    total = np.float32(0.0)
                    for g in range(groups):
                        dot = np.float32(0.0)
                        for k in range(group):
                            dot += codes[g * group + k] * x[t, first + g * group + k]
                        total += scales[g] * dot
                        if offset:
                            total += offsets[g] * sums[t, b * groups + g]
                    acc[t] += total
            for t in range(count):
                out[t, r] = acc[t]


# ----------------------------------------------------------------------------------- integer products (CODED_TYPES)
# Q4_K, Q6_K and Q8_0 (what Q4_K_M and Q8_0 files hold) are multiplied in integers, as llama.cpp multiplies them: the
# activations coded as int8 per group of 32 inputs (coded_bytes: code * step), each group's codes dotted with the
# weights' integer codes in int32 (vectorized as pmaddubsw and pmaddwd in gguf_vector.py), and the group's sum scaled
# once. Each step is truncated to int32 so that
# LLVM keeps the sums 32-bit (numba widens integer arithmetic to 64).
CODED_TYPES = (Q4_K, Q6_K, Q8_0)


@njit(cache=True, fastmath=FAST)
def coded_bytes(x):
    """Each group of 32 inputs of each row of x [T, in] as int8 codes, x ~ code * step, the step the group's largest
    |x| / 127, as (extra [T, EXTRA_ROWS, in / 32], codes [T, in]) (llama.cpp codes them per 32 for Q8_0 rows, per 256
    for the K types: per 32, an outlier costs its own group's precision only). extra holds, per group, the step, the
    sum of x, 7.5 times the codes' rounding error summed over the group, and the sums of its first and of its second 16
    codes. A Q4_K group is scale * (step * sum(nibble * code) + that correction) - minimum * sum(x), so the rounding
    errors are weighted by the nibbles less their mean (as cpu_numba.coded_groups' int16 codes); a Q6_K group of 16
    with codes q - 32 is scale * step * (sum(q * code) - 32 * sum(code)). Each input is off by at most 1/254 of its
    group's largest |x|. A group holding an inf or a NaN gets a NaN step and codes 0: the rows' results are NaN."""
    extra = np.zeros((x.shape[0], EXTRA_ROWS, x.shape[1] // 32), np.float32)
    codes = np.zeros(x.shape, np.int8)
    for t in range(x.shape[0]):
        for g in range(x.shape[1] // 32):
            total, largest = np.float32(0.0), np.float32(0.0)
            for k in range(32 * g, 32 * g + 32):
                total += x[t, k]
                largest = max(largest, abs(x[t, k]))
            if not np.isfinite(total):  # max() passes a NaN over; the sum does not
                extra[t, :, g] = np.nan
                continue
            step, coded = largest / np.float32(127.0), np.float32(0.0)
            if largest > np.float32(1e-30):  # below it, codes 0: the correction carries the group (7.5 * sum)
                inverse = np.float32(127.0) / largest  # |x| * inverse <= 127
                for k in range(32 * g, 32 * g + 32):
                    codes[t, k] = np.int8(np.rint(x[t, k] * inverse))
                    coded += np.float32(codes[t, k]) * step
                for h in range(2):
                    code_sum = np.int32(0)
                    for k in range(32 * g + 16 * h, 32 * g + 16 * h + 16):
                        code_sum = np.int32(code_sum + np.int32(codes[t, k]))
                    extra[t, 3 + h, g] = np.float32(code_sum)
            extra[t, 0, g], extra[t, 1, g], extra[t, 2, g] = step, total, np.float32(7.5) * (total - coded)
    return extra, codes


@njit(cache=True, fastmath=FAST, inline="always")
def nibble_halves(row, at, codes, first):
    """The 32 bytes at row[at]: their low nibbles dotted with codes[first:first + 32], their high nibbles with
    codes[first + 32:first + 64], in int32."""
    low, high = np.int32(0), np.int32(0)
    for j in range(32):
        byte = row[at + j]
        low = np.int32(low + np.int32(byte & np.uint8(15)) * np.int32(codes[first + j]))
        high = np.int32(high + np.int32(byte >> np.uint8(4)) * np.int32(codes[first + 32 + j]))
    return low, high


@njit(cache=True, fastmath=FAST, inline="always")
def q4_k_dot(row, codes, extra, blocks):
    """A Q4_K row dotted with coded activations: per group of 32, d * sc * (step * dot + correction) - dmin * m *
    sum(x), the correction weighting the codes' rounding error by the mean nibble (as cpu_numba.loop_int4_row)."""
    acc = np.float32(0.0)
    for b in range(blocks):
        at = 144 * b
        d, dmin = half_at(row, at), half_at(row, at + 2)
        for c in range(4):
            low, high = nibble_halves(row, at + 16 + 32 * c, codes, 256 * b + 64 * c)
            for h in range(2):
                sc, m = k_scale_min(row, at + 4, 2 * c + h)
                g = 8 * b + 2 * c + h
                dot = np.float32(low if h == 0 else high)
                acc += d * np.float32(sc) * (dot * extra[0, g] + extra[2, g]) \
                    - dmin * np.float32(m) * extra[1, g]
    return acc


@njit(cache=True, fastmath=FAST, inline="always")
def q6_code(row, low_at, shift, high_at, high_shift, k):
    """Code k - 32 of a Q6_K run of 32: its low 4 bits from row[low_at + k] >> shift, its high 2 from
    row[high_at + k] >> high_shift."""
    return (np.int32((row[low_at + k] >> shift) & np.uint8(15))
            | (np.int32((row[high_at + k] >> high_shift) & np.uint8(3)) << np.int32(4))) - np.int32(32)


@njit(cache=True, fastmath=FAST, inline="always")
def q6_k_dot(row, codes, extra, blocks):
    """A Q6_K row dotted with coded activations: per group of 16, d * scale * step * sum((q - 32) * code)."""
    acc = np.float32(0.0)
    for b in range(blocks):
        at = 210 * b
        d = half_at(row, at + 208)
        for h in range(2):
            for s in range(4):  # weights 128h + 32s ..: low bits from ql (nibble s // 2 of byte 64h + 32(s % 2) + k)
                low_at, shift = at + 64 * h + 32 * (s & 1), np.uint8(4 * (s >> 1))
                high_at, high_shift = at + 128 + 32 * h, np.uint8(2 * s)
                first = 256 * b + 128 * h + 32 * s
                first_half, second_half = np.int32(0), np.int32(0)
                for k in range(16):
                    first_half = np.int32(first_half + q6_code(row, low_at, shift, high_at, high_shift, k)
                                          * np.int32(codes[first + k]))
                    second_half = np.int32(second_half + q6_code(row, low_at, shift, high_at, high_shift, 16 + k)
                                           * np.int32(codes[first + 16 + k]))
                scales = at + 192 + 8 * h + 2 * s
                acc += d * extra[0, first // 32] * (np.float32(np.int8(row[scales])) * np.float32(first_half)
                                                        + np.float32(np.int8(row[scales + 1])) * np.float32(second_half))
    return acc


@njit(cache=True, fastmath=FAST, inline="always")
def q8_0_dot(row, codes, extra, blocks):
    """A Q8_0 row dotted with coded activations: per block of 32, d * step * sum(q * code)."""
    acc = np.float32(0.0)
    signed = row.view(np.int8)
    for b in range(blocks):
        at = 34 * b
        dot = np.int32(0)
        for k in range(32):
            dot = np.int32(dot + np.int32(signed[at + 2 + k]) * np.int32(codes[32 * b + k]))
        acc += half_at(row, at) * extra[0, b] * np.float32(dot)
    return acc


@njit(cache=True, inline="always")
def coded_values(type_id, row, dst):
    """The weights of a CODED_TYPES row (its bytes) into dst (float32 [cols]), rounded as gguf-py's (no fastmath)."""
    if type_id == Q8_0:
        signed = row.view(np.int8)
        for b in range(dst.shape[0] // 32):
            d = half_at(row, 34 * b)
            for k in range(32):
                dst[32 * b + k] = d * np.float32(signed[34 * b + 2 + k])
    elif type_id == Q4_K:
        for b in range(dst.shape[0] // 256):
            at = 144 * b
            d, dmin = half_at(row, at), half_at(row, at + 2)
            for c in range(4):
                low_scale, low_min = k_scale_min(row, at + 4, 2 * c)
                high_scale, high_min = k_scale_min(row, at + 4, 2 * c + 1)
                scale_low, offset_low = d * np.float32(low_scale), dmin * np.float32(low_min)
                scale_high, offset_high = d * np.float32(high_scale), dmin * np.float32(high_min)
                first = 256 * b + 64 * c
                for k in range(32):
                    byte = row[at + 16 + 32 * c + k]
                    dst[first + k] = scale_low * np.float32(byte & np.uint8(15)) - offset_low
                    dst[first + 32 + k] = scale_high * np.float32(byte >> np.uint8(4)) - offset_high
    else:  # Q6_K: per half of 128 weights, byte k of ql, byte 32 + k and byte k of qh make weights k + 32s, s < 4
        for b in range(dst.shape[0] // 256):
            at = 210 * b
            d = half_at(row, at + 208)
            for h in range(2):
                ql, qh, first = at + 64 * h, at + 128 + 32 * h, 256 * b + 128 * h
                for half in range(2):  # inputs 16 * half ..: one scale per run of 16 (constant shifts: vectorized)
                    scales = at + 192 + 8 * h + half
                    s0, s1 = d * np.float32(np.int8(row[scales])), d * np.float32(np.int8(row[scales + 2]))
                    s2, s3 = d * np.float32(np.int8(row[scales + 4])), d * np.float32(np.int8(row[scales + 6]))
                    for k in range(16 * half, 16 * half + 16):
                        low, high, bits = np.int32(row[ql + k]), np.int32(row[ql + 32 + k]), np.int32(row[qh + k])
                        dst[first + k] = s0 * np.float32(((low & 15) | ((bits & 3) << 4)) - 32)
                        dst[first + 32 + k] = s1 * np.float32(((high & 15) | (((bits >> 2) & 3) << 4)) - 32)
                        dst[first + 64 + k] = s2 * np.float32(((low >> 4) | (((bits >> 4) & 3) << 4)) - 32)
                        dst[first + 96 + k] = s3 * np.float32(((high >> 4) | ((bits >> 6) << 4)) - 32)


@njit(cache=True, fastmath=FAST, inline="always")
def loop_coded_dot(type_id, row, codes, extra):
    """A CODED_TYPES row (its bytes) dotted with one row of coded activations (coded_bytes: extra [EXTRA_ROWS,
    inputs / 32]), in loops LLVM vectorizes."""
    per_row = codes.shape[0] // block_elems(type_id)
    if type_id == Q4_K:
        return q4_k_dot(row, codes, extra, per_row)
    if type_id == Q6_K:
        return q6_k_dot(row, codes, extra, per_row)
    return q8_0_dot(row, codes, extra, per_row)


@njit(cache=True, fastmath=FAST, inline="always")
def vector_coded_dot(type_id, row, codes, extra):
    """loop_coded_dot in gguf_vector.py's vector code."""
    per_row = codes.shape[0] // block_elems(type_id)
    if type_id == Q4_K:
        return q4_k_vector_row(row, codes, extra, per_row)
    if type_id == Q6_K:
        return q6_k_vector_row(row, codes, extra, per_row)
    return q8_0_vector_row(row, codes, extra, per_row)


coded_dot = vector_coded_dot if VECTOR_TYPES else loop_coded_dot


@njit(cache=True)
def in_order(x, order):
    """A copy of the rows of x [T, cols] with their columns in `order` (as they are where order is empty)."""
    if order.shape[0] == 0:
        return x.copy()
    out = np.empty_like(x)
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[t, j] = x[t, order[j]]
    return out


@njit(cache=True, fastmath=FAST, parallel=True)
def coded_product(type_id, blocks, x, order, out):
    """out[t, r] = dot(row r of blocks' weights, x[t] with its inputs in `order`, as in_order) for a CODED_TYPES
    matrix (blocks uint8 [rows, row_bytes]) and activation rows x (fp32 [T, cols]), coded here by coded_bytes: each
    input off by at most 1/254 of its run's largest |x|."""
    extra, codes = coded_bytes(in_order(x, order))
    rows, count = blocks.shape[0], codes.shape[0]
    for item in prange((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        for r in range(item * ROW_BLOCK, min(rows, (item + 1) * ROW_BLOCK)):
            for t in range(count):
                out[t, r] = coded_dot(type_id, blocks[r], codes[t], extra[t])


@njit(cache=True, fastmath=FAST, parallel=True)
def coded_routed_step(types, row_bytes, inter, gate_up, down, x, ids, weights, out):
    """A decoding step's routed experts in one call, their matrices in CODED_TYPES blocks:
    out[t] = sum over slots j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

    types and row_bytes (int64 [3]): the gate rows', up rows' and down rows' block type and bytes per row; gate_up
    uint8 [E, bytes] (each expert's `inter` gate rows, then its `inter` up rows), down uint8 [E, bytes] (H rows);
    x [T, H] fp32, coded here as coded_product's; ids [T, k] int64; weights [T, k] fp32; out [T, H] fp32. Each
    token's result does not depend on the other tokens of the call."""
    tokens, top_k = ids.shape
    hidden = out.shape[1]
    slots = tokens * top_k
    gate_bytes = inter * row_bytes[0]
    act = np.empty((slots, inter), np.float32)
    extra, codes = coded_bytes(x)
    blocks = (inter + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(slots * blocks):  # a work item: a block of one slot's gate and up rows, then SiLU(gate) * up
        s, b = item // blocks, item % blocks
        t, e = s // top_k, ids[s // top_k, s % top_k]
        for i in range(b * ROW_BLOCK, min(inter, (b + 1) * ROW_BLOCK)):
            gate = coded_dot(types[0], gate_up[e, i * row_bytes[0]:(i + 1) * row_bytes[0]], codes[t], extra[t])
            up = coded_dot(types[1], gate_up[e, gate_bytes + i * row_bytes[1]:gate_bytes + (i + 1) * row_bytes[1]],
                           codes[t], extra[t])
            act[s, i] = gate / (1 + np.exp(-gate)) * up
    act_extra, act_codes = coded_bytes(act)
    parts = np.empty((slots, hidden), np.float32)
    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(slots * blocks):  # a work item: a block of one slot's down rows (as cpu_numba.routed_step's)
        s, b = item // blocks, item % blocks
        e = ids[s // top_k, s % top_k]
        for r in range(b * ROW_BLOCK, min(hidden, (b + 1) * ROW_BLOCK)):
            row = down[e, r * row_bytes[2]:(r + 1) * row_bytes[2]]
            parts[s, r] = coded_dot(types[2], row, act_codes[s], act_extra[s])
    out[:] = 0.0
    cpu_numba.add_slots(parts, weights, out)


# the coded kernels compile gguf_vector.py's vector code in (and cpu_numba.py's, which it imports), and the bf16
# dequantization cpu_numba.py's rounding: stamped with their text
key_cache_on((coded_product, coded_routed_step, dequantize_rows_bf16), gguf_vector.__file__, cpu_numba.__file__)
