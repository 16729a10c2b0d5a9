"""IQ1_S: GGUF's 1.56-bit lattice format, super-blocks of 256 weights in 50 bytes (ggml block_iq1_s).

Block layout, bytes:
    0:2      d    f16
    2:34     qs   low 8 bits of 32 grid indices, one per 8 weights (iq1s_grid, 2048 rows of 8 values -1, 0, 1)
    34:50    8 u16, one per run r of 32 weights: bits 3l..3l + 2 the high 3 bits of grid index 4r + l,
             bits 12..14 the scale s, bit 15 the sign of the run's delta
weight = d * (2s + 1) * (iq1s_grid[index][k % 8] + delta),  delta = +-1/8

The kernels take the weight as d / 8 * (2s + 1) * (8 grid +- 1): integers -9..9 times an odd scale.

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 50).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import iq_blocks, iq_grids, simd
from .half import read_half
from .iq_blocks import at, grid_rows, int_splat, odd
from .kquant import QK_K
from .simd import I8, I16, I32
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ1_S
BLOCK_SIZE = QK_K
BLOCK_BYTES = 50
_QS, _QH = 2, 34
_GRID = iq_grids.IQ1  # [2048, 8]
_GRID8 = (8 * _GRID).astype(np.int8)  # [2048, 8]: -8, 0, 8
_DELTA = np.float32(0.125)
_WEIGHT_MAX = 9 * 15  # |(8 grid +- 1) * (2s + 1)|


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (2s + 1)) * (grid + delta))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for r in range(8):
            high = np.int64(row[o + _QH + 2 * r]) | np.int64(row[o + _QH + 2 * r + 1]) << 8
            dl = d * np.float32(2 * ((high >> 12) & 7) + 1)
            delta = -_DELTA if high & 0x8000 else _DELTA
            for j in range(4):
                index = np.int64(row[o + _QS + 4 * r + j]) | ((high >> (3 * j)) & 7) << 8
                for m in range(8):
                    dst[b * QK_K + 32 * r + 8 * j + m] = dl * (np.float32(_GRID[index, m]) + delta)


def _runs(builder, q, o):
    """The 8 runs of 32 values 8 grid +- 1 (-9..9) of the block at byte o of row q."""
    out = []
    for r in range(8):
        low = builder.zext(simd.load_at(builder, q, at(builder, o, _QS + 4 * r), simd.vec(I8, 4)), simd.vec(I32, 4))
        high = builder.zext(simd.load_at(builder, q, at(builder, o, _QH + 2 * r), I16), I32)
        bits = builder.and_(builder.lshr(int_splat(builder, high, 4), simd.const_vec(I32, [0, 3, 6, 9])),
                            simd.splat_const(I32, 4, 7))
        values = grid_rows(builder, "strata_iq1_grid8", _GRID8, builder.or_(low, builder.shl(
            bits, simd.splat_const(I32, 4, 8))))  # <32 x i8>
        negative = builder.icmp_unsigned("!=", builder.and_(high, ir.Constant(I32, 0x8000)), ir.Constant(I32, 0))
        delta = builder.select(negative, ir.Constant(I8, -1), ir.Constant(I8, 1))
        out.append(builder.add(values, int_splat(builder, delta, 32)))
    return out


def _int_scales(builder, q, o):
    """<16 x i8> of 2s + 1 per 16 weights (each run's scale twice)."""
    words = simd.load_at(builder, q, at(builder, o, _QH), simd.vec(I16, 8))
    tops = builder.lshr(simd.lanes(builder, words, [k // 2 for k in range(16)]), simd.splat_const(I16, 16, 12))
    return odd(builder, builder.trunc(builder.and_(tops, simd.splat_const(I16, 16, 7)), simd.vec(I8, 16)))


_kernels = iq_blocks.instance("iq1_s", BLOCK_BYTES, _unpack_row, _runs, _int_scales, iq_blocks.half_base(0.125),
                              _WEIGHT_MAX)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(_WEIGHT_MAX)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ1_S bytes [..., C // 256 * 50] for a weight of shape (..., C), values of rms ~ scale."""
    return iq_blocks.random_blocks(rng, shape, BLOCK_BYTES, 0, 7.3, scale)
