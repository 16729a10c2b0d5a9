"""IQ2_XXS: GGUF's 2.06-bit lattice format, super-blocks of 256 weights in 66 bytes (ggml block_iq2_xxs).

Block layout, bytes: 0:2 d (f16), then per run r of 32 weights 8 bytes at 2 + 8r:
    4 bytes   grid indices, one per 8 weights (iq2xxs_grid, 256 rows of 8 values 8, 25, 43)
    1 u32     bits 7j..7j + 6: sign index of weights 8j..8j + 7 (a ksigns byte), bits 28..31: scale s
weight = d * (0.5 + s) * 0.25 * iq2xxs_grid[index][k % 8] * sign

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 66).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import iq_blocks, iq_grids, simd
from .half import read_half
from .iq_blocks import at, grid_rows, packed_sign_indices, parity_sign_bits, top_nibble_scales, with_signs
from .kquant import QK_K
from .simd import I8, I32
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ2_XXS
BLOCK_SIZE = QK_K
BLOCK_BYTES = 66
_GRID = iq_grids.IQ2_XXS  # [256, 8]
_KSIGNS = iq_grids.KSIGNS  # [128]
_WEIGHT_MAX = 43 * 31  # |grid value * (2s + 1)|


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (0.5 + s)) * 0.25 * grid, then the sign)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for r in range(8):
            at_r = o + 2 + 8 * r
            word = np.uint32(row[at_r + 4]) | np.uint32(row[at_r + 5]) << 8 | np.uint32(row[at_r + 6]) << 16 \
                | np.uint32(row[at_r + 7]) << 24
            db = d * (np.float32(0.5) + np.float32(word >> 28)) * np.float32(0.25)
            for j in range(4):
                signs = _KSIGNS[(word >> (7 * j)) & 127]
                for m in range(8):
                    value = db * np.float32(_GRID[row[at_r + j], m])
                    dst[b * QK_K + 32 * r + 8 * j + m] = -value if (signs >> m) & 1 else value


def _runs(builder, q, o):
    """The 8 runs of 32 signed grid values (-43..43) of the block at byte o of row q."""
    out = []
    for r in range(8):
        indices = builder.zext(simd.load_at(builder, q, at(builder, o, 2 + 8 * r), simd.vec(I8, 4)),
                               simd.vec(I32, 4))
        values = grid_rows(builder, "strata_iq2xxs_grid", _GRID, indices)  # <32 x i8>
        word = simd.load_at(builder, q, at(builder, o, 6 + 8 * r), I32)
        out.append(with_signs(builder, values, parity_sign_bits(builder, packed_sign_indices(builder, word))))
    return out


def _int_scales(builder, q, o):
    """<16 x i8> of 2s + 1 per 16 weights, from the top nibble of each run's second word."""
    return top_nibble_scales(builder, q, o, 2, 16, 1, 2)


_kernels = iq_blocks.instance("iq2_xxs", BLOCK_BYTES, _unpack_row, _runs, _int_scales, iq_blocks.half_base(0.125),
                              _WEIGHT_MAX)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(_WEIGHT_MAX)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ2_XXS bytes [..., C // 256 * 66] for a weight of shape (..., C), values of rms ~ scale."""
    return iq_blocks.random_blocks(rng, shape, BLOCK_BYTES, 0, 59.0, scale)
