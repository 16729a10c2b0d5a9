"""IQ4_XS: GGUF's 4-bit non-linear K-quant, super-blocks of 256 weights in 136 bytes (ggml block_iq4_xs).

Block layout, bytes:
    0:2     d         f16 scale of the sub-block scales
    2:4     scales_h  u16: bits 2j..2j+1 are the top 2 bits of sub-block j's 6-bit scale
    4:8     scales_l  low 4 bits of the scales: sub-block j in byte j // 2, low nibble for even j
    8:136   qs        4-bit indices, 16 bytes per sub-block of 32 (low nibbles weights 0-15, high 16-31)
weight = (d * (scale_j - 32)) * KVALUES[index]   (sub-block j; KVALUES: IQ4_NL's 16 int8 levels)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 136).
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from llvmlite import ir
from numba import njit
from numba.core import cgutils

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, load_bytes, offset, run_blocks, splat_int, table_runs
from .simd import F32, I16, I64
from .target import int_dot_width
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.IQ4_XS
BLOCK_SIZE = 256
BLOCK_BYTES = 136
KVALUES = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)  # [16] the non-linear levels
HALF_OFFSETS = (0,)  # byte offsets of the f16 scales in a block
_QS = 8  # offset of the indices
INT_DOT_WIDTH = int_dot_width()


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * float(scale - 32)) * float(level))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        high = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)
        for j in range(8):
            low = (np.int32(row[o + 4 + j // 2]) >> (4 * (j % 2))) & 15
            dl = d * np.float32(((low | (((high >> (2 * j)) & 3) << 4))) - 32)
            for l in range(16):
                byte = row[o + _QS + 16 * j + l]
                dst[b * BLOCK_SIZE + 32 * j + l] = dl * np.float32(KVALUES[byte & 15])
                dst[b * BLOCK_SIZE + 32 * j + 16 + l] = dl * np.float32(KVALUES[byte >> 4])


def _factors(builder, q, o):
    """<8 x float> d * (scale_j - 32) of the block at byte o of row q."""
    i16x8 = simd.vec(I16, 8)
    low = builder.zext(simd.lanes(builder, load_bytes(builder, q, o, 4, 4), [0, 0, 1, 1, 2, 2, 3, 3]), i16x8)
    low = builder.and_(builder.lshr(low, simd.const_vec(I16, [0, 4] * 4)), simd.splat_const(I16, 8, 15))
    high = splat_int(builder, simd.load_at(builder, q, offset(builder, o, 2), I16), 8)  # scales_h in every lane
    high = builder.and_(builder.lshr(high, simd.const_vec(I16, range(0, 16, 2))), simd.splat_const(I16, 8, 3))
    scales = builder.sub(builder.or_(low, builder.shl(high, simd.splat_const(I16, 8, 4))), simd.splat_const(I16, 8, 32))
    d = simd.splat(builder, simd.load_half(builder, q, o), 8)
    return builder.fmul(builder.sitofp(scales, simd.vec(F32, 8)), d, flags=simd.FAST)


def _describe(builder, q, o):
    """The block at byte o of row q as 8 runs: table levels (int16), factors d * (scale_j - 32)."""
    return Runs(table_runs(builder, q, o, _QS, 8, KVALUES, paired=True), _factors(builder, q, o), paired=True)


def _word_block_i16(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += block b . x for int16 xq [C] and (dx, sum) pairs aux [C/16], where the target has
    AVX-512BW: each 64 index bytes load as 32 words, whose 4 nibbles (low and high of the even and odd bytes)
    index the levels as words through one vpermw each, no byte lookup or widening; x is gathered to match
    (x alone: the rows of a dot loop share it). Lane i of the summed pmaddwd belongs to run i // 4, so one
    conversion and FMA serve four runs."""
    pairs = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 16)), simd.vec(F32, 16))
    scales = builder.fmul(_factors(builder, q, o), simd.lanes(builder, pairs, range(0, 16, 2)), flags=simd.FAST)
    i16x = simd.vec(I16, 32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16x, [i16x, i16x]),
                                        "llvm.x86.avx512.permvar.hi.512")
    levels = simd.const_vec(I16, [int(v) for v in KVALUES] * 2)
    xo = builder.mul(b, ir.Constant(I64, BLOCK_SIZE))
    words = builder.bitcast(q, I16.as_pointer())
    for h in range(2):  # runs 4h .. 4h + 3
        packed = simd.load_at(builder, words, builder.udiv(builder.add(o, ir.Constant(I64, _QS + 64 * h)),
                                                           ir.Constant(I64, 2)), i16x)
        xs = [simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, 128 * h + 32 * k)), i16x) for k in range(4)]
        xall = simd.concat(builder, simd.concat(builder, xs[0], xs[1]), simd.concat(builder, xs[2], xs[3]))
        dots = None
        for nib in range(2):
            for e in range(2):
                shift = 8 * e + 4 * nib
                idx = builder.and_(builder.lshr(packed, simd.splat_const(I16, 32, shift)), simd.splat_const(I16, 32, 15))
                values = builder.call(fn, [levels, idx])
                xv = simd.lanes(builder, xall, [32 * (w // 8) + 16 * nib + 2 * (w % 8) + e for w in range(32)])
                dot = simd.madd_i16(builder, values, xv, INT_DOT_WIDTH)
                dots = dot if dots is None else builder.add(dots, dot)
        acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)),
                       simd.lanes(builder, scales, [4 * h + i // 4 for i in range(16)]), acc)
    return acc


_word_block_i16.acc_type = simd.vec(F32, 16)


_block, _block_i16, _weights, _runs_i16 = run_blocks("iq4_xs", _describe, BLOCK_SIZE)
if INT_DOT_WIDTH == 32:  # vpermw: AVX-512BW
    _block_i16 = _word_block_i16
_X_LEVELS = x_levels(127)  # integer prefill: |x| levels for |weight integers| <= 127
_kernels = quant_driver.instance("iq4_xs", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ4_XS bytes [..., C // 256 * 136] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, (scale_j - 32) * level has rms ~1246 (18.5 * 67.4) for uniform random 6-bit scales and indices.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((0, 1.0),), 1246.0, scale)
