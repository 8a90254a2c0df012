"""The numba kernels of formats/kernel_stores.py and runtime/step_kernels.py: one layer's routed-expert step for a
few rows in one compiled call, a dense matrix's product with a few rows, a quantized matrix dequantized (for products
of many rows), RMSNorms of bf16 rows, the rotary embedding and softmax attention over a bf16 KV cache. They know
weight layouts and shapes but no model: a family's fused decoding steps are made of them in its own folder
(models/qwen3_5/cpu_steps.py).

Imported only when numba is installed (formats/kernel_stores.py decides). Each weight row is dotted with an activation
row in loops over its contiguous bytes: int4, and int8 rows whose inputs come in groups of CODE_GROUP, multiply their
weights in integers by int16 codes of each group of activations (int4: a group's low and high nibbles, the sum times
the group's scale, plus its minimum times the activations' group sum; int8: the sum times the row's scale), with
AVX-512 or AVX2 in vector code of the pack's own (pmadd_codegen); other int8 rows are converted as they are summed;
FP8 e4m3 and bf16 are turned into fp32 by shifting bits, with no table, FP8's 128-column block sums times their
block's scale, in loops LLVM vectorizes. A parallel work item reads a block of consecutive rows of one expert, so the
weights stream from memory in long runs, and int8, int4 and bf16 rows, read faster than one thread's cache misses
arrive, ask for the rows ahead of them (prefetch_ahead). A chosen expert's rows are read once per call however many
activation rows routed to it (the repeats hit the cache), and each row's result is the same whatever other rows share
the call (batches decode as their rows would alone). fastmath lets LLVM reorder the fp32 sums; the error stays an fp32
rounding of a sum (int4 and coded int8: and the codes' rounding, at most 1/65534 of a group's largest |activation| per
input), far below the formats' own. Importing this module starts numba's thread pool (see get_num_threads below).

Arrays (all C-contiguous, so three compiled signatures of each kernel serve the four formats, each compiled once
per machine; a dense matrix is held as one expert):
    q       int8 [E, chunks, out, width]: int8 as torch's store holds it (column chunks); FP8 e4m3 bytes
            [E, 1, out, in];
            uint8 [E, 1, out, in / 2]: int4 in formats.int4.quantize_int4's layout;
            int16 [E, 1, out, in]: bf16's bit patterns (turned into fp32 by a 16-bit shift)
    scale   float32: int8 [E, out, 1] (per row), FP8 [E, ceil(out/128), ceil(in/128)] (per 128x128 block, as released),
            int4 [E, out, 2 * groups] (each group's scale and minimum); bf16 has none (any float32 array of three
            dimensions)
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.core.registry import cpu_target
from numba.extending import intrinsic

from .arrays import BF16, FP8, INT4, INT8

FP8_BLOCK = 128  # the released FP8 checkpoints' scale blocks (formats.stores.FP8_BLOCK)
ROW_BLOCK = 16  # output rows per parallel work item: small enough to balance threads over one expert's rows
E4M3_BITS = np.int32(-0x78000001)  # 0x87FFFFFF: sign, fp32 exponent and mantissa bits an e4m3 byte fills
E4M3_SCALE = np.float32(2.0 ** 120)  # fp32's exponent bias less e4m3's
FP8_INPUT_SCALE = np.float32(2.0 ** 64)  # FP8 rows' activations are multiplied by it (row_extras)
FAST = {"reassoc", "contract"}  # sums may be reordered (vectorized); no assumption that values are finite
FAST_FLAGS = tuple(sorted(FAST))  # the same, for LLVM instructions written by hand (pmadd_codegen)
PREFETCH_BYTES = 4096  # how far ahead of the row being read row_dot asks for the next rows' cache lines
CODE_GROUP = 128  # int8 rows' activations are coded per this many inputs (row_extras): pmadd_codegen's group
KEY_BLOCK = 256  # cached tokens per parallel work item of attend_cached


def host_features() -> set[str]:
    """The CPU features numba compiles for, as LLVM names them ("+avx2", "+f16c", ...); empty where numba does not
    report them."""
    return set(getattr(cpu_target.target_context.codegen(), "_tm_features", "").split(","))


def pmadd_lanes() -> int:
    """The int16 lanes of the widest multiply-and-add-pairs instruction (pmaddwd) numba compiles for: 32 with
    AVX-512 BW, 16 with AVX2, 0 elsewhere (other CPUs, or features numba does not report)."""
    features = host_features()
    return 32 if "+avx512bw" in features else 16 if "+avx2" in features else 0


PMADD_LANES = pmadd_lanes()


# A kernel compiled against a cached parallel kernel (bf16_product, cpu_steps.py's steps) is cached without the hook
# that starts numba's thread pool when the parallel one loads; loaded in a new process before any parallel kernel
# ran, it would call a pool never started (a segfault). Starting the pool on import covers every such kernel.
numba.get_num_threads()


@njit(cache=True, fastmath=FAST, inline="always")
def nibbles(byte):
    """A uint8's low and high nibbles as fp32, split in fp32 (exact: the byte's value / 16, floored), for loops that
    go on in fp32: numba's integer shifts and masks widen to 64 bits, which ran 1.5x slower on an AVX2 EPYC."""
    value = np.float32(byte)
    high = np.floor(value * np.float32(0.0625))
    return value - np.float32(16.0) * high, high


