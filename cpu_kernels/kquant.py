"""Pieces shared by the K-quant formats (Q4_K, Q5_K, Q6_K): super-blocks of 256 weights.

8-bit bit-field intrinsics and the packed 6-bit sub-block scales; the vector block code
of the formats with (scale, min) sub-blocks (Q4_K, Q5_K), built once per quant layout
by `vector_blocks`; the work split, checks and wrappers are in `tiles`.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from . import aligned, simd
from .half import read_half
from .simd import F32, I8, I32, I64
from .target import int_dot_width

QK_K = 256  # weights per super-block
SUB = 32  # weights per sub-block of Q4_K / Q5_K (and per run of quant bytes in Q6_K)


@intrinsic
def ubits(typingctx, byte, shift, mask):
    """float32((byte >> shift) & mask) for a uint8 `byte`, computed in 8 bits.

    Numba widens integer arithmetic to int64, and int64 -> float conversions do not
    vectorize before AVX-512; 8-bit shifts, masks and uint8 -> float32 do.
    """
    if byte != types.uint8 or not isinstance(shift, types.Integer) or not isinstance(mask, types.Integer):
        return None
    sig = types.float32(byte, shift, mask)

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        bits = builder.lshr(args[0], builder.trunc(args[1], i8))
        bits = builder.and_(bits, builder.trunc(args[2], i8))
        return builder.uitofp(bits, ir.FloatType())

    return sig, codegen


@intrinsic
def join_bits(typingctx, low, low_shift, high, high_shift, high_mask):
    """float32(((low >> low_shift) & 15) | (((high >> high_shift) & high_mask) << 4)) for uint8 bytes, in 8 bits.

    A 5- or 6-bit quant from its low nibble and its high bits, converted to float once.
    """
    if low != types.uint8 or high != types.uint8:
        return None
    sig = types.float32(low, low_shift, high, high_shift, high_mask)

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        low_bits = builder.and_(builder.lshr(args[0], builder.trunc(args[1], i8)), ir.Constant(i8, 15))
        high_bits = builder.and_(builder.lshr(args[2], builder.trunc(args[3], i8)), builder.trunc(args[4], i8))
        return builder.uitofp(builder.or_(low_bits, builder.shl(high_bits, ir.Constant(i8, 4))), ir.FloatType())

    return sig, codegen


@njit(inline="always", nogil=True, cache=True)
def scale_min(raw, offset, j):
    """(scale, min) of sub-block j (0-7) from the 12 packed bytes at `offset` (ggml's get_scale_min_k4).

    bytes 0-3: scales 0-3 (low 6 bits), top 2 bits of scales 4-7
    bytes 4-7: mins 0-3 (low 6 bits), top 2 bits of mins 4-7
    bytes 8-11: low 4 bits of scales 4-7 (low nibble), of mins 4-7 (high nibble)
    """
    if j < 4:
        sc = raw[offset + j] & 63
        m = raw[offset + j + 4] & 63
    else:
        sc = (raw[offset + j + 4] & 15) | ((raw[offset + j - 4] >> 6) << 4)
        m = (raw[offset + j + 4] >> 4) | ((raw[offset + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(inline="always", nogil=True, cache=True)
def sub_scales(row, o, j):
    """(d * scale_j, dmin * min_j) of sub-block j of the Q4_K / Q5_K block at byte o (d, dmin, packed scales)."""
    sc, m = scale_min(row, o + 4, j)
    return read_half(row, o) * sc, read_half(row, o + 2) * m


INT_DOT_WIDTH = int_dot_width()


def _scales_mins(builder, q, o):
    """The 8 sub-block (scale, min) 6-bit pairs of the block at byte o, unpacked as two <8 x i8> (scale_min)."""
    packed = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 4)), simd.vec(I8, 16))  # bytes 4..19
    low6 = simd.const_vec(I8, [63] * 4 + [15] * 4)
    top2 = simd.const_vec(I8, [0] * 4 + [0x30] * 4)

    def six_bits(low_lanes, low_shift, top_lanes):
        low = builder.and_(builder.lshr(simd.lanes(builder, packed, low_lanes), simd.const_vec(I8, low_shift)), low6)
        top = builder.shl(builder.lshr(simd.lanes(builder, packed, top_lanes), simd.splat_const(I8, 8, 6)),
                          simd.splat_const(I8, 8, 4))
        return builder.or_(low, builder.and_(top, top2))

    scales = six_bits([0, 1, 2, 3, 8, 9, 10, 11], [0] * 8, [0, 1, 2, 3, 0, 1, 2, 3])
    mins = six_bits([4, 5, 6, 7, 8, 9, 10, 11], [0] * 4 + [4] * 4, [4, 5, 6, 7, 4, 5, 6, 7])
    return scales, mins


def _scaled(builder, q, o, values, at):
    """<8 x float> of the f16 at byte o + at times the 8 integers `values`."""
    half = simd.load_half(builder, q, builder.add(o, ir.Constant(I64, at)))
    return builder.fmul(builder.uitofp(values, simd.vec(F32, 8)), simd.splat(builder, half, 8), flags=simd.FAST)


def sub_block_quants(low_offset, high_offset=None):
    """quants(builder, q, o, elem) -> the 8 sub-blocks of the block at byte o as <32 x elem> (I8 or I16): 4-bit
    quants from the bytes at low_offset (sub-block 2p in the low nibbles of bytes 32p.., 2p + 1 in the high
    ones), plus, with high_offset, bit j of byte l there as bit 4 of weight l of sub-block j (Q5_K). The bytes
    are widened before the nibbles are split: one widening per two sub-blocks instead of one each."""
    def quants(builder, q, o, elem):
        ty = simd.vec(elem, SUB)

        def load(offset):
            raw = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, offset)), simd.vec(I8, SUB))
            return raw if elem == I8 else builder.zext(raw, ty)

        def const(value):
            return simd.splat_const(elem, SUB, value)

        high = None if high_offset is None else load(high_offset)
        out = []
        for p in range(4):
            packed = load(low_offset + SUB * p)
            for k, nibbles in enumerate((builder.and_(packed, const(15)), builder.lshr(packed, const(4)))):
                if high is not None:
                    j = 2 * p + k
                    nibbles = builder.or_(nibbles, builder.shl(builder.and_(builder.lshr(high, const(j)), const(1)),
                                                               const(4)))
                out.append(nibbles)
        return out

    return quants


def sub_block_pairs(low_offset, high_offset=None):
    """pairs(builder, q, o) -> [(j0, j1, <64 x i8>)]: the sub-blocks of the block at byte o two at a time, as
    sub_block_quants lays them out, from one 64-byte load per four: (0, 2) and (1, 3) from the low and high
    nibbles of bytes 0..63, then (4, 6) and (5, 7); int8 x stores its sub-blocks in that order
    (act_quant.NIBBLE_ORDER)."""
    def pairs(builder, q, o):
        def const(value):
            return simd.splat_const(I8, 2 * SUB, value)

        high = None
        if high_offset is not None:
            high = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, high_offset)), simd.vec(I8, SUB))
            high = simd.concat(builder, high, high)
        out = []
        for h in range(2):
            packed = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, low_offset + 2 * SUB * h)),
                                  simd.vec(I8, 2 * SUB))
            for k, nibbles in enumerate((builder.and_(packed, const(15)), builder.lshr(packed, const(4)))):
                j0, j1 = 4 * h + k, 4 * h + k + 2
                if high is not None:
                    bits = builder.and_(simd.word_lshr(builder, high, [j0] * 16 + [j1] * 16), const(1))
                    nibbles = builder.or_(nibbles, builder.shl(bits, const(4)))
                out.append((j0, j1, nibbles))
        return out

    return pairs


def split_block_i16(low_offset):
    """block_i16(builder, q, o, b, xq, aux, acc <16 x float>) for 4-bit quants at low_offset with int16 xq [C] in
    act_quant.SPLIT_ORDER: each 64 quant bytes load as 32 int16 lanes, and shifts and masks alone give the low
    and high nibbles of their even and odd bytes, no widening shuffle; the even and odd halves of a sub-block
    pair meet in int32 after one pmaddwd each, then one conversion and FMA per two sub-blocks (lanes 0-7 one
    sub-block, 8-15 the one two on). It runs faster than the widened path (block_i16 of vector_blocks), by
    about a fifth from L2."""
    i16x = simd.vec(simd.I16, SUB)  # 64 quant bytes as words, or 32 x values

    def mask(value):
        return simd.splat_const(simd.I16, SUB, value)

    def block_i16(builder, q, o, b, xq, aux, acc):
        factors, acc, xo = _int_block_start(builder, q, o, b, aux, acc)
        words = builder.bitcast(q, simd.I16.as_pointer())
        for h in range(2):
            byte = builder.add(o, ir.Constant(I64, low_offset + 2 * SUB * h))
            packed = simd.load_at(builder, words, builder.udiv(byte, ir.Constant(I64, 2)), i16x)  # bytes as words
            parts = [builder.and_(packed, mask(15)), builder.and_(builder.lshr(packed, mask(8)), mask(15)),
                     builder.and_(builder.lshr(packed, mask(4)), mask(15)), builder.lshr(packed, mask(12))]
            for pair in range(2):  # low nibbles: sub-blocks 4h, 4h + 2; high nibbles: 4h + 1, 4h + 3
                dots = [simd.madd_i16(builder, parts[2 * pair + odd],
                                      simd.load_at(builder, xq, builder.add(xo, ir.Constant(
                                          I64, 4 * SUB * h + SUB * (2 * pair + odd))), i16x), INT_DOT_WIDTH)
                        for odd in range(2)]
                j = 4 * h + pair
                factor = simd.lanes(builder, factors, [j] * 8 + [j + 2] * 8)
                acc = simd.fma(builder, builder.sitofp(builder.add(*dots), simd.vec(F32, 16)), factor, acc)
        return acc

    block_i16.acc_type = simd.vec(F32, 16)
    return block_i16



def digit_block_i16(low_offset):
    """split_block_i16 for targets with VNNI, int16 xq [C] held as bytes (q4_k.quantize_rows_digits): per
    super-block the high bytes (signed) of its 256 values, then their low bytes (unsigned), each in
    act_quant.NIBBLE_ORDER. Per pair of sub-blocks (64 nibbles as bytes, sub_block_pairs) one vpdpbusd of the
    quants with the high bytes, shifted up 8 bits, then one of the low bytes with the quants (0..15 read as
    signed): the same int32 sums as split_block_i16's (so the same results), 64 products an instruction where
    pmaddwd makes 32, and the nibbles unpacked as bytes, not words."""
    pairs_of = sub_block_pairs(low_offset)
    i8x, eight = simd.vec(I8, 2 * SUB), simd.splat_const(I32, 16, 8)

    def block_i16(builder, q, o, b, xq, aux, acc):
        factors, acc, _ = _int_block_start(builder, q, o, b, aux, acc)
        xb = builder.bitcast(xq, I8.as_pointer())
        base = builder.mul(b, ir.Constant(I64, 2 * QK_K))  # bytes
        for i, (j0, j1, nibbles) in enumerate(pairs_of(builder, q, o)):
            high = simd.load_at(builder, xb, builder.add(base, ir.Constant(I64, 2 * SUB * i)), i8x)
            low = simd.load_at(builder, xb, builder.add(base, ir.Constant(I64, QK_K + 2 * SUB * i)), i8x)
            dots = simd.dot_u8i8(builder, ir.Constant(simd.vec(I32, 16), None), nibbles, high)
            dots = simd.dot_u8i8(builder, builder.shl(dots, eight), low, nibbles)  # <16 x i32>: lanes 0-7 j0, 8-15 j1
            factor = simd.lanes(builder, factors, [j0] * 8 + [j1] * 8)
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), factor, acc)
        return acc

    block_i16.acc_type = simd.vec(F32, 16)
    return block_i16


@intrinsic
def _split_run(typingctx, src, s, dst, d):
    """The 32 int16 src[s:s + 32] as their high bytes at byte d of dst (int16 [C], read as bytes) and their low
    bytes at byte d + QK_K: one load, two truncations, two stores."""
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == types.int16
               for a in (src, dst)):
        return None

    def codegen(context, builder, signature, args):
        i16x = simd.vec(simd.I16, SUB)
        v = simd.load_at(builder, simd.data_ptr(context, builder, signature.args[0], args[0]), args[1], i16x)
        out = builder.bitcast(simd.data_ptr(context, builder, signature.args[2], args[2]), I8.as_pointer())
        high = builder.trunc(builder.ashr(v, simd.splat_const(simd.I16, SUB, 8)), simd.vec(I8, SUB))
        low = builder.trunc(v, simd.vec(I8, SUB))
        for offset, part in ((args[3], high), (builder.add(args[3], ir.Constant(I64, QK_K)), low)):
            builder.store(part, builder.bitcast(builder.gep(out, [offset]), part.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(src, types.int64, dst, types.int64), codegen


@njit(nogil=True, cache=True)
def bytes_of_rows(xq, runs, rows):
    """int16 xq [N, C] -> a new [N, C] whose bytes hold, per 256-value super-block, the values' high bytes, then
    their low bytes, each as 8 runs of 32: run r from xq's values runs[r] .. runs[r] + 31 of the super-block (the
    byte form of digit_block_i16 and q6_k's int16 decode); only the rows where rows [N] is true (the others
    undefined: act_quant.decode_rows)."""
    out = aligned.empty(xq.size, np.int16).reshape(xq.shape)  # [N, C]
    for n in range(xq.shape[0]):
        if not rows[n]:
            continue
        src, dst = xq[n], out[n]
        for base in range(0, xq.shape[1], QK_K):
            for r in range(QK_K // SUB):
                _split_run(src, base + runs[r], dst, 2 * base + SUB * r)
    return out

# Lanes of _int_block_start's 16 unpacked 6-bit values: 0-7 the mins, 8-15 the scales of sub-blocks 0-7 (scale_min),
# from the block's first 16 bytes (d, dmin, then the 12 packed bytes): the byte holding the low bits, their shift
# and mask, the byte holding the top 2 bits (sub-blocks 4-7) and where they go.
_LOW_BYTE = [8 + j for j in range(8)] + [4 + (j if j < 4 else j + 4) for j in range(8)]
_LOW_SHIFT = [0] * 4 + [4] * 4 + [0] * 8
_LOW_MASK = ([63] * 4 + [15] * 4) * 2
_TOP_BYTE = [0] * 4 + [4 + j for j in range(4, 8)] + [0] * 4 + [j for j in range(4, 8)]
_TOP_MASK = ([0] * 4 + [0x30] * 4) * 2


def _int_block_start(builder, q, o, b, aux, acc):
    """What an integer-x block dot does first: (factors <8 x float> = d * scale_j * dx_j, acc <16 x float> minus
    the sub-blocks' dmin * min_j * sum(x) in lanes 0-7, the block's first x index), aux [C/16] holding (dx, sum)
    pairs. One 16-byte load gives d, dmin and the packed 6-bit scales and mins, unpacked side by side as 16
    words (mins, then scales) and scaled by one <16 x float> of dmin x 8, d x 8."""
    head = simd.load_at(builder, q, o, simd.vec(I8, 16))
    i16x = simd.vec(simd.I16, 16)
    low = builder.zext(simd.lanes(builder, head, _LOW_BYTE), i16x)
    top = builder.zext(simd.lanes(builder, head, _TOP_BYTE), i16x)
    low = builder.and_(builder.lshr(low, simd.const_vec(simd.I16, _LOW_SHIFT)), simd.const_vec(simd.I16, _LOW_MASK))
    top = builder.and_(builder.lshr(top, simd.splat_const(simd.I16, 16, 2)), simd.const_vec(simd.I16, _TOP_MASK))
    values = builder.uitofp(builder.or_(low, top), simd.vec(F32, 16))  # min_j, then scale_j
    dmin_d = _dmin_d(builder, q, o, head)
    pairs = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 16)), simd.vec(F32, 16))  # (dx, sum) x 8
    sums_dx = simd.lanes(builder, pairs, list(range(1, 16, 2)) + list(range(0, 16, 2)))
    terms = builder.fmul(builder.fmul(values, dmin_d, flags=simd.FAST), sums_dx, flags=simd.FAST)
    if acc.type.count != 16:
        raise ValueError(f"_int_block_start: a <16 x float> accumulator, not {acc.type}")
    in_mins = simd.const_vec(ir.IntType(1), [1] * 8 + [0] * 8)
    acc = builder.select(in_mins, builder.fsub(acc, terms, flags=simd.FAST), acc)
    return simd.lanes(builder, terms, range(8, 16)), acc, builder.mul(b, ir.Constant(I64, QK_K))


def _dmin_d(builder, q, o, head):
    """<16 x float> dmin x 8, d x 8 of the block at byte o (head: its first 16 bytes)."""
    if not simd.has_f16c():
        return simd.load_halves(builder, q, [builder.add(o, ir.Constant(I64, at)) for at in [2] * 8 + [0] * 8])
    halves = simd.lanes(builder, builder.bitcast(head, simd.vec(simd.I16, 8)), [1] * 8 + [0] * 8)
    return builder.fpext(builder.bitcast(halves, simd.vec(ir.HalfType(), 16)), simd.vec(F32, 16))


def _subtract_mins(builder, acc, min_terms):
    """acc - min_terms [8] in acc's lanes 0-7."""
    width = acc.type.count
    spread = builder.shuffle_vector(min_terms, ir.Constant(simd.vec(F32, 8), None),
                                    simd.const_vec(I32, list(range(8)) + [8] * (width - 8)))
    return builder.fsub(acc, spread, flags=simd.FAST)


