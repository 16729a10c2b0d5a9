"""Q4_1: GGUF's 4-bit format with a min, blocks of 32 weights in 20 bytes (ggml block_q4_1).

Block layout, bytes:
    0:2     d    f16 scale
    2:4     m    f16 min (added)
    4:20    qs   weight j (j < 16) in the low nibble of byte 4 + j, weight 16 + j in its high nibble
weight = d * q + m   (q in 0..15)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 20).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, nibble_runs, run_blocks, widen
from .simd import I64
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q4_1
BLOCK_SIZE = 32
BLOCK_BYTES = 20
HALF_OFFSETS = (0, 2)  # byte offsets of the f16 scales in a block
_QS = 4  # offset of the low 4 bits


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (d * float(q) + m)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d, m = read_half(row, o), read_half(row, o + 2)
        for j in range(16):
            byte = np.int32(row[o + _QS + j])
            dst[b * BLOCK_SIZE + j] = d * np.float32(byte & 15) + m
            dst[b * BLOCK_SIZE + 16 + j] = d * np.float32(byte >> 4) + m


def _describe(builder, q, o):
    """The block at byte o of row q as one run: quants 0..15 (int16), factor d, min -m."""
    d_m = simd.load_halves(builder, q, [o, builder.add(o, ir.Constant(I64, 2))])
    values = [widen(builder, v) for v in nibble_runs(builder, q, o, _QS, 1)]
    return Runs(values, simd.lanes(builder, d_m, [0]), builder.fneg(simd.lanes(builder, d_m, [1])))


_block, _block_i16, _weights, _runs_i16 = run_blocks("q4_1", _describe, BLOCK_SIZE)
_X_LEVELS = x_levels(15)  # integer prefill: |x| levels for |weight integers| <= 15
_kernels = quant_driver.instance("q4_1", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_1 bytes [..., C // 32 * 20] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and m = -7.5 (the mean q), q + m has mean 0 and rms ~4.6 for uniform random 4-bit quants.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((0, 1.0), (2, -7.5)), 4.61, scale)