@intrinsic
def prefetch(typingctx, array, index):
    """Asks the CPU to bring the cache line of array[index] (1-D) into its caches, to be read (llvm.prefetch)."""
    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        address = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        function = builder.module.declare_intrinsic(
            "llvm.prefetch", [byte_pointer], ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]))
        # a read (0), kept in every cache level (3), of data (1)
        builder.call(function, [builder.bitcast(address, byte_pointer), int32(0), int32(3), int32(1)])
        return context.get_dummy_value()
    return types.void(array, index), codegen


@njit(cache=True, inline="always")
def prefetch_ahead(q, e, r):
    """Prefetches the row PREFETCH_BYTES ahead of row r of expert e's matrix, if the matrix has one. One thread reading
    one row at a time from memory keeps too few cache misses in flight: on a 2-vCPU AVX-512 Xeon the int8 rows of a
    64 MiB matrix read at 9-12 GB/s (two threads) without, 14-16 with; the int4 rows of a 31 MiB one 10.7-11.4 without,
    15.4-17.4 with."""
    row_bytes = q.shape[1] * q.shape[3] * q.itemsize
    ahead = r + max(1, PREFETCH_BYTES // row_bytes)
    if ahead < q.shape[2]:
        step = max(1, 64 // q.itemsize)  # a cache line's elements
        for c in range(q.shape[1]):
            row = q[e, c, ahead]
            for k in range(0, row.shape[0], step):
                prefetch(row, k)


# The two readings below reinterpret an int32's bits as fp32 inside the loop that uses the value: LLVM vectorizes the
# shift and the reinterpretation with the product, where a first loop writing the bits to scratch and a second
# reading them as fp32 ran 1.4x (FP8) and 1.6x (bf16) slower on an AVX-512 Xeon.
@njit(cache=True, fastmath=FAST, inline="always")
def e4m3_value(byte):
    """An e4m3 byte (int8) as the fp32 of 2^-120 times its value: sign-extended and shifted so that its 7 low bits
    land at fp32's exponent and mantissa and its sign at the top, the sign's copies in between cleared (e4m3
    subnormals become fp32 subnormals, exact). NaN codes (no released checkpoint holds them) read as 480."""
    return np.int32((np.int32(byte) << 20) & E4M3_BITS).view(np.float32)


@njit(cache=True, fastmath=FAST, inline="always")
def bf16_value(bits):
    """A bf16 bit pattern (int16) as fp32: bf16 is fp32's top half, so its bits sign-extended and shifted into
    place."""
    return np.int32(np.int32(bits) << 16).view(np.float32)


@njit(cache=True, fastmath=FAST, inline="always")
def nibble_dot(row, codes, g, half):
    """Group g of an int4 row (uint8 bytes, `half` a group) dotted with the group's int16 activation codes, in int32:
    low nibbles with the group's first half of codes, high ones with its second. Each step is truncated to int32 so
    that LLVM keeps the sums 32-bit (numba widens integer arithmetic to 64) and pairs the 16-bit products
    (vpmaddwd, or vpdpwssd with AVX-512 VNNI). The sum fits: 15 * 32767 per product, 2 * half products."""
    total = np.int32(0)
    first = 2 * g * half
    for j in range(half):
        byte = row[g * half + j]
        total = np.int32(total + np.int32(byte & np.uint8(15)) * np.int32(codes[first + j])
                         + np.int32(byte >> np.uint8(4)) * np.int32(codes[first + half + j]))
    return total


@njit(cache=True, fastmath=FAST, inline="always")
def loop_int4_row(src, codes, scale_min, extra, groups):
    """An int4 row (in `groups` groups; their scales and minimums scale_min) dotted with the activations that
    row_extras coded (codes, extra): per group, scale * (step * nibble_dot + correction) + minimum * sum."""
    acc = np.float32(0.0)
    half = src.shape[0] // groups
    for g in range(groups):
        # groups of 128 with the loop's length a constant: 1.15x on an AVX2 EPYC
        dot = nibble_dot(src, codes, g, 64) if half == 64 else nibble_dot(src, codes, g, half)
        acc += (np.float32(dot) * extra[3 * g] + extra[3 * g + 2]) * scale_min[2 * g] \
            + extra[3 * g + 1] * scale_min[2 * g + 1]
    return acc


def pmadd_codegen(int4: bool):
    """The LLVM vector code of pmadd_int4_row (int4) or pmadd_int8_row: per group of 128 inputs, its weights as two
    halves of 64 int16 (int4: a group's 64 bytes split into low and high nibbles; int8: its 128 bytes sign-extended),
    multiplied with the group's codes and summed in pairs by PMADD_LANES-wide pmaddwd (int32 lanes), turned into fp32
    and scaled (int4: by the group's scale times its step; int8: by its step) into lanes summed only at the row's
    end. int4's corrections and minimums go to a scalar sum."""
    def codegen(context, builder, signature, args):
        src_data, code_data, extra_data = (context.make_array(signature.args[k])(context, builder, args[k]).data
                                           for k in (0, 1, -2))
        lanes, sums = PMADD_LANES, PMADD_LANES // 2
        intp = context.get_value_type(types.intp)
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        src_data = builder.bitcast(src_data, i8.as_pointer())
        groups = context.cast(builder, args[-1], signature.args[-1], types.intp)
        words, pairs, floats = ir.VectorType(i16, lanes), ir.VectorType(i32, sums), ir.VectorType(f32, sums)
        name = "llvm.x86.avx512.pmaddw.d.512" if lanes == 32 else "llvm.x86.avx2.pmadd.wd"
        pmadd = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(pairs, [words, words]))
        half_bytes, half_words = ir.VectorType(i8, 64), ir.VectorType(i16, 64)
        acc = cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * sums))
        scalars = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
        if int4:
            scale_data = context.make_array(signature.args[2])(context, builder, args[2]).data

        def element(data, g, stride, k):  # data[stride * g + k]
            return builder.load(builder.gep(data, [builder.add(builder.mul(g, intp(stride)), intp(k))]))

        def bytes_at(offset):  # 64 bytes of src from offset
            return builder.load(builder.bitcast(builder.gep(src_data, [offset]), half_bytes.as_pointer()), align=1)

        with cgutils.for_range(builder, groups) as loop:
            g = loop.index
            if int4:
                wide = builder.zext(bytes_at(builder.mul(g, intp(64))), half_words)
                halves = (builder.and_(wide, ir.Constant(half_words, [15] * 64)),
                          builder.lshr(wide, ir.Constant(half_words, [4] * 64)))
            else:
                halves = tuple(builder.sext(bytes_at(builder.add(builder.mul(g, intp(128)), intp(k))), half_words)
                               for k in (0, 64))
            group_codes = builder.gep(code_data, [builder.mul(g, intp(128))])
            dot = ir.Constant(pairs, [0] * sums)
            for first_code, values in zip((0, 64), halves):  # the group's first 64 inputs, then its last 64
                for k in range(0, 64, lanes):
                    part = builder.shuffle_vector(values, values, ir.Constant(ir.VectorType(i32, lanes),
                                                                              list(range(k, k + lanes))))
                    code_ptr = builder.bitcast(builder.gep(group_codes, [intp(first_code + k)]), words.as_pointer())
                    dot = builder.add(dot, builder.call(pmadd, [part, builder.load(code_ptr, align=2)]))
            factor = element(extra_data, g, 3, 0)  # the codes' step
            if int4:
                group_scale, minimum = (element(scale_data, g, 2, k) for k in (0, 1))
                total, correction = (element(extra_data, g, 3, k) for k in (1, 2))
                rest = builder.fadd(builder.fmul(correction, group_scale, flags=FAST_FLAGS),
                                    builder.fmul(total, minimum, flags=FAST_FLAGS), flags=FAST_FLAGS)
                builder.store(builder.fadd(builder.load(scalars), rest, flags=FAST_FLAGS), scalars)
                factor = builder.fmul(group_scale, factor)
            scaled = builder.fmul(builder.sitofp(dot, floats), splat(builder, factor, sums), flags=FAST_FLAGS)
            builder.store(builder.fadd(builder.load(acc), scaled, flags=FAST_FLAGS), acc)
        return builder.fadd(lanes_sum(builder, builder.load(acc)), builder.load(scalars), flags=FAST_FLAGS)
    return codegen


