"""Block code shared by the grid-based IQ formats (IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M).

Every one of them is a super-block of 256 weights whose weight k is, with integers only up to one float:
    weight = base * scale_{k // 16} * value_k
base a float of the block (d times a power of two), scale a small odd integer per 16 weights (2s + 1;
the formats with one scale per 32 weights repeat it), value_k a signed grid value (IQ1: 8 * grid +- 1,
the grid's +-1/8 delta folded in). A format describes its block by three LLVM builders:

    runs(builder, q, o)        -> 8 <32 x i8> of values, run r holding weights 32r .. 32r + 31
    int_scales(builder, q, o)  -> <16 x i8> of the scales, one per 16 weights
    base(builder, q, o)        -> float

and `instance` makes its quant_driver kernels from them, laid out as Q6_K's (runs of 32 and scales
per 16): the float dot FMAs value * base * scale with x, the int16 dot runs one pmaddwd per run and
one conversion and FMA with base * scale * dx, prefill unpacks value * scale as exact int16.
The helpers below build the pieces the formats share: grid rows by index (iq_grids.lookup), sign
bits applied to a run, the parity sign bytes of 7-bit sign indices, nibble scales.

Shape legend: R output rows, C columns, B bytes per row (C // 256 * block bytes); `q` a row's bytes,
`o` a block's byte offset in it.
"""
from llvmlite import ir

from . import iq_grids, quant_driver, simd
from .iq_grids import I1, int_splat
from .kquant import QK_K, SUB
from .prefill_i16 import x_levels
from .simd import F32, I8, I16, I32, I64
from .target import int_dot_width
from .tiles import random_weight

INT_DOT_WIDTH = int_dot_width()


def const(offset):
    return ir.Constant(I64, offset)


def at(builder, o, offset):
    """Byte o + offset (an i64)."""
    return builder.add(o, const(offset))


def grid_rows(builder, name, table, indices):
    """<4 * len x i8> or <8 * len x i8>: the grid rows at <len x i32> indices, side by side."""
    rows = iq_grids.lookup(builder, name, table, indices)
    return builder.bitcast(rows, simd.vec(I8, indices.type.count * table.shape[1]))


def with_signs(builder, values, bits):
    """<32 x i8> values negated where i32 `bits` has bit k set (lane k)."""
    mask = builder.bitcast(bits, simd.vec(I1, 32))
    return builder.select(mask, builder.sub(ir.Constant(values.type, None), values), values)


def parity_sign_bits(builder, indices):
    """i32 of the ksigns bytes of <4 x i32> 7-bit sign indices, byte j from lane j: an index with bit 7 set
    where its popcount is odd (iq_grids.sign_byte), so every sign byte has even parity."""
    fn_ty = ir.FunctionType(indices.type, [indices.type])
    name = "llvm.ctpop.v4i32"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, fn_ty, name)
    parity = builder.and_(builder.call(fn, [indices]), simd.splat_const(I32, 4, 1))
    signs = builder.or_(indices, builder.shl(parity, simd.splat_const(I32, 4, 7)))
    return builder.bitcast(builder.trunc(signs, simd.vec(I8, 4)), I32)


def packed_sign_indices(builder, word):
    """<4 x i32> of the four 7-bit sign indices in bits 0-27 of i32 `word` (IQ2_XXS, IQ3_XXS)."""
    shifted = builder.lshr(int_splat(builder, word, 4), simd.const_vec(I32, [0, 7, 14, 21]))
    return builder.and_(shifted, simd.splat_const(I32, 4, 127))


def odd(builder, values):
    """2 * values + 1 of an i8 vector."""
    n = values.type.count
    return builder.add(builder.shl(values, simd.splat_const(I8, n, 1)), simd.splat_const(I8, n, 1))