def integer_runs(name, quants):
    """runs_i16(builder, q, o) of a (scale, min) K-quant's block at byte o, for prefill_i16's unpacking: its 8
    sub-blocks as <32 x i16> quant * scale_j (<= 31 * 63), factors <8 x float> of d and mins dmin * min_j."""
    def runs_i16(builder, q, o):
        scale_values, min_values = _scales_mins(builder, q, o)
        scales = builder.zext(scale_values, simd.vec(simd.I16, 8))
        runs = [builder.mul(values, simd.lanes(builder, scales, [j] * SUB))
                for j, values in enumerate(quants(builder, q, o, simd.I16))]
        d = simd.load_half(builder, q, o)
        return runs, simd.splat(builder, d, 8), _scaled(builder, q, o, min_values, 2)

    runs_i16.__name__ = f"{name}_runs_i16"
    return runs_i16


def vector_blocks(name, quants, pairs):
    """(block, block_i16, block_i8, weights) of a (scale, min) K-quant whose sub-block quants come from `quants`
    (and `pairs`, sub_block_pairs):

    block(builder, q, o, b, xs, xsum, acc <32 x float>): acc += block b . x, the mins from the sub-block sums xsum;
    block_i16(builder, q, o, b, xq, aux, acc <16 x float>): the same for int16 xq [C] and (scale dx, sum) pairs
        aux [C/16]: per sub-block j one pmaddwd, converted and FMA'd with d * scale_j * dx_j;
    block_i8(builder, q, o, b, xq, aux, acc <16 x float>): the same for int8 xq [C] in NIBBLE_ORDER: per pair of
        sub-blocks one vpdpbusd (the quants are unsigned already), converted and FMA'd;
    weights(builder, q, o): the block as 8 (offset, <32 x float>) sub-blocks (d * scale_j) * q - dmin * min_j.
    """
    f32x8 = simd.vec(F32, 8)

    def block(builder, q, o, b, xs, xsum, acc):
        scale_values, min_values = _scales_mins(builder, q, o)
        scales, mins = _scaled(builder, q, o, scale_values, 0), _scaled(builder, q, o, min_values, 2)
        sums = simd.load_at(builder, xsum, builder.mul(b, ir.Constant(I64, 8)), f32x8)
        acc = _subtract_mins(builder, acc, builder.fmul(mins, sums, flags=simd.FAST))
        xo = builder.mul(b, ir.Constant(I64, QK_K))
        for j, values in enumerate(quants(builder, q, o, I8)):
            xv = simd.load_at(builder, xs, builder.add(xo, ir.Constant(I64, SUB * j)), simd.vec(F32, SUB))
            weights = builder.fmul(builder.uitofp(values, simd.vec(F32, SUB)), simd.lanes(builder, scales, [j] * SUB),
                                   flags=simd.FAST)
            acc = simd.fma(builder, weights, xv, acc)
        return acc

    def block_i16(builder, q, o, b, xq, aux, acc):
        i16x = simd.vec(simd.I16, SUB)
        factors, acc, xo = _int_block_start(builder, q, o, b, aux, acc)
        for j, values in enumerate(quants(builder, q, o, simd.I16)):
            xv = simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, SUB * j)), i16x)
            dots = simd.madd_i16(builder, values, xv, INT_DOT_WIDTH)  # <16 x i32>
            factor = simd.lanes(builder, factors, [j] * 16)
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), factor, acc)
        return acc

    def block_i8(builder, q, o, b, xq, aux, acc):
        factors, acc, xo = _int_block_start(builder, q, o, b, aux, acc)
        zeros = ir.Constant(simd.vec(I32, 16), None)
        for i, (j0, j1, values) in enumerate(pairs(builder, q, o)):
            xv = simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, 2 * SUB * i)), simd.vec(I8, 2 * SUB))
            dots = simd.dot_u8i8(builder, zeros, values, xv)  # <16 x i32>: lanes 0-7 sub-block j0, 8-15 j1
            factor = simd.lanes(builder, factors, [j0] * 8 + [j1] * 8)
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), factor, acc)
        return acc

    def weights(builder, q, o):
        scale_values, min_values = _scales_mins(builder, q, o)
        scales, mins = _scaled(builder, q, o, scale_values, 0), _scaled(builder, q, o, min_values, 2)
        return [(SUB * j, builder.fsub(builder.fmul(builder.uitofp(values, simd.vec(F32, SUB)),
                                                    simd.lanes(builder, scales, [j] * SUB), flags=simd.FAST),
                                       simd.lanes(builder, mins, [j] * SUB), flags=simd.FAST))
                for j, values in enumerate(quants(builder, q, o, I8))]

    block.acc_type, block_i16.acc_type, block_i8.acc_type = simd.vec(F32, SUB), simd.vec(F32, 16), simd.vec(F32, 16)
    for fn in (block, block_i16, block_i8, weights):
        fn.__name__ = f"{name}_{fn.__name__}"
    return block, block_i16, block_i8, weights
