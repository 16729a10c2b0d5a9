"""IQ2_S: GGUF's 2.5-bit lattice format, super-blocks of 256 weights in 82 bytes (ggml block_iq2_s).

Block layout, bytes:
    0:2      d       f16
    2:34     qs      low 8 bits of 32 grid indices, one per 8 weights (iq2s_grid, 1024 rows of 8 values 8, 25, 43)
    34:66    signs   bit l of byte e: weight 8e + l is negative
    66:74    qh      bits 2l, 2l + 1 of byte r: bits 8, 9 of grid index 4r + l
    74:82    scales  4-bit s per 16 weights, low nibble first
weight = d * (0.5 + s) * 0.25 * iq2s_grid[index][k % 8] * sign

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 82).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import iq_blocks, iq_grids, simd
from .half import read_half
from .iq_blocks import at, grid_rows, int_splat, nibble_scales, with_signs
from .kquant import QK_K
from .simd import I8, I32
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ2_S
BLOCK_SIZE = QK_K
BLOCK_BYTES = 82
_QS, _SIGNS, _QH, _SCALES = 2, 34, 66, 74
_GRID = iq_grids.IQ2_S  # [1024, 8]
_WEIGHT_MAX = 43 * 31  # |grid value * (2s + 1)|


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (0.5 + s)) * 0.25 * grid, then the sign)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for e in range(32):
            index = np.int64(row[o + _QS + e]) | ((np.int64(row[o + _QH + e // 4]) >> (2 * (e % 4))) & 3) << 8
            s = (row[o + _SCALES + e // 4] >> (4 * ((e // 2) % 2))) & 15
            db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
            signs = row[o + _SIGNS + e]
            for m in range(8):
                value = db * np.float32(_GRID[index, m])
                dst[b * QK_K + 8 * e + m] = -value if (signs >> m) & 1 else value


def _runs(builder, q, o):
    """The 8 runs of 32 signed grid values (-43..43) of the block at byte o of row q."""
    out = []
    for r in range(8):
        low = builder.zext(simd.load_at(builder, q, at(builder, o, _QS + 4 * r), simd.vec(I8, 4)), simd.vec(I32, 4))
        high = builder.zext(builder.load(builder.gep(q, [at(builder, o, _QH + r)])), I32)
        high = builder.and_(builder.lshr(int_splat(builder, high, 4), simd.const_vec(I32, [0, 2, 4, 6])),
                            simd.splat_const(I32, 4, 3))
        indices = builder.or_(low, builder.shl(high, simd.splat_const(I32, 4, 8)))
        values = grid_rows(builder, "strata_iq2s_grid", _GRID, indices)  # <32 x i8>
        out.append(with_signs(builder, values, simd.load_at(builder, q, at(builder, o, _SIGNS + 4 * r), I32)))
    return out


def _int_scales(builder, q, o):
    return nibble_scales(builder, q, o, _SCALES)


_kernels = iq_blocks.instance("iq2_s", BLOCK_BYTES, _unpack_row, _runs, _int_scales, iq_blocks.half_base(0.125),
                              _WEIGHT_MAX)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(_WEIGHT_MAX)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ2_S bytes [..., C // 256 * 82] for a weight of shape (..., C), values of rms ~ scale."""
    return iq_blocks.random_blocks(rng, shape, BLOCK_BYTES, 0, 59.0, scale)