def splat(builder: ir.IRBuilder, value: ir.Value, lanes: int = 8) -> ir.Value:
    """LLVM code: a vector of `lanes` copies of a scalar."""
    vector, i32 = ir.VectorType(value.type, lanes), ir.IntType(32)
    return builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), value, i32(0)),
                                  ir.Constant(vector, None), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def lanes_sum(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """LLVM code: the sum of a float vector's lanes, halves added."""
    width, i32 = value.type.count, ir.IntType(32)
    while width > 1:
        width //= 2
        value = builder.fadd(*(builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, width),
                                                                                 list(range(k, k + width))))
                               for k in (0, width)), flags=FAST_FLAGS)
    return builder.extract_element(value, i32(0))


def check_row_arguments(name, arrays, wanted, groups):
    """Raises numba's TypingError unless the arrays are 1-D and C-contiguous, of the wanted dtypes (None: any), and
    groups an integer."""
    if not isinstance(groups, types.Integer) or not all(
            isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and d in (None, a.dtype)
            for a, d in zip(arrays, wanted)):
        raise TypingError(f"{name} needs 1-D C-contiguous arrays (codes int16, scales float32) and a group count; "
                          f"got {arrays}, {groups}")


@intrinsic
def pmadd_int4_row(typingctx, src, codes, scale_min, extra, groups):
    """loop_int4_row for groups of 128 (64 bytes), in vector code (pmadd_codegen). LLVM's own vectorizing of
    loop_int4_row uses 128-bit vectors and sums each group across its lanes: 2.6x the time on an AVX-512 Xeon.
    Arrays 1-D, C-contiguous: src uint8 (64 bytes a group), codes int16, scale_min and extra float32 (row_dot's; src is
    read as bytes, as row_dot's branches for other formats are compiled too)."""
    check_row_arguments("pmadd_int4_row", (src, codes, scale_min, extra), (None, types.int16, types.float32,
                                                                           types.float32), groups)
    return types.float32(src, codes, scale_min, extra, groups), pmadd_codegen(int4=True)


