"""Q4_K, Q6_K and Q8_0 rows dotted with int16-coded activations in vector code of the pack's own (LLVM instructions
through numba's intrinsics), as cpu_numba.pmadd_codegen does for int4 and int8 rows. LLVM's own vectorizing of the
plain loops (gguf_numba.q4_k_dot and its kind) sums each group of 16 or 32 products across its lanes before scaling
it; here each group's products stay in eight int32 lanes (AVX2's pmaddwd: 16 int16 products summed in pairs), are
turned into fp32 and scaled by the group's factor into eight fp32 lanes, summed across only at the row's end.

A block's weight codes are made in vectors from its bytes:
- Q8_0 (34 bytes, 32 weights): the 32 int8 codes, sign-extended; one factor per block.
- Q4_K (144 bytes, 256 weights): each run of 32 bytes holds 64 weights, the low nibbles the first 32, the high ones
  the next 32; one factor per 32 (the group's minimum is not in the codes: the caller adds it).
- Q6_K (210 bytes, 256 weights): each weight's low 4 bits from a nibble of `ql`, its high 2 bits from 2 bits of `qh`,
  less 32; one factor per 16.
A group's factor is the weights' scale times the activations' coding step, made in vectors from the block's scale
bytes (group_factors); Q4_K's minimums and the codes' rounding corrections go to lanes of their own.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_numba import FAST_FLAGS, PMADD_LANES, check_row_arguments, host_features
from .gguf_types import Q4_K, Q6_K, Q8_0

# pmaddwd of AVX2 (and AVX-512, which has AVX2's), fp16 scales by F16C's vcvtph2ps
VECTOR_TYPES = (Q4_K, Q6_K, Q8_0) if PMADD_LANES and "+f16c" in host_features() else ()
BLOCK_BYTES = {Q8_0: 34, Q4_K: 144, Q6_K: 210}
BLOCK_INPUTS = {Q8_0: 32, Q4_K: 256, Q6_K: 256}
GROUP_INPUTS = {Q8_0: 32, Q4_K: 32, Q6_K: 16}  # inputs per factor
SCALE_AT = {Q8_0: 0, Q4_K: 0, Q6_K: 208}  # where a block's fp16 scale d is (Q4_K's dmin follows it)


def block_codes(builder: ir.IRBuilder, type_id: int, load) -> list[ir.Value]:
    """A block's weight codes as <32 x i16> vectors in input order (32 inputs each); load(offset) is the block's 32
    bytes from offset, <32 x i8>."""
    i8x32, i16x32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 32)

    def splat(value: int) -> ir.Constant:
        return ir.Constant(i8x32, [value] * 32)

    if type_id == Q8_0:
        return [builder.sext(load(2), i16x32)]
    if type_id == Q4_K:
        out = []
        for c in range(4):
            run = load(16 + 32 * c)
            out += [builder.zext(builder.and_(run, splat(15)), i16x32),
                    builder.zext(builder.lshr(run, splat(4)), i16x32)]
        return out
    out = []
    for h in range(2):
        high_bits = load(128 + 32 * h)
        for s in range(4):  # weights 128h + 32s ..
            low = builder.and_(builder.lshr(load(64 * h + 32 * (s & 1)), splat(4 * (s >> 1))), splat(15))
            high = builder.and_(builder.lshr(high_bits, splat(2 * s)), splat(3))
            code = builder.sub(builder.or_(low, builder.shl(high, splat(4))), splat(32))
            out.append(builder.sext(code, i16x32))
    return out


def group_factors(builder: ir.IRBuilder, type_id: int, load, d: ir.Value, dmin: ir.Value, steps: ir.Value,
                  sums: ir.Value, corrections: ir.Value) -> tuple[list[ir.Value], ir.Value | None]:
    """A block's factors, each as <8 x float> of one value, in input order, and for Q4_K the block's rest (its groups'
    minimums times their activations' sums, and scale times the codes' rounding corrections) as <8 x float> lanes to
    be summed. load(offset, n) is n bytes of the block from offset as <n x i8>; d and dmin the block's fp16 scales as
    float; steps, sums, corrections the activations' (float pointers to the block's first group)."""
    i32, f32 = ir.IntType(32), ir.FloatType()
    floats = ir.VectorType(f32, 8)

    def splat(value: ir.Value, lanes: int = 8) -> ir.Value:
        vector = ir.VectorType(value.type, lanes)
        return builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), value, i32(0)),
                                      ir.Constant(vector, None), ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))

    def lane(vector: ir.Value, k: int) -> ir.Value:  # lane k of vector in all 8 lanes
        return builder.shuffle_vector(vector, ir.Constant(vector.type, None),
                                      ir.Constant(ir.VectorType(i32, 8), [k] * 8))

    def run(pointer: ir.Value) -> ir.Value:  # 8 floats from pointer
        return builder.load(builder.bitcast(pointer, floats.as_pointer()), align=4)

    if type_id == Q8_0:
        return [splat(builder.fmul(d, builder.load(steps)))], None
    if type_id == Q6_K:  # one int8 scale per 16 weights; an activation step per 32
        scales = builder.sitofp(builder.sext(load(192, 16), ir.VectorType(i32, 16)), ir.VectorType(f32, 16))
        step_pairs = builder.shuffle_vector(run(steps), ir.Constant(floats, None),
                                            ir.Constant(ir.VectorType(i32, 16), [k // 2 for k in range(16)]))
        factors = builder.fmul(builder.fmul(scales, splat(d, 16), flags=FAST_FLAGS), step_pairs, flags=FAST_FLAGS)
        return [lane(factors, k) for k in range(16)], None
    # Q4_K: 6-bit scales and minimums, groups 0-3 in the low bits of bytes 0-3 (scales) and 4-7 (minimums), groups 4-7
    # in the nibbles of bytes 8-11 with their top two bits from the top of bytes 0-7
    i8x4 = ir.VectorType(ir.IntType(8), 4)
    first, second, third = load(4, 4), load(8, 4), load(12, 4)

    def const(value: int) -> ir.Constant:
        return ir.Constant(i8x4, [value] * 4)

    def join(low: ir.Value, high: ir.Value) -> ir.Value:  # <4 x i8> twice -> <8 x float>
        both = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, 8), list(range(8))))
        return builder.uitofp(builder.zext(both, ir.VectorType(i32, 8)), floats)

    def top_bits(x: ir.Value) -> ir.Value:
        return builder.and_(builder.lshr(x, const(2)), const(48))

    scale = join(builder.and_(first, const(63)), builder.or_(builder.and_(third, const(15)), top_bits(first)))
    minimum = join(builder.and_(second, const(63)), builder.or_(builder.lshr(third, const(4)), top_bits(second)))
    scale = builder.fmul(scale, splat(d), flags=FAST_FLAGS)
    factors = builder.fmul(scale, run(steps), flags=FAST_FLAGS)
    rest = builder.fsub(builder.fmul(scale, run(corrections), flags=FAST_FLAGS),
                        builder.fmul(builder.fmul(minimum, splat(dmin), flags=FAST_FLAGS), run(sums), flags=FAST_FLAGS),
                        flags=FAST_FLAGS)
    return [lane(factors, k) for k in range(8)], rest


def lanes_sum(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """The sum of a <8 x float>'s lanes, halves added."""
    width, i32 = 8, ir.IntType(32)
    while width > 1:
        width //= 2
        value = builder.fadd(*(builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, width),
                                                                                 list(range(k, k + width))))
                               for k in (0, width)), flags=FAST_FLAGS)
    return builder.extract_element(value, i32(0))


