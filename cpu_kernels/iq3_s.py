"""IQ3_S: GGUF's 3.4-bit lattice format, super-blocks of 256 weights in 110 bytes (ggml block_iq3_s).

Block layout, bytes:
    0:2      d      f16
    2:66     qs     low 8 bits of 64 grid indices, one per 4 weights
    66:74    qh     bit l of byte r: bit 8 of grid index 8r + l
    74:106   signs  bit l of byte k: weight 8k + l is negative
    106:110  scales 4-bit s per 32 weights, low nibble first
weight = d * (1 + 2 s) * iq3s_grid[index][k % 4] * sign   (grid values 1, 3, .., 15)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 110).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import iq3_s_vbmi, iq_blocks, iq_grids, simd
from .half import read_half
from .iq_blocks import at, grid_rows, int_splat, odd, with_signs
from .kquant import QK_K
from .simd import I8, I32
from .target import has_byte_permutes
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ3_S
BLOCK_SIZE = QK_K
BLOCK_BYTES = 110
_QS, _QH, _SIGNS, _SCALES = 2, 66, 74, 106
_GRID = iq_grids.IQ3_S  # [512, 4]


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (1 + 2s)) * grid, then the sign)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for r in range(8):
            db = d * np.float32(1 + 2 * ((row[o + _SCALES + r // 2] >> (4 * (r % 2))) & 15))
            high = row[o + _QH + r]
            for l in range(8):
                index = np.int64(row[o + _QS + 8 * r + l]) | ((np.int64(high) >> l) & 1) << 8
                for m in range(4):
                    k = 32 * r + 4 * l + m
                    value = db * np.float32(_GRID[index, m])
                    negative = (row[o + _SIGNS + k // 8] >> (k % 8)) & 1
                    dst[b * QK_K + k] = -value if negative else value


def _runs(builder, q, o):
    """The 8 runs of 32 signed grid values (-15..15) of the block at byte o of row q."""
    out = []
    bit_shifts = simd.const_vec(I32, range(8))
    for r in range(8):
        low = builder.zext(simd.load_at(builder, q, at(builder, o, _QS + 8 * r), simd.vec(I8, 8)), simd.vec(I32, 8))
        high = builder.zext(builder.load(builder.gep(q, [at(builder, o, _QH + r)])), I32)
        high = builder.and_(builder.lshr(int_splat(builder, high, 8), bit_shifts), simd.splat_const(I32, 8, 1))
        indices = builder.or_(low, builder.shl(high, simd.splat_const(I32, 8, 8)))
        values = grid_rows(builder, "strata_iq3s_grid", _GRID, indices)  # <32 x i8>
        signs = simd.load_at(builder, q, at(builder, o, _SIGNS + 4 * r), I32)
        out.append(with_signs(builder, values, signs))
    return out


def _int_scales(builder, q, o):
    """<16 x i8> of 1 + 2s per 16 weights (each 32-weight scale twice)."""
    packed = simd.load_at(builder, q, at(builder, o, _SCALES), simd.vec(I8, 4))
    spread = simd.lanes(builder, packed, [k // 4 for k in range(16)])
    nibbles = builder.lshr(spread, simd.const_vec(I8, [4 * ((k // 2) % 2) for k in range(16)]))
    return odd(builder, builder.and_(nibbles, simd.splat_const(I8, 16, 15)))


_kernels = iq_blocks.instance("iq3_s", BLOCK_BYTES, _unpack_row, _runs, _int_scales, iq_blocks.half_base(1.0),
                              15 * 31, *((iq3_s_vbmi.block_i16, iq3_s_vbmi.runs_i16) if has_byte_permutes() else ()))
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(15 * 31)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ3_S bytes [..., C // 256 * 110] for a weight of shape (..., C), values of rms ~ scale
    (rms ~156 with d = 1: uniform 4-bit scales and grid rows)."""
    return iq_blocks.random_blocks(rng, shape, BLOCK_BYTES, 0, 156.0, scale)