@intrinsic
def pmadd_int8_row(typingctx, src, codes, extra, groups):
    """loop_int8_row in vector code (pmadd_codegen): an int8 matrix of 12288 x 1024 read from memory at 18.0-18.6
    GB/s, against 13.0-14.4 for the fp32 loop (converted weights times fp32 activations) on an AVX-512 Xeon, which
    is bound by its instructions (14 GB/s from the cache too). Arrays as pmadd_int4_row's (src int8, 128 bytes a
    group)."""
    check_row_arguments("pmadd_int8_row", (src, codes, extra), (None, types.int16, types.float32), groups)
    return types.float32(src, codes, extra, groups), pmadd_codegen(int4=False)


@njit(cache=True, fastmath=FAST, inline="always")
def loop_int8_row(src, codes, extra, groups):
    """An int8 row of `groups` groups of CODE_GROUP inputs dotted with the activations row_extras coded (codes,
    extra): per group, its step times the integer sum of weights times codes (which fits int32: 128 products of at
    most 127 * 32767)."""
    acc = np.float32(0.0)
    for g in range(groups):
        dot = np.int32(0)
        for k in range(g * CODE_GROUP, (g + 1) * CODE_GROUP):
            dot = np.int32(dot + np.int32(src[k]) * np.int32(codes[k]))
        acc += np.float32(dot) * extra[3 * g]
    return acc


@njit(cache=True, fastmath=FAST, inline="always")
def pmadd_or_loop_int4_row(src, codes, scale_min, extra, groups):
    """loop_int4_row, groups of 128 by pmadd_int4_row. (Told apart by a product, not a division: a division in
    the row's branch is not moved out of the rows' loop, and cost an int4 row of 1024 inputs 15-20%.)"""
    if src.shape[0] == 64 * groups:
        return pmadd_int4_row(src, codes, scale_min, extra, groups)
    return loop_int4_row(src, codes, scale_min, extra, groups)


int4_row = pmadd_or_loop_int4_row if PMADD_LANES else loop_int4_row
int8_row = pmadd_int8_row if PMADD_LANES else loop_int8_row


@njit(cache=True, inline="always")
def int8_coded(inputs):
    """Whether int8 rows of `inputs` inputs multiply codes of the activations (whole groups of CODE_GROUP; a column
    chunk then holds whole groups too): row_extras codes them and row_dot reads them."""
    return inputs % CODE_GROUP == 0


@njit(cache=True, fastmath=FAST, inline="always")
def e4m3_dot(src, x, first, length):
    """e4m3 bytes src[first:first + length] dotted with x[first:first + length] (the weights read as e4m3_value)."""
    block = np.float32(0.0)
    for k in range(first, first + length):
        block += e4m3_value(src[k]) * x[k]
    return block


@njit(cache=True, fastmath=FAST, inline="always")
def e4m3_scaled(src, first, length, block_scale, dst):
    """e4m3 bytes src[first:first + length] times block_scale, in fp32, into dst[first:first + length]."""
    factor = block_scale * E4M3_SCALE
    for k in range(first, first + length):
        dst[k] = e4m3_value(src[k]) * factor


