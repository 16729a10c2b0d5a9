"""IQ4_NL: GGUF's 4-bit non-linear format, blocks of 32 weights in 18 bytes (ggml block_iq4_nl).

Block layout, bytes:
    0:2     d    f16 scale
    2:18    qs   4-bit indices: weight j (j < 16) in the low nibble of byte 2 + j, weight 16 + j in its high nibble
weight = d * KVALUES[index]   (KVALUES: 16 int8 levels, -127..113)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 18).
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL as _GGUF_IQ4_NL
from numba import njit

from . import quant_driver, simd, table_words
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, run_blocks, table_runs
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.IQ4_NL
BLOCK_SIZE = 32
BLOCK_BYTES = 18
HALF_OFFSETS = (0,)  # byte offsets of the f16 scales in a block
KVALUES = np.array(_GGUF_IQ4_NL.kvalues, dtype=np.int8)  # [16] the non-linear levels


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (d * float(level))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for j in range(16):
            byte = row[o + 2 + j]
            dst[b * BLOCK_SIZE + j] = d * np.float32(KVALUES[byte & 15])
            dst[b * BLOCK_SIZE + 16 + j] = d * np.float32(KVALUES[byte >> 4])


def _describe(builder, q, o):
    """The block at byte o of row q as one run: table levels (int16), factor d."""
    return Runs(table_runs(builder, q, o, 2, 1, KVALUES), simd.splat(builder, simd.load_half(builder, q, o), 1))


_block, _block_i16, _weights, _runs_i16 = run_blocks("iq4_nl", _describe, BLOCK_SIZE)
_words = {}  # four blocks a step, word lookups, x in their order (AVX-512 VBMI)
if table_words.AVAILABLE:
    _block_i16 = table_words.word_dot("iq4_nl", BLOCK_BYTES, 2, KVALUES, table_words.half_scales, _block_i16)
    _words = dict(_quantize_rows=table_words.quantize_rows_words)
_X_LEVELS = x_levels(127)  # integer prefill: |x| levels for |weight integers| <= 127
_kernels = quant_driver.instance("iq4_nl", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16, **_words)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid IQ4_NL bytes [..., C // 32 * 18] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 the levels of uniform random indices have rms ~67.4.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((0, 1.0),), 67.4, scale)
