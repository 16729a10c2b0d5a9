"""IQ3_S's int16 decode block and prefill unpacking where the target has AVX-512 VBMI and BITALG: grid lookups
by byte permutes.

The gather of grid rows (8 per 32 weights) is the cost of IQ3_S's generic block (iq_blocks): a gather of
8 dwords issues a dozen or more uops on AMD cores. Here the 512 x 4 grid is split into two 512-byte
tables, one per pair of columns (grid values 1..15 fit a nibble: column 2p low, 2p + 1 high), each
held as four 128-byte quarters. A block's 64 grid indices (qs's 8 bits and qh's 9th) look up a pair
for all of them at once: one vpermi2b per quarter (index bits 0-6), blended by bit 7 (qs's top bit) and
bit 8 (qh, already a 64-lane mask as it lies in the block). Lane l of column m is weight 4l + m, so the
block's weights come out column-major: the sign of lane l, column m is sign bit 4l + m, picked into a
mask by one vpshufbitqmb per column (one index vector for all four, the sign qwords shifted by m: fewer
live registers, which the four rows of a dot loop run short of), and x is shuffled to the same order (the
dot loop's rows share that shuffle). Pairs of lanes of one column
(weights 4l + m, 4l + 4 + m) share a 32-weight run, so the pmaddwd lanes summed over the 4 columns for
lanes l of one half of the block (32 lanes) belong to run i // 4 of that half: one conversion and FMA
per half. The integer sums are exact; the float result differs from the generic block's by the order of
its roundings only. The prefill unpacking shuffles the columns back to weight order (its int16 rows are
the generic ones exactly).

Shape legend: `q` a row's bytes, `o` a block's byte offset, b the block's number in the row; xq int16 [C],
aux f32 [C/16] of (dx, sum) pairs, one per 32 columns.
"""
import numpy as np
from llvmlite import ir
from numba.core import cgutils

from . import iq_grids, simd
from .iq_blocks import at, const
from .iq_grids import I1
from .kquant import QK_K
from .simd import F32, I8, I16, I32, I64

_QS, _QH, _SIGNS, _SCALES = 2, 66, 74, 106
_GRID = iq_grids.IQ3_S.astype(np.uint8)  # [512, 4]
_PAIRS = [(_GRID[:, 2 * p] | (_GRID[:, 2 * p + 1] << 4)).view(np.int8) for p in range(2)]  # 2 x [512]: columns
# 2p and 2p + 1 as the low and high nibble
_PERMUTE = "llvm.x86.avx512.vpermi2var.qi.512"
_PICK_BITS = "llvm.x86.avx512.vpshufbitqmb.512"


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _lookup(builder, table, qs, bit7, bit8):
    """<64 x i8> table[index_l] of int8 table [512] for the block's 64 indices: qs their low bytes, bit7 / bit8
    <64 x i1> their bits 7 and 8."""
    quarters = [_call(builder, _PERMUTE, simd.vec(I8, 64),
                      [simd.const_vec(I8, table[128 * c:128 * c + 64].tolist()), qs,
                       simd.const_vec(I8, table[128 * c + 64:128 * c + 128].tolist())]) for c in range(4)]
    low = builder.select(bit7, quarters[1], quarters[0])
    high = builder.select(bit7, quarters[3], quarters[2])
    return builder.select(bit8, high, low)


def _signed_columns(builder, q, o):
    """The block's 4 columns <64 x i8>, lane l of column m the signed value of weight 4l + m."""
    qs = simd.load_at(builder, q, at(builder, o, _QS), simd.vec(I8, 64))
    bit7 = builder.icmp_signed("<", qs, ir.Constant(qs.type, None))
    bit8 = builder.bitcast(simd.load_at(builder, q, at(builder, o, _QH), I64), simd.vec(I1, 64))
    signs = builder.zext(simd.load_at(builder, q, at(builder, o, _SIGNS), simd.vec(I32, 8)), simd.vec(I64, 8))
    picks = simd.const_vec(I8, [4 * (j % 8) for j in range(64)])  # lane j's bit (4j + m) in qword j // 8, less m
    columns = []
    for table in _PAIRS:
        pair = _lookup(builder, table, qs, bit7, bit8)
        columns += [builder.and_(pair, simd.splat_const(I8, 64, 15)), builder.lshr(pair, simd.splat_const(I8, 64, 4))]
    out = []
    for m, values in enumerate(columns):
        shifted = builder.bitcast(builder.lshr(signs, simd.splat_const(I64, 8, m)), simd.vec(I8, 64))
        negative = _call(builder, _PICK_BITS, simd.vec(I1, 64), [shifted, picks])
        out.append(builder.select(negative, builder.sub(ir.Constant(values.type, None), values), values))
    return out


