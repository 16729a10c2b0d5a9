"""Q5_0: GGUF's 5-bit format, blocks of 32 weights in 22 bytes (ggml block_q5_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:6     qh   u32: bit j is bit 4 of weight j
    6:22    qs   low 4 bits: weight j (j < 16) in the low nibble of byte 6 + j, weight 16 + j in its high nibble
weight = d * (q - 16)   (q in 0..31)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 22).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, fifth_bits, nibble_runs, read_u32, run_blocks, widen
from .simd import I16
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q5_0
BLOCK_SIZE = 32
BLOCK_BYTES = 22
HALF_OFFSETS = (0,)  # byte offsets of the f16 scales in a block
_QS = 6  # offset of the low 4 bits


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (d * float(q - 16))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        qh = read_u32(row, o + 2)
        for j in range(16):
            byte = np.int32(row[o + _QS + j])
            low = (byte & 15) | (np.int32((qh >> j) & 1) << 4)
            high = (byte >> 4) | (np.int32((qh >> (16 + j)) & 1) << 4)
            dst[b * BLOCK_SIZE + j] = d * np.float32(low - 16)
            dst[b * BLOCK_SIZE + 16 + j] = d * np.float32(high - 16)


def _describe(builder, q, o):
    """The block at byte o of row q as one run: quants -16..15 (int16), factor d."""
    quants = builder.or_(nibble_runs(builder, q, o, _QS, 1)[0], fifth_bits(builder, q, o, 2))
    values = builder.sub(widen(builder, quants), simd.splat_const(I16, 32, 16))
    return Runs([values], simd.splat(builder, simd.load_half(builder, q, o), 1))


_block, _block_i16, _weights, _runs_i16 = run_blocks("q5_0", _describe, BLOCK_SIZE)
_X_LEVELS = x_levels(16)  # integer prefill: |x| levels for |weight integers| <= 16
_kernels = quant_driver.instance("q5_0", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q5_0 bytes [..., C // 32 * 22] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, q - 16 has rms ~9.2 for uniform random 5-bit quants.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((0, 1.0),), 9.25, scale)