def nibble_scales(builder, q, o, offset):
    """<16 x i8> of 2s + 1 for the 16 4-bit scales s of the 8 bytes at o + offset, low nibble first (one scale
    per 16 weights: IQ2_XS, IQ2_S)."""
    packed = simd.load_at(builder, q, at(builder, o, offset), simd.vec(I8, 8))
    spread = simd.lanes(builder, packed, [k // 2 for k in range(16)])
    nibbles = builder.and_(builder.lshr(spread, simd.const_vec(I8, [4 * (k % 2) for k in range(16)])),
                           simd.splat_const(I8, 16, 15))
    return odd(builder, nibbles)


def top_nibble_scales(builder, q, o, offset, num_words, first, step):
    """<16 x i8> of 2s + 1 for the scales s in the top 4 bits of 8 of the num_words i32 words at o + offset,
    words first, first + step, ... (IQ2_XXS: the second word of each 8-byte run, IQ3_XXS: each word), one per
    32 weights, each repeated for its two halves."""
    words = simd.load_at(builder, q, at(builder, o, offset), simd.vec(I32, num_words))
    tops = builder.lshr(simd.lanes(builder, words, [first + (k // 2) * step for k in range(16)]),
                        simd.splat_const(I32, 16, 28))
    return odd(builder, builder.trunc(tops, simd.vec(I8, 16)))


def half_base(factor, offset=0):
    """base(builder, q, o): factor times the f16 at o + offset."""
    def base(builder, q, o):
        d = simd.load_half(builder, q, at(builder, o, offset))
        return builder.fmul(d, ir.Constant(F32, factor), flags=simd.FAST)

    return base


def _scale_lanes(run):
    """The 32 lanes' scale indices of run r: 2r for its first 16 weights, 2r + 1 for the next."""
    return [2 * run] * 16 + [2 * run + 1] * 16


def block_code(name, runs, int_scales, base):
    """(block, block_i16, weights, runs_i16) of a format described by runs, int_scales and base (module doc)."""
    def scales(builder, q, o):  # <16 x float>: base * scale per 16 weights
        values = builder.sitofp(int_scales(builder, q, o), simd.vec(F32, 16))
        return builder.fmul(values, simd.splat(builder, base(builder, q, o), 16), flags=simd.FAST)

    def weights(builder, q, o):
        factors = scales(builder, q, o)
        return [(SUB * r, builder.fmul(builder.sitofp(values, simd.vec(F32, SUB)),
                                       simd.lanes(builder, factors, _scale_lanes(r)), flags=simd.FAST))
                for r, values in enumerate(runs(builder, q, o))]

    def block(builder, q, o, b, xs, aux, acc):
        """acc <32 x float> += block b (at byte o of row q) . x, one FMA per run of 32 weights."""
        xo = builder.mul(b, const(QK_K))
        for offset, values in weights(builder, q, o):
            xv = simd.load_at(builder, xs, builder.add(xo, const(offset)), simd.vec(F32, SUB))
            acc = simd.fma(builder, values, xv, acc)
        return acc

    def block_i16(builder, q, o, b, xq, aux, acc):
        """acc <16 x float> += block b . x for int16 xq [C] and (dx, sum) pairs aux [C/16]: per run one
        pmaddwd (lanes 0-7 its first 16 weights, 8-15 the next), one conversion and FMA with base * scale * dx."""
        pairs = simd.load_at(builder, aux, builder.mul(b, const(16)), simd.vec(F32, 16))
        dx = simd.lanes(builder, pairs, [2 * (k // 2) for k in range(16)])  # run k // 2's dx for scale k
        factors = builder.fmul(scales(builder, q, o), dx, flags=simd.FAST)  # [16]
        xo = builder.mul(b, const(QK_K))
        i16x = simd.vec(I16, SUB)
        for r, values in enumerate(runs(builder, q, o)):
            xv = simd.load_at(builder, xq, builder.add(xo, const(SUB * r)), i16x)
            dots = simd.madd_i16(builder, builder.sext(values, i16x), xv, INT_DOT_WIDTH)  # <16 x i32>
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)),
                           simd.lanes(builder, factors, [2 * r] * 8 + [2 * r + 1] * 8), acc)
        return acc

    def runs_i16(builder, q, o):
        """The block for prefill_i16's unpacking: 8 runs <32 x i16> of value * scale, factors base, no mins."""
        int16_scales = builder.sext(int_scales(builder, q, o), simd.vec(I16, 16))
        out = [builder.mul(builder.sext(values, simd.vec(I16, SUB)), simd.lanes(builder, int16_scales, _scale_lanes(r)))
               for r, values in enumerate(runs(builder, q, o))]
        return out, simd.splat(builder, base(builder, q, o), 8), None

    block.acc_type, block_i16.acc_type = simd.vec(F32, SUB), simd.vec(F32, 16)
    for fn in (block, block_i16, weights, runs_i16):
        fn.__name__ = f"{name}_{fn.__name__}"
    return block, block_i16, weights, runs_i16


def instance(name, block_bytes, unpack_row, runs, int_scales, base, weight_max, block_i16=None, runs_i16=None):
    """The quant_driver Kernels (INT16_DECODE) of an IQ format from its scalar dequantizer unpack_row(row [B],
    dst f32 [C]) and its block builders; weight_max bounds |value * scale| (integer prefill's x levels);
    block_i16, runs_i16: a format's own int16 decode block and prefill unpacking in place of the generic ones."""
    block, generic_i16, weights, generic_runs_i16 = block_code(name, runs, int_scales, base)
    block_i16, runs_i16 = block_i16 or generic_i16, runs_i16 or generic_runs_i16
    return quant_driver.instance(name, quant_driver.INT16_DECODE, block_bytes, QK_K, unpack_row, x_levels(weight_max),
                                 block, block_i16, weights, runs_i16)


def random_blocks(rng, shape, block_bytes, d_offset, unit_rms, scale):
    """Random valid bytes [..., C // 256 * block_bytes] of an IQ format whose every bit pattern is valid but
    its f16 d at d_offset, set so values have rms ~ scale (unit_rms: their rms with d = 1)."""
    return random_weight(rng, shape, QK_K, block_bytes, ((d_offset, 1.0),), unit_rms, scale)