# inlined where it is called (numba's own inlining): as a called function its loops ran 1.5x slower on an AVX2 EPYC
@njit(cache=True, fastmath=FAST, inline="always")
def row_dot(fmt, q, scale, e, r, x, extra, codes):
    """Row r of expert e's matrix (scales applied) dotted with x, in fp32, in loops over the row's contiguous bytes
    that LLVM vectorizes. `extra` and `codes` are what row_extras made of x for the format (int4: x's int16 codes
    and each group's step, sum and rounding correction; FP8: x times FP8_INPUT_SCALE)."""
    acc = np.float32(0.0)
    n = x.shape[0]
    # FP8 rows are computed more slowly than memory delivers them: prefetching cost them 0-10% of a routed step
    if fmt != FP8:
        prefetch_ahead(q, e, r)
    if fmt == INT8:
        width = q.shape[3]
        if int8_coded(n):
            groups = width // CODE_GROUP
            for c in range(q.shape[1]):
                acc += int8_row(q[e, c, r], codes[c * width:(c + 1) * width],
                                extra[3 * c * groups:3 * (c + 1) * groups], groups)
        else:
            for c in range(q.shape[1]):
                src = q[e, c, r]
                part = x[c * width:(c + 1) * width]
                for j in range(width):
                    acc += np.float32(src[j]) * part[j]
        return acc * scale[e, r, 0]
    src = q[e, 0, r]
    if fmt == INT4:
        return int4_row(src, codes, scale[e, r], extra, scale.shape[2] // 2)
    if fmt == BF16:
        for k in range(src.shape[0]):
            acc += bf16_value(src[k]) * x[k]
        return acc
    # whole blocks, then a partial one: with the block loop bounded by n // FP8_BLOCK, not by scale's shape, LLVM
    # vectorizes the inner loop (6x an FP8 row's speed on an AVX-512 Xeon)
    whole = n // FP8_BLOCK
    block_scales = scale[e, r // FP8_BLOCK]
    for cb in range(whole):
        acc += e4m3_dot(src, extra, cb * FP8_BLOCK, FP8_BLOCK) * block_scales[cb]
    if whole * FP8_BLOCK < n:
        acc += e4m3_dot(src, extra, whole * FP8_BLOCK, n - whole * FP8_BLOCK) * block_scales[whole]
    return acc * (E4M3_SCALE / FP8_INPUT_SCALE)


@njit(cache=True, fastmath=FAST, inline="always")
def rows_dot(fmt, q, scale, e, first, end, x, extra, codes, out):
    """out[r - first] = row_dot of row r of expert e's matrix, for r from first to end. Each format's rows run in a
    loop of its own, the format a constant there: with the format's test inside one loop of rows, LLVM kept each row's
    invariant work in it, and int4 rows of 1024 inputs ran 12-20% slower on an AVX-512 Xeon."""
    if fmt == INT4:
        for r in range(first, end):
            out[r - first] = row_dot(INT4, q, scale, e, r, x, extra, codes)
    elif fmt == INT8:
        for r in range(first, end):
            out[r - first] = row_dot(INT8, q, scale, e, r, x, extra, codes)
    elif fmt == BF16:
        for r in range(first, end):
            out[r - first] = row_dot(BF16, q, scale, e, r, x, extra, codes)
    else:
        for r in range(first, end):
            out[r - first] = row_dot(FP8, q, scale, e, r, x, extra, codes)


# not fastmath: a vectorized sum's order could depend on the row's place in x, and a row's result must not
@njit(cache=True)
def row_extras(fmt, scale, x):
    """What row_dot reads of each row of x [T, in] besides x, as (extra float32 [T, k], codes int16 [T, m]).

    int4, and int8 when the inputs are in groups of CODE_GROUP: the activations as int16 codes (coded_groups).
    FP8: extra is the row times FP8_INPUT_SCALE ([T, in]): an e4m3 weight reads as 2^-120 times its value, and its
    products with activations would often fall below fp32's normal range, which Intel CPUs compute with microcode
    assists (2-3x an FP8 row's time). Nothing for the others."""
    if fmt == INT4:
        return coded_groups(x, scale.shape[2] // 2)
    if fmt == INT8 and int8_coded(x.shape[1]):
        return coded_groups(x, x.shape[1] // CODE_GROUP)
    extra = x * FP8_INPUT_SCALE if fmt == FP8 else np.zeros((x.shape[0], 1), np.float32)
    return extra, np.zeros((x.shape[0], 1), np.int16)


@njit(cache=True)
def coded_groups(x, groups):
    """Each of the `groups` groups of inputs of each row of x [T, in] as int16 codes, x ~ code * step, the step the
    group's largest |x| / 32767 (integer products of weights and codes ran 1.1-1.6x as fast as fp32 ones for int4 and
    1.3-1.5x for int8 on an AVX-512 Xeon), as (extra [T, 3 * groups], codes [T, in]). extra holds, per group, the
    step, the sum of x, and 7.5 times the codes' rounding error summed over the group: an int4 row's group is scale *
    (step * sum(nibble * code) + that correction) + minimum * sum(x), so the rounding errors are weighted by the
    nibbles less their mean, not by the nibbles (4x smaller in the tests). int8 weights are centred on zero and read
    the step alone. Each input is off by at most 1/65534 of its group's largest |x|."""
    size = x.shape[1] // groups
    extra = np.zeros((x.shape[0], 3 * groups), np.float32)
    codes = np.zeros(x.shape, np.int16)
    for t in range(x.shape[0]):
        for g in range(groups):
            total, largest = np.float32(0.0), np.float32(0.0)
            for k in range(g * size, (g + 1) * size):
                total += x[t, k]
                largest = max(largest, abs(x[t, k]))
            step = largest / np.float32(32767.0)
            coded = np.float32(0.0)  # the codes' sum, times the step
            if not np.isfinite(total):  # an inf or a NaN (max() passes NaN over): no codes; the row's result is NaN
                step = np.float32(np.nan)
            elif largest > np.float32(1e-30):  # below it, codes 0: the correction carries the group (7.5 * sum)
                inverse = np.float32(32767.0) / largest  # |x| * inverse <= 32767 (rounding error < 0.01)
                for k in range(g * size, (g + 1) * size):
                    codes[t, k] = np.int16(np.rint(x[t, k] * inverse))
                    coded += np.float32(codes[t, k]) * step
            extra[t, 3 * g], extra[t, 3 * g + 1], extra[t, 3 * g + 2] = step, total, np.float32(7.5) * (total - coded)
    return extra, codes


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
    x_extras, x_codes = row_extras(fmt, gu_scale, x)
    blocks = (inter + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        first, end = b * ROW_BLOCK, min(inter, b * ROW_BLOCK + ROW_BLOCK)
        gate = np.empty(ROW_BLOCK, np.float32)
        up = np.empty(ROW_BLOCK, np.float32)
        for s in range(slots):
            if expert_of[s] == u:
                t = s // top_k
                rows_dot(fmt, gu_q, gu_scale, experts[u], first, end, x[t], x_extras[t], x_codes[t], gate)
                rows_dot(fmt, gu_q, gu_scale, experts[u], inter + first, inter + end, x[t], x_extras[t], x_codes[t],
                         up)
                for i in range(first, end):
                    g = gate[i - first]
                    act[s, i] = g / (1 + np.exp(-g)) * up[i - first]

    # a work item is a block of one expert's down rows, as for gate and up, so that each thread reads whole experts'
    # rows in long runs: work items of output rows, each reading a block of every chosen expert's rows in turn, made
    # the bench model's routed step 1.1-1.4x as long (bf16 experts, AVX-512 EPYC). Each row's slots are then summed
    # in its routing's order, so a row's result does not depend on the other rows of the call.
    act_extras, act_codes = row_extras(fmt, dn_scale, act)
    parts = np.empty((slots, hidden), np.float32)
    blocks = (hidden + ROW_BLOCK - 1) // ROW_BLOCK
    for item in prange(used * blocks):
        u, b = item // blocks, item % blocks
        first, end = b * ROW_BLOCK, min(hidden, b * ROW_BLOCK + ROW_BLOCK)
        for s in range(slots):
            if expert_of[s] == u:
                rows_dot(fmt, dn_q, dn_scale, experts[u], first, end, act[s], act_extras[s], act_codes[s],
                         parts[s, first:end])
    add_slots(parts, weights, out)


@njit(cache=True, fastmath=FAST, inline="always")
def add_slots(parts, weights, out):
    """out[t] += weights[t, j] * parts[t * k + j] for each slot j of row t, in routing order: a routed step's experts'
    results (parts [T * k, H]) summed as routed_step and gguf_numba.coded_routed_step sum them."""
    top_k = weights.shape[1]
    for t in range(out.shape[0]):
        for j in range(top_k):
            out[t] += weights[t, j] * parts[t * top_k + j]


@njit(cache=True, fastmath=FAST, parallel=True)
def matrix_rows(fmt, q, scale, x, out):
    """out[t] = W x[t] for a dense matrix W held as one expert's (q [1, ...], scale as routed_step's); x [T, in] fp32,
    out [T, out] fp32. A work item is a block of W's rows, read once for all of x's rows."""
    rows = q.shape[2]
    extras, codes = row_extras(fmt, scale, x)
    blocks = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    for b in prange(blocks):
        first, end = b * ROW_BLOCK, min(rows, b * ROW_BLOCK + ROW_BLOCK)
        for t in range(x.shape[0]):
            rows_dot(fmt, q, scale, 0, first, end, x[t], extras[t], codes[t], out[t, first:end])


@njit(cache=True, fastmath=FAST, inline="always")
def dequantize_row(fmt, q, scale, e, r, dst):
    """Row r of expert e's int8, int4 or FP8 matrix in fp32 (scales applied) into dst [in]."""
    n = dst.shape[0]
    if fmt == INT8:
        width, row_scale = q.shape[3], scale[e, r, 0]
        for c in range(q.shape[1]):
            src = q[e, c, r]
            for j in range(width):
                dst[c * width + j] = np.float32(src[j]) * row_scale
    elif fmt == INT4:
        src, scale_min = q[e, 0, r], scale[e, r]
        groups = scale.shape[2] // 2
        half = src.shape[0] // groups
        for g in range(groups):
            first, step, low = 2 * g * half, scale_min[2 * g], scale_min[2 * g + 1]
            for j in range(half):
                low_nibble, high_nibble = nibbles(src[g * half + j])
                dst[first + j] = low_nibble * step + low
                dst[first + half + j] = high_nibble * step + low
    else:
        src, block_scales = q[e, 0, r], scale[e, r // FP8_BLOCK]
        whole = n // FP8_BLOCK  # whole blocks, then a partial one: see row_dot
        for cb in range(whole):
            e4m3_scaled(src, cb * FP8_BLOCK, FP8_BLOCK, block_scales[cb], dst)
        if whole * FP8_BLOCK < n:
            e4m3_scaled(src, whole * FP8_BLOCK, n - whole * FP8_BLOCK, block_scales[whole], dst)


@njit(cache=True, fastmath=FAST, parallel=True)
def dequantize(fmt, q, scale, e, out):
    """Expert e's int8, int4 or FP8 matrix in fp32 (scales applied) into out [rows, in], rows in parallel."""
    for r in prange(out.shape[0]):
        dequantize_row(fmt, q, scale, e, r, out[r])


@njit(cache=True, inline="always")
def bf16_half(bits):
    """The bf16 nearest (ties to even, as torch rounds) to the fp32 whose bits (int32) are given: its 16 bits, in the
    low half of an int64 (sign-extended)."""
    value = np.int64(bits)
    return (value + 0x7FFF + ((value >> 16) & 1)) >> 16


@njit(cache=True)
def round_bf16(values):
    """Each fp32 of values (1-D, contiguous) rounded in place to bf16: the fp32 a torch bf16 tensor would hold."""
    bits = values.view(np.int32)
    for k in range(bits.shape[0]):
        bits[k] = np.int32(bf16_half(bits[k]) << 16)


@njit(cache=True, fastmath=FAST, parallel=True)  # fastmath as dequantize's: the same fp32 weights; rounding is integer
def dequantize_bf16(fmt, q, scale, e, out):
    """Expert e's matrix as dequantize computes it, each weight then rounded to bf16 to the nearest even (as torch
    rounds fp32 to bf16), into out int16 [rows, in] (bf16 bit patterns): torch's bf16 product reads it with no
    conversion of its own. A work item is a block of rows, one fp32 row at a time."""
    rows, n = out.shape
    blocks = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    for b in prange(blocks):
        row = np.empty(n, np.float32)
        bits = row.view(np.int32)
        for r in range(b * ROW_BLOCK, min(rows, b * ROW_BLOCK + ROW_BLOCK)):
            dequantize_row(fmt, q, scale, e, r, row)
            dst = out[r]
            for k in range(n):
                dst[k] = np.int16(bf16_half(bits[k]) & 0xFFFF)


@njit(cache=True, fastmath=FAST)
def rms_norm_rows(rows, weight, eps):
    """Each row of rows (fp32 [N, D]) replaced in place by its RMSNorm times weight (fp32 [D]), in fp32: torch's
    F.rms_norm of the rows in fp32 (the caller rounds to bf16)."""
    d = rows.shape[1]
    for row in rows:
        squares = np.float32(0.0)
        for k in range(d):
            squares += row[k] * row[k]
        scale = np.float32(1.0) / np.sqrt(squares / d + eps)
        for k in range(d):
            row[k] = row[k] * scale * weight[k]


@njit(cache=True)
def normed_bf16(rows, weight, eps):
    """A copy of rows (fp32 [N, D]) RMSNormed times weight (rms_norm_rows) and rounded to bf16: what an RMSNorm of a
    bf16 model returns."""
    normed = rows.copy()
    rms_norm_rows(normed, weight, eps)
    round_bf16(normed.reshape(-1))
    return normed


@njit(cache=True)
def rms_norm_bf16(x, weight, eps, out):
    """RMSNorm of bf16 rows (bit patterns, int16 [N, D]) times weight (fp32 [D]), in fp32, each result rounded to
    bf16 into out (int16 [N, D]): torch's F.rms_norm of the rows in fp32, then .to(bfloat16)."""
    rows = bf16_rows(x)
    rms_norm_rows(rows, weight, eps)
    bf16_bits(rows, out)


@njit(cache=True)
def bf16_rows(x):
    """bf16 rows (int16 bit patterns [N, D]) as fp32."""
    rows = np.empty(x.shape, np.float32)
    values = rows.reshape(-1)
    flat = x.reshape(-1)
    for k in range(flat.shape[0]):
        values[k] = bf16_value(flat[k])
    return rows


@njit(cache=True)
def bf16_bits(values, out):
    """fp32 values [N, D] rounded to bf16 (as round_bf16), their bit patterns into out (int16 [N, D])."""
    bits = values.reshape(-1).view(np.int32)
    dst = out.reshape(-1)
    for k in range(bits.shape[0]):
        dst[k] = np.int16(bf16_half(bits[k]) & 0xFFFF)


@njit(cache=True)
def bf16_matrix_rows(code, q, scale, x_bits, out_bits):
    """matrix_rows for bf16 rows (int16 bit patterns [T, in]), the results rounded to bf16 into out_bits
    (int16 [T, out])."""
    out = np.empty(out_bits.shape, np.float32)
    matrix_rows(code, q, scale, bf16_rows(x_bits), out)
    bf16_bits(out, out_bits)


@njit(cache=True)
def bf16_product(code, q, scale, x):
    """The rows of x [T, in] (fp32) times a matrix held as one expert (matrix_rows), rounded to bf16: what a bf16
    model's dense product returns."""
    out = np.empty((x.shape[0], q.shape[2]), np.float32)
    matrix_rows(code, q, scale, x, out)
    round_bf16(out.reshape(-1))
    return out


@njit(cache=True)
def rotate_half(rows, cos, sin, per_token):
    """The rotary embedding (models/layers.py, apply_rotary) of rows [T * per_token, D] in place, in fp32: row r is
    token r // per_token's; the first rotary_dim channels rotated in halves, the rest untouched."""
    half = cos.shape[1] // 2
    for r in range(rows.shape[0]):
        c, s, row = cos[r // per_token], sin[r // per_token], rows[r]
        for j in range(half):
            x1, x2 = row[j], row[j + half]
            row[j] = x1 * c[j] + -x2 * s[j]
            row[j + half] = x2 * c[j + half] + x1 * s[j + half]


@njit(cache=True)
def bf16_half_bits(values):
    """fp32 values holding bf16 values (any shape) as their bf16 bit patterns (int16, the same shape)."""
    bits = np.empty(values.shape, np.int16)
    bf16_bits(values.reshape(1, -1), bits.reshape(1, -1))
    return bits


@njit(cache=True, fastmath=FAST, parallel=True)
def attend_cached(q, keys, values, length, group, out):
    """Softmax attention of each query row of q [T * heads, D] (token t's heads in order) over the first `length`
    cached keys and values (bf16 bit patterns [T, kv_heads, max_len, D]) of its KV head (query head i reads KV head
    i // group), scaled by D^-1/2, in fp32, into out [T, heads * D]. A work item is a block of KEY_BLOCK cached
    tokens of one KV head, its keys and values converted to fp32 once and read four rows at a time for all the
    head's `group` query heads (key_scores, weighted_sum): the rows stay in the L1 cache while they are used; the
    blocks' partial softmax sums are then combined (each scaled by e^(its largest score - the overall largest))."""
    tokens, kv_heads, _, head_dim = keys.shape
    heads = kv_heads * group
    blocks = (length + KEY_BLOCK - 1) // KEY_BLOCK
    scale = np.float32(1.0) / np.sqrt(np.float32(head_dim))
    tops = np.empty((tokens, blocks, heads), np.float32)
    totals = np.empty((tokens, blocks, heads), np.float32)
    parts = np.zeros((tokens, blocks, heads, head_dim), np.float32)
    for item in prange(tokens * kv_heads * blocks):
        t, kv, b = item // (kv_heads * blocks), (item // blocks) % kv_heads, item % blocks
        first = b * KEY_BLOCK
        n = min(length, first + KEY_BLOCK) - first
        heads_of_kv = slice(kv * group, (kv + 1) * group)
        scores = key_scores(q[t * heads:(t + 1) * heads][heads_of_kv], bf16_tile(keys[t, kv], first, n), scale)
        for g in range(group):
            top = scores[g, 0]
            for j in range(1, n):
                top = max(top, scores[g, j])
            total = np.float32(0.0)
            for j in range(n):
                scores[g, j] = np.exp(scores[g, j] - top)
                total += scores[g, j]
            tops[t, b, kv * group + g], totals[t, b, kv * group + g] = top, total
        weighted_sum(scores, bf16_tile(values[t, kv], first, n), parts[t, b, heads_of_kv])
    for t in range(tokens):
        for i in range(heads):
            top = tops[t, 0, i]
            for b in range(1, blocks):
                top = max(top, tops[t, b, i])
            total = np.float32(0.0)
            o = out[t, i * head_dim:(i + 1) * head_dim]
            o[:] = 0.0
            for b in range(blocks):
                weight = np.exp(tops[t, b, i] - top)
                total += weight * totals[t, b, i]
                for d in range(head_dim):
                    o[d] += weight * parts[t, b, i, d]
            for d in range(head_dim):
                o[d] /= total


@njit(cache=True, fastmath=FAST, inline="always")
def bf16_tile(rows, first, n):
    """Rows first .. first + n of bf16 bit patterns [tokens, D] as fp32 [n, D]."""
    tile = np.empty((n, rows.shape[1]), np.float32)
    for j in range(n):
        src, dst = rows[first + j], tile[j]
        for d in range(rows.shape[1]):
            dst[d] = bf16_value(src[d])
    return tile


@njit(cache=True, fastmath=FAST, inline="always")
def key_scores(queries, tile, scale):
    """Each of queries [G, D] dotted with each row of tile [n, D], times scale, as [G, n]: four rows of the tile at
    a time for every query, so that the rows are read from the L1 cache and four sums run side by side."""
    n, head_dim = tile.shape
    scores = np.empty((queries.shape[0], n), np.float32)
    whole = n - n % 4
    for j in range(0, whole, 4):
        k0, k1, k2, k3 = tile[j], tile[j + 1], tile[j + 2], tile[j + 3]
        for g in range(queries.shape[0]):
            query = queries[g]
            s0 = s1 = s2 = s3 = np.float32(0.0)
            for d in range(head_dim):
                x = query[d]
                s0 += x * k0[d]
                s1 += x * k1[d]
                s2 += x * k2[d]
                s3 += x * k3[d]
            scores[g, j], scores[g, j + 1], scores[g, j + 2], scores[g, j + 3] = \
                s0 * scale, s1 * scale, s2 * scale, s3 * scale
    for j in range(whole, n):
        for g in range(queries.shape[0]):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += queries[g, d] * tile[j, d]
            scores[g, j] = s * scale
    return scores


@njit(cache=True, fastmath=FAST, inline="always")
def weighted_sum(weights, tile, out):
    """out[g] += the rows of tile [n, D] weighted by weights[g] ([G, n]), for each g of out [G, D]: four rows of the
    tile at a time for every g."""
    n = tile.shape[0]
    whole = n - n % 4
    for j in range(0, whole, 4):
        v0, v1, v2, v3 = tile[j], tile[j + 1], tile[j + 2], tile[j + 3]
        for g in range(out.shape[0]):
            w0, w1, w2, w3, row = weights[g, j], weights[g, j + 1], weights[g, j + 2], weights[g, j + 3], out[g]
            for d in range(out.shape[1]):
                row[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
    for j in range(whole, n):
        for g in range(out.shape[0]):
            for d in range(out.shape[1]):
                out[g, d] += weights[g, j] * tile[j, d]