def _factors(builder, q, o, aux, b):
    """<8 x float> d * (1 + 2 s_r) * dx_r of the block's 8 runs of 32 weights."""
    packed = simd.load_at(builder, q, at(builder, o, _SCALES), simd.vec(I8, 4))
    nibbles = builder.lshr(simd.lanes(builder, packed, [r // 2 for r in range(8)]),
                           simd.const_vec(I8, [0, 4] * 4))
    nibbles = builder.and_(nibbles, simd.splat_const(I8, 8, 15))
    odd = builder.add(builder.shl(nibbles, simd.splat_const(I8, 8, 1)), simd.splat_const(I8, 8, 1))
    d = simd.load_half(builder, q, at(builder, o, 0))
    scales = builder.fmul(builder.sitofp(odd, simd.vec(F32, 8)), simd.splat(builder, d, 8), flags=simd.FAST)
    pairs = simd.load_at(builder, aux, builder.mul(b, const(16)), simd.vec(F32, 16))
    return builder.fmul(scales, simd.lanes(builder, pairs, range(0, 16, 2)), flags=simd.FAST)


def block_i16(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += block b (at byte o of row q) . x for int16 xq [C] and (dx, sum) pairs aux [C/16]."""
    factors = _factors(builder, q, o, aux, b)
    columns = _signed_columns(builder, q, o)
    xo = builder.mul(b, const(QK_K))
    i16x = simd.vec(I16, 32)
    for h in range(2):  # lanes 32h .. 32h + 31: weights 128h .. 128h + 127, runs 4h .. 4h + 3
        xs = [simd.load_at(builder, xq, builder.add(xo, const(128 * h + 32 * k)), i16x) for k in range(4)]
        xall = simd.concat(builder, simd.concat(builder, xs[0], xs[1]), simd.concat(builder, xs[2], xs[3]))
        dots = None
        for m in range(4):
            values = builder.sext(simd.lanes(builder, columns[m], range(32 * h, 32 * h + 32)), i16x)
            xv = simd.lanes(builder, xall, [4 * j + m for j in range(32)])
            dot = simd.madd_i16(builder, values, xv, 32)
            dots = dot if dots is None else builder.add(dots, dot)
        acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)),
                       simd.lanes(builder, factors, [4 * h + i // 4 for i in range(16)]), acc)
    return acc


block_i16.acc_type = simd.vec(F32, 16)


def _int_scales(builder, q, o):
    """<8 x i16> of 1 + 2 s_r, the block's 8 run scales."""
    packed = simd.load_at(builder, q, at(builder, o, _SCALES), simd.vec(I8, 4))
    nibbles = builder.lshr(simd.lanes(builder, packed, [r // 2 for r in range(8)]), simd.const_vec(I8, [0, 4] * 4))
    nibbles = builder.and_(nibbles, simd.splat_const(I8, 8, 15))
    odd = builder.add(builder.shl(nibbles, simd.splat_const(I8, 8, 1)), simd.splat_const(I8, 8, 1))
    return builder.zext(odd, simd.vec(I16, 8))


def runs_i16(builder, q, o):
    """The block for prefill_i16's unpacking: 8 runs <32 x i16> of value * scale in weight order, factors d."""
    columns = _signed_columns(builder, q, o)
    every = simd.concat(builder, simd.concat(builder, columns[0], columns[1]),
                        simd.concat(builder, columns[2], columns[3]))  # <256 x i8>, column-major
    scales = _int_scales(builder, q, o)
    out = []
    for r in range(8):
        values = simd.lanes(builder, every, [64 * (k % 4) + 8 * r + k // 4 for k in range(32)])  # weights 32r + k
        out.append(builder.mul(builder.sext(values, simd.vec(I16, 32)), simd.lanes(builder, scales, [r] * 32)))
    return out, simd.splat(builder, simd.load_half(builder, q, at(builder, o, 0)), 8), None