def coded_row_codegen(type_id: int):
    """The LLVM code of a row's dot (see the module docstring): arguments row (uint8, its bytes), codes (int16, the
    row's inputs), steps, sums and corrections (float32, per 32 inputs: cpu_numba.coded_groups' extra) and the block
    count; an fp32 result."""
    def codegen(context, builder, signature, args):
        row, codes, steps, sums, corrections = (
            context.make_array(signature.args[k])(context, builder, args[k]).data for k in range(5))
        blocks = context.cast(builder, args[5], signature.args[5], types.intp)
        intp = context.get_value_type(types.intp)
        i8, i16, i32, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
        words, pairs, floats = ir.VectorType(i16, 16), ir.VectorType(i32, 8), ir.VectorType(f32, 8)
        pmadd = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(pairs, [words, words]))
        row = builder.bitcast(row, i8.as_pointer())
        acc = cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 8))
        rest_acc = cgutils.alloca_once_value(builder, ir.Constant(floats, [0.0] * 8))
        per_block = BLOCK_INPUTS[type_id] // GROUP_INPUTS[type_id]

        def sixteen(vector: ir.Value, k: int) -> ir.Value:  # words 16k .. 16k + 15 of a <32 x i16>
            return builder.shuffle_vector(vector, vector,
                                          ir.Constant(ir.VectorType(i32, 16), list(range(16 * k, 16 * k + 16))))

        with cgutils.for_range(builder, blocks) as loop:
            b = loop.index
            at = builder.gep(row, [builder.mul(b, intp(BLOCK_BYTES[type_id]))])

            def load(offset: int, n: int = 32) -> ir.Value:
                pointer = builder.bitcast(builder.gep(at, [intp(offset)]), ir.VectorType(i8, n).as_pointer())
                return builder.load(pointer, align=1)

            first_code = builder.gep(codes, [builder.mul(b, intp(BLOCK_INPUTS[type_id]))])
            first_group = builder.mul(b, intp(BLOCK_INPUTS[type_id] // 32))

            def half(offset: int) -> ir.Value:  # the fp16 at offset as float (vcvtph2ps: exact)
                pointer = builder.bitcast(builder.gep(at, [intp(offset)]), ir.HalfType().as_pointer())
                return builder.fpext(builder.load(pointer, align=1), f32)

            d = half(SCALE_AT[type_id])
            dmin = half(2) if type_id == Q4_K else None
            factors, rest = group_factors(builder, type_id, load, d, dmin,
                                          *(builder.gep(p, [first_group]) for p in (steps, sums, corrections)))
            if rest is not None:
                builder.store(builder.fadd(builder.load(rest_acc), rest, flags=FAST_FLAGS), rest_acc)
            pieces = [sixteen(vector, k) for vector in block_codes(builder, type_id, load) for k in (0, 1)]
            sixteens = GROUP_INPUTS[type_id] // 16
            total = builder.load(acc)
            for group in range(per_block):
                dot = None
                for k in range(group * sixteens, (group + 1) * sixteens):
                    code_pointer = builder.bitcast(builder.gep(first_code, [intp(16 * k)]), words.as_pointer())
                    product = builder.call(pmadd, [pieces[k], builder.load(code_pointer, align=2)])
                    dot = product if dot is None else builder.add(dot, product)
                total = builder.fadd(total, builder.fmul(builder.sitofp(dot, floats), factors[group], flags=FAST_FLAGS),
                                     flags=FAST_FLAGS)
            builder.store(total, acc)
        return builder.fadd(lanes_sum(builder, builder.load(acc)), lanes_sum(builder, builder.load(rest_acc)),
                            flags=FAST_FLAGS)
    return codegen


def row_intrinsic(type_id: int):
    def typer(typingctx, row, codes, steps, sums, corrections, blocks):
        check_row_arguments("a GGUF row's vector dot", (row, codes, steps, sums, corrections),
                            (types.uint8, types.int16, *[types.float32] * 3), blocks)
        return types.float32(row, codes, steps, sums, corrections, blocks), coded_row_codegen(type_id)
    typer.__name__ = f"vector_row_{type_id}"
    return intrinsic(typer)


q4_k_vector_row, q6_k_vector_row, q8_0_vector_row = (row_intrinsic(t) for t in (Q4_K, Q6_K, Q8_0))
