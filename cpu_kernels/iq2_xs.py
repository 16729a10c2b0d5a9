"""IQ2_XS: GGUF's 2.31-bit lattice format, super-blocks of 256 weights in 74 bytes (ggml block_iq2_xs).

Block layout, bytes:
    0:2      d       f16
    2:66     32 u16, one per 8 weights: bits 0..8 a grid index (iq2xs_grid, 512 rows of 8 values 8, 25, 43),
             bits 9..15 the sign index (a ksigns byte)
    66:74    scales  4-bit s per 16 weights, low nibble first
weight = d * (0.5 + s) * 0.25 * iq2xs_grid[index][k % 8] * sign

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 74).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import iq_blocks, iq_grids, simd
from .half import read_half
from .iq_blocks import at, grid_rows, nibble_scales, parity_sign_bits, with_signs
from .kquant import QK_K
from .simd import I16, I32
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ2_XS
BLOCK_SIZE = QK_K
BLOCK_BYTES = 74
_QS, _SCALES = 2, 66
_GRID = iq_grids.IQ2_XS  # [512, 8]
_KSIGNS = iq_grids.KSIGNS  # [128]
_WEIGHT_MAX = 43 * 31  # |grid value * (2s + 1)|


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (0.5 + s)) * 0.25 * grid, then the sign)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for e in range(32):
            word = np.int64(row[o + _QS + 2 * e]) | np.int64(row[o + _QS + 2 * e + 1]) << 8
            s = (row[o + _SCALES + e // 4] >> (4 * ((e // 2) % 2))) & 15
            db = d * (np.float32(0.5) + np.float32(s)) * np.float32(0.25)
            signs = _KSIGNS[word >> 9]
            for m in range(8):
                value = db * np.float32(_GRID[word & 511, m])
                dst[b * QK_K + 8 * e + m] = -value if (signs >> m) & 1 else value


def _runs(builder, q, o):
    """The 8 runs of 32 signed grid values (-43..43) of the block at byte o of row q."""
    out = []
    for r in range(8):
        words = builder.zext(simd.load_at(builder, q, at(builder, o, _QS + 8 * r), simd.vec(I16, 4)),
                             simd.vec(I32, 4))
        indices = builder.and_(words, simd.splat_const(I32, 4, 511))
        values = grid_rows(builder, "strata_iq2xs_grid", _GRID, indices)  # <32 x i8>
        sign_indices = builder.lshr(words, simd.splat_const(I32, 4, 9))
        out.append(with_signs(builder, values, parity_sign_bits(builder, sign_indices)))
    return out


def _int_scales(builder, q, o):
    return nibble_scales(builder, q, o, _SCALES)


_kernels = iq_blocks.instance("iq2_xs", BLOCK_BYTES, _unpack_row, _runs, _int_scales, iq_blocks.half_base(0.125),
                              _WEIGHT_MAX)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(_WEIGHT_MAX)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ2_XS bytes [..., C // 256 * 74] for a weight of shape (..., C), values of rms ~ scale."""
    return iq_blocks.random_blocks(rng, shape, BLOCK_BYTES, 0, 59.0, scale)
