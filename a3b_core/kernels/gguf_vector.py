"""Q4_K, Q6_K and Q8_0 rows dotted with int8-coded activations (gguf_numba.coded_bytes) in vector code of the pack's
own (LLVM instructions through numba's intrinsics), after llama.cpp's AVX2 code: pmaddubsw multiplies 32 unsigned
weight codes with 32 signed activation codes and sums them in pairs (int16), and pmaddwd sums those in pairs again
(int32), times Q6_K's integer scales or 1. Where the CPU has AVX-512 VNNI, Q4_K's and Q8_0's runs take one vpdpbusd
(the products summed in fours, int32) instead of that pair, which LLVM does not fuse: on an AVX-512 EPYC one thread
read a Q4_K matrix the caches hold at 19.7-20.5 GB/s against 17.9-19.0, and Q4_K_M decoding was 4-18% faster in four
of five alternating runs. Each run of 32 inputs gives eight int32 lanes:
- a K-type block's 8 runs are summed across their lanes by a tree of vphaddd (run_totals), turned into fp32 once, and
  scaled per run (by the activations' step, and Q4_K's 6-bit scale) in one multiply: measured on an AVX-512 EPYC, a
  Q4_K block took 6.4 ns where a conversion and a multiply-add a run took 7.7;
- a Q8_0 block's one run is turned into fp32 and scaled by the step times the block's d.
Blocks add into one fp32 sum of 8 lanes, summed across only at the row's end (two alternating sums made Q8_0's dot
10% faster alone, but each dot's code twice as long, and a decoding step no faster).

A block's weight codes are made in vectors from its bytes, 32 at a time:
- Q8_0 (34 bytes, 32 weights): the 32 int8 codes; pmaddubsw takes their magnitudes, and the activations' codes take
  their signs (psignb).
- Q4_K (144 bytes, 256 weights): each run of 32 bytes holds 64 weights, the low nibbles the first 32, the high ones
  the next 32; 6-bit scales and minimums per 32, unpacked in scalar registers. The minimums are not in the codes:
  each group's minimum times its activations' sum, and the scale times their rounding correction, join the group's
  lane.
- Q6_K (210 bytes, 256 weights): each weight's low 4 bits from a nibble of `ql`, its high 2 bits from 2 bits of `qh`
  (unsigned, 0-63); int8 scales per 16. The codes' offset of 32 is not in the products: 32 times each group's scale
  times its activations' sum of codes is taken from the run's total (as llama.cpp's bsums).
The integers cannot overflow: a run's lane sums 4 products of a code (at most 127) and a weight code times its scale
(at most 15 for Q4_K, 63 * 128 for Q6_K, 128 for Q8_0), pmaddubsw's pairs stay within int16, and a run's total
within 32 * 127 * 63 * 128.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .cpu_numba import FAST_FLAGS, PMADD_LANES, check_row_arguments, host_features, lanes_sum, splat
from .gguf_types import Q4_K, Q6_K, Q8_0

EXTRA_ROWS = 5  # gguf_numba.coded_bytes' values per 32 inputs: step, sum, correction, first 16 codes' sum, second's

# pmaddubsw and pmaddwd of AVX2 (AVX-512 has AVX2's), fp16 scales by F16C's vcvtph2ps
VECTOR_TYPES = (Q4_K, Q6_K, Q8_0) if PMADD_LANES and "+f16c" in host_features() else ()
VNNI = bool(VECTOR_TYPES) and {"+avx512vnni", "+avx512vl"} <= host_features()  # vpdpbusd on 256 bits
BLOCK_BYTES = {Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_INPUTS = {Q8_0: 32, Q4_K: 256, Q6_K: 256}
SCALE_AT = {Q8_0: 0, Q4_K: 0, Q6_K: 208}  # where a block's fp16 scale d is (Q4_K's dmin follows it)


def block_runs(builder: ir.IRBuilder, type_id: int, load) -> list[tuple[ir.Value, bool]]:
    """A block's weight codes as <32 x i8> vectors in input order (32 inputs each), each with whether it is signed
    (Q8_0) or not (Q4_K's nibbles, Q6_K's codes before their offset of 32); load(offset) is the block's 32 bytes from
    offset, <32 x i8>."""
    i8x32 = ir.VectorType(ir.IntType(8), 32)

    def splat(value: int) -> ir.Constant:
        return ir.Constant(i8x32, [value] * 32)

    if type_id == Q8_0:
        return [(load(2), True)]
    if type_id == Q4_K:
        out = []
        for c in range(4):
            run = load(16 + 32 * c)
            out += [(builder.and_(run, splat(15)), False), (builder.lshr(run, splat(4)), False)]
        return out
    out = []
    for h in range(2):
        high_bits = load(128 + 32 * h)
        for s in range(4):  # weights 128h + 32s ..
            low = builder.and_(builder.lshr(load(64 * h + 32 * (s & 1)), splat(4 * (s >> 1))), splat(15))
            high = builder.and_(builder.lshr(high_bits, splat(2 * s)), splat(3))
            out.append((builder.or_(low, builder.shl(high, splat(4))), False))
    return out


def q6_k_scales(builder: ir.IRBuilder, load) -> list[ir.Value]:
    """Each Q6_K run's integer weight scales as <16 x i16>, pmaddwd's second operand: its two groups' scales in lanes
    0-7 and 8-15 (pmaddubsw's sums of its first and second 16 inputs). Each half block's 8 scales are widened to words
    once, into both 128-bit halves, and each run's picked by one in-half byte shuffle (vpshufb): LLVM's own spreading
    of shuffled words takes two vector instructions a run."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    words, eight_words, i8x32 = ir.VectorType(i16, 16), ir.VectorType(i16, 8), ir.VectorType(ir.IntType(8), 32)
    shuffle = builder.module.declare_intrinsic("llvm.x86.avx2.pshuf.b", fnty=ir.FunctionType(i8x32, [i8x32, i8x32]))

    def doubled(eight: ir.Value) -> ir.Value:  # <8 x i16> as <32 x i8>, in both halves
        return builder.bitcast(builder.shuffle_vector(eight, ir.Constant(eight_words, None),
                                                      ir.Constant(ir.VectorType(i32, 16), list(range(8)) * 2)), i8x32)

    def pick(scales: ir.Value, low: int, high: int) -> ir.Value:  # word `low` in lanes 0-7, word `high` in 8-15
        mask = [2 * low, 2 * low + 1] * 8 + [2 * high, 2 * high + 1] * 8
        return builder.bitcast(builder.call(shuffle, [scales, ir.Constant(i8x32, mask)]), words)

    # run 4h + s: the scales 2s and 2s + 1 of the 8 at 192 + 8h
    halves = [doubled(builder.sext(load(192 + 8 * h, 8), eight_words)) for h in range(2)]
    return [pick(halves[k // 4], 2 * (k % 4), 2 * (k % 4) + 1) for k in range(8)]


def run_totals(builder: ir.IRBuilder, dots: list[ir.Value]) -> ir.Value:
    """Eight runs' <8 x i32> lanes each summed across, run k's total in lane k: two levels of vphaddd (pairs of lanes
    of two vectors summed, per 128-bit half), and the halves added. Once a block, instead of a conversion to fp32 and
    a multiply-add a run."""
    pairs = dots[0].type
    add_pairs = builder.module.declare_intrinsic("llvm.x86.avx2.phadd.d", fnty=ir.FunctionType(pairs, [pairs] * 2))
    fours = [builder.call(add_pairs, [dots[k], dots[k + 1]]) for k in range(0, 8, 2)]
    eights = [builder.call(add_pairs, [fours[k], fours[k + 1]]) for k in (0, 2)]  # runs 4j..4j+3, low half then high

    def halves(first: int) -> ir.Value:  # lanes first..first + 3 of both
        lanes = [first + k for k in range(4)] + [8 + first + k for k in range(4)]
        return builder.shuffle_vector(*eights, ir.Constant(ir.VectorType(ir.IntType(32), 8), lanes))

    return builder.add(halves(0), halves(4))


def q4_k_sixes(builder: ir.IRBuilder, load) -> tuple[ir.Value, ir.Value]:
    """A Q4_K block's eight 6-bit scales and eight 6-bit minimums as <8 x i8>: groups 0-3 in the low bits of bytes 0-3
    (scales) and 4-7 (minimums) of its 12 scale bytes, groups 4-7 in the nibbles of bytes 8-11 with their top two bits
    from the top of bytes 0-7. Unpacked four at a time in 32-bit scalar registers, which leaves the vector units to the
    products."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    first, second, third = (builder.bitcast(load(offset, 4), i32) for offset in (4, 8, 12))

    def const(byte: int) -> ir.Constant:
        return i32(byte * 0x01010101)

    def join(low: ir.Value, high: ir.Value) -> ir.Value:
        wide = builder.or_(builder.zext(low, i64), builder.shl(builder.zext(high, i64), i64(32)))
        return builder.bitcast(wide, ir.VectorType(ir.IntType(8), 8))

    def top_bits(x: ir.Value) -> ir.Value:
        return builder.and_(builder.lshr(x, i32(2)), const(48))

    return (join(builder.and_(first, const(63)), builder.or_(builder.and_(third, const(15)), top_bits(first))),
            join(builder.and_(second, const(63)),
                 builder.or_(builder.and_(builder.lshr(third, i32(4)), const(15)), top_bits(second))))


def eight_floats(builder: ir.IRBuilder, pointer: ir.Value) -> ir.Value:
    """LLVM code: the 8 floats from a float pointer, as <8 x float>."""
    return builder.load(builder.bitcast(pointer, ir.VectorType(ir.FloatType(), 8).as_pointer()), align=4)


def q4_k_lanes(builder: ir.IRBuilder, load, d: ir.Value, dmin: ir.Value, totals: ir.Value, steps: ir.Value,
               sums: ir.Value, corrections: ir.Value) -> ir.Value:
    """A Q4_K block's part of the dot as <8 x float> lanes to be summed, one a group of 32: d * scale * (step * total +
    correction) - dmin * minimum * sum(x), totals the groups' sums of nibble * code (fp32) and steps, sums and
    corrections float pointers to the block's first group's."""
    floats = ir.VectorType(ir.FloatType(), 8)
    scale, minimum = (builder.uitofp(builder.zext(six, ir.VectorType(ir.IntType(32), 8)), floats)
                      for six in q4_k_sixes(builder, load))
    scale, minimum = builder.fmul(scale, d, flags=FAST_FLAGS), builder.fmul(minimum, dmin, flags=FAST_FLAGS)
    coded = builder.fadd(builder.fmul(totals, eight_floats(builder, steps), flags=FAST_FLAGS),
                         eight_floats(builder, corrections), flags=FAST_FLAGS)
    return builder.fsub(builder.fmul(scale, coded, flags=FAST_FLAGS),
                        builder.fmul(minimum, eight_floats(builder, sums), flags=FAST_FLAGS), flags=FAST_FLAGS)


def q6_k_lanes(builder: ir.IRBuilder, load, d: ir.Value, totals: ir.Value, steps: ir.Value, firsts: ir.Value,
               seconds: ir.Value) -> ir.Value:
    """A Q6_K block's part of the dot as <8 x float> lanes to be summed, one a run of 32: d * step * (total - 32 *
    (scale * code sum of its first 16 + scale * code sum of its second 16)), totals the runs' sums of scale * code *
    weight code (fp32), and steps, firsts and seconds float pointers to the block's first run's (the activations' sums
    of 16 codes)."""
    i32, floats = ir.IntType(32), ir.VectorType(ir.FloatType(), 8)
    scales = load(192, 16)

    def every_other(first: int) -> ir.Value:  # the scales first, first + 2, .., as floats
        picked = builder.shuffle_vector(scales, ir.Constant(scales.type, None),
                                        ir.Constant(ir.VectorType(i32, 8), list(range(first, 16, 2))))
        return builder.sitofp(builder.sext(picked, ir.VectorType(i32, 8)), floats)

    offsets = builder.fadd(builder.fmul(every_other(0), eight_floats(builder, firsts), flags=FAST_FLAGS),
                           builder.fmul(every_other(1), eight_floats(builder, seconds), flags=FAST_FLAGS),
                           flags=FAST_FLAGS)
    products = builder.fsub(totals, builder.fmul(offsets, ir.Constant(floats, [32.0] * 8), flags=FAST_FLAGS),
                            flags=FAST_FLAGS)
    return builder.fmul(products, builder.fmul(eight_floats(builder, steps), d, flags=FAST_FLAGS),
                        flags=FAST_FLAGS)


def coded_row_codegen(type_id: int, vnni: bool):
    """The LLVM code of a row's dot (see the module docstring): arguments row (uint8, its bytes), codes (int8, the
    row's inputs), extra (float32 [EXTRA_ROWS, inputs / 32], C-contiguous: gguf_numba.coded_bytes' values per 32
    inputs) and the block count; an fp32 result. With vnni, Q4_K's and Q8_0's runs are summed by vpdpbusd."""
    def codegen(context, builder, signature, args):
        row, codes, extra = (context.make_array(signature.args[k])(context, builder, args[k]).data for k in range(3))
        blocks = context.cast(builder, args[3], signature.args[3], types.intp)
        intp = context.get_value_type(types.intp)
        groups = builder.mul(blocks, intp(BLOCK_INPUTS[type_id] // 32))
        steps, sums, corrections, firsts, seconds = (builder.gep(extra, [builder.mul(intp(k), groups)])
                                                     for k in range(EXTRA_ROWS))
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        runs, words, pairs, floats = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8), \
            ir.VectorType(f32, 8)
        declare = builder.module.declare_intrinsic
        maddubs = declare("llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(words, [runs, runs]))
        # declared with the <8 x i32> operands of LLVM up to 20, which newer LLVMs upgrade to their <32 x i8> ones
        dot_bytes = declare("llvm.x86.avx512.vpdpbusd.256", fnty=ir.FunctionType(pairs, [pairs] * 3))
        pmadd = declare("llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(pairs, [words, words]))
        sign = declare("llvm.x86.avx2.psign.b", fnty=ir.FunctionType(runs, [runs, runs]))
        magnitude = declare("llvm.abs.v32i8", fnty=ir.FunctionType(runs, [runs, ir.IntType(1)]))
        row, codes = builder.bitcast(row, i8.as_pointer()), builder.bitcast(codes, i8.as_pointer())

        def block_lanes(b: ir.Value) -> ir.Value:  # block b's part of the row's dot, as 8 lanes to be summed
            at = builder.gep(row, [builder.mul(b, intp(BLOCK_BYTES[type_id]))])

            def load(offset: int, n: int = 32) -> ir.Value:
                pointer = builder.bitcast(builder.gep(at, [intp(offset)]), ir.VectorType(i8, n).as_pointer())
                return builder.load(pointer, align=1)

            def half(offset: int) -> ir.Value:
                # the fp16 at offset in 8 float lanes (vpbroadcastw, vcvtph2ps: exact). Converted as a scalar, it is
                # inserted into some register's vector (vpinsrw), at times the sums': a dependency between blocks.
                pointer = builder.bitcast(builder.gep(at, [intp(offset)]), ir.HalfType().as_pointer())
                return builder.fpext(splat(builder, builder.load(pointer, align=1)), floats)

            first_code = builder.gep(codes, [builder.mul(b, intp(BLOCK_INPUTS[type_id]))])
            first_group = builder.mul(b, intp(BLOCK_INPUTS[type_id] // 32))
            d = half(SCALE_AT[type_id])
            weights_runs = block_runs(builder, type_id, load)
            # pmaddwd's second operand: Q6_K's scales, the others' 1 (their scales are applied in fp32)
            ones = ir.Constant(words, [1] * 16)
            scales = q6_k_scales(builder, load) if type_id == Q6_K else [ones] * len(weights_runs)
            dots = []
            for k, ((weights, signed), scale) in enumerate(zip(weights_runs, scales)):
                code_pointer = builder.bitcast(builder.gep(first_code, [intp(32 * k)]), runs.as_pointer())
                activations = builder.load(code_pointer, align=1)
                if signed:  # pmaddubsw's first operand is unsigned: the weights' signs move to the activations
                    weights, activations = (builder.call(magnitude, [weights, ir.IntType(1)(0)]),
                                            builder.call(sign, [activations, weights]))
                if vnni and type_id != Q6_K:  # unsigned bytes times signed ones, summed in fours
                    dots.append(builder.call(dot_bytes, [ir.Constant(pairs, [0] * 8), builder.bitcast(weights, pairs),
                                                          builder.bitcast(activations, pairs)]))
                else:
                    dots.append(builder.call(pmadd, [builder.call(maddubs, [weights, activations]), scale]))
            if type_id == Q8_0:
                step = builder.load(builder.gep(steps, [first_group]))
                return builder.fmul(builder.sitofp(dots[0], floats), builder.fmul(splat(builder, step), d),
                                    flags=FAST_FLAGS)
            totals = builder.sitofp(run_totals(builder, dots), floats)
            if type_id == Q4_K:
                return q4_k_lanes(builder, load, d, half(2), totals,
                                  *(builder.gep(p, [first_group]) for p in (steps, sums, corrections)))
            return q6_k_lanes(builder, load, d, totals,
                              *(builder.gep(p, [first_group]) for p in (steps, firsts, seconds)))

        total = cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 8))
        with cgutils.for_range(builder, blocks) as loop:
            builder.store(builder.fadd(builder.load(total), block_lanes(loop.index), flags=FAST_FLAGS), total)
        return lanes_sum(builder, builder.load(total))
    return codegen


def row_intrinsic(type_id: int, vnni: bool = VNNI):
    """A row's dot of the type (coded_row_codegen) as a numba intrinsic: (row, codes, extra, blocks) -> float32."""
    def typer(typingctx, row, codes, extra, blocks):
        check_row_arguments("a GGUF row's vector dot", (row, codes), (types.uint8, types.int8), blocks)
        if not (isinstance(extra, types.Array) and extra.ndim == 2 and extra.layout == "C"
                and extra.dtype == types.float32):
            raise TypingError(f"a GGUF row's vector dot needs extra as a 2-D C-contiguous float32 array; got {extra}")
        return types.float32(row, codes, extra, blocks), coded_row_codegen(type_id, vnni)
    typer.__name__ = f"vector_row_{type_id}"
    return intrinsic(typer)


q4_k_vector_row, q6_k_vector_row, q8_0_vector_row = (row_intrinsic(t) for t in (Q4_K, Q6_K, Q8_0))
