"""Q4_K: GGUF's 4-bit K-quant, super-blocks of 256 weights in 144 bytes (ggml block_q4_K).

Block layout, bytes:
    0:2     d      f16, scale of the sub-block scales
    2:4     dmin   f16, scale of the sub-block mins
    4:16    8 packed 6-bit (scale, min) pairs, one per sub-block of 32 weights (kquant.scale_min)
    16:144  4-bit quants; bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p+1 (high nibbles)
weight = (d * scale_j) * q - dmin * min_j   (q in 0..15, sub-block j)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 144).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import quant_driver
from .act_quant import INT16, NIBBLE_ORDER, QBLOCK, decode_rows, quantize_rows, quantize_rows_split
from .kquant import (QK_K, SUB, bytes_of_rows, digit_block_i16, integer_runs, split_block_i16, sub_block_pairs,
                     sub_block_quants, sub_scales, ubits, vector_blocks)
from .prefill_i16 import x_levels
from .target import vnni_width
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q4_K
BLOCK_SIZE = QK_K
BLOCK_BYTES = 144
_QS = 16  # offset of the quants in a block


@njit(inline="always", nogil=True, cache=True)
def _dequant_block(row, b, dst):
    """Super-block b of row [B] -> dst [256], rounded exactly as gguf does."""
    o = b * BLOCK_BYTES
    for j in range(8):
        ds, dm = sub_scales(row, o, j)
        qo = o + _QS + (j // 2) * SUB
        shift = 4 * (j % 2)
        for l in range(SUB):
            dst[j * SUB + l] = ds * ubits(row[qo + l], shift, 15) - dm


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        _dequant_block(row, b, dst[b * QK_K:(b + 1) * QK_K])


_block, _, _block_i8, _weights = vector_blocks("q4_k", sub_block_quants(_QS), sub_block_pairs(_QS))


_DIGIT_RUNS = np.ascontiguousarray(QBLOCK * NIBBLE_ORDER)  # x values of each 32-byte run of digit_block_i16's


@njit(nogil=True, cache=True)
def quantize_rows_digits(x, items, act_quant):
    """act_quant.quantize_rows with each 256-value super-block's int16 values stored as kquant.digit_block_i16
    reads them: their high bytes, then their low bytes, each in NIBBLE_ORDER (in xq int16 [N, C]'s bytes; aux
    f32 [N, C/16] stays in column order)."""
    xq, aux = quantize_rows(x, items, act_quant)
    return bytes_of_rows(xq, _DIGIT_RUNS, decode_rows(x, items, act_quant == INT16)), aux


_DIGITS = vnni_width() > 0  # int16 x as bytes for vpdpbusd (digit_block_i16), else as words (split_block_i16)
_block_i16 = digit_block_i16(_QS) if _DIGITS else split_block_i16(_QS)
_runs_i16 = integer_runs("q4_k", sub_block_quants(_QS))
_X_LEVELS = x_levels(15 * 63)  # integer prefill: |x| levels for |weight integers| <= 15 * 63
_kernels = quant_driver.instance("q4_k", quant_driver.SUMS_DECODE, BLOCK_BYTES, QK_K, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16, _block_i8,
                                 _quantize_rows=quantize_rows_digits if _DIGITS else quantize_rows_split)
_rows_dot, _rows_dot_i16, _rows_dot_i8 = _kernels.rows_dot, _kernels.rows_dot_i16, _kernels.rows_dot_i8
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_K bytes [..., C // 256 * 144] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 7.5 (the mean q), scale_j * q - min_j has mean 0 and rms ~258 for
    uniform random 6-bit scales and mins and 4-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((0, 1.0), (2, 7.5)), 258.0, scale)

