"""MXFP4: the OCP microscaling 4-bit float format, blocks of 32 weights in 17 bytes (ggml block_mxfp4).

Block layout, bytes:
    0       e    E8M0 shared exponent
    1:17    qs   4-bit E2M1 codes: weight j (j < 16) in the low nibble of byte 1 + j, weight 16 + j in its high nibble
weight = 2^(e - 128) * KVALUES[code]   (KVALUES: the E2M1 values doubled, -12..12, as ggml and gguf store them)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 17).
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import MXFP4 as _GGUF_MXFP4
from llvmlite import ir
from numba import njit

from . import quant_driver, simd, table_words
from .prefill_i16 import x_levels
from .runs import Runs, e8m0_half, e8m0_half_scalar, load_bytes, run_blocks, table_runs
from .tiles import format_api

QTYPE = GGMLQuantizationType.MXFP4
BLOCK_SIZE = 32
BLOCK_BYTES = 17
HALF_OFFSETS = ()  # no f16 fields: the scale is the E8M0 byte 0
KVALUES = np.array(_GGUF_MXFP4.kvalues, dtype=np.int8)  # [16] E2M1 values times 2


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (2^(e - 128) * float(level))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = e8m0_half_scalar(row[o])
        for j in range(16):
            byte = row[o + 1 + j]
            dst[b * BLOCK_SIZE + j] = d * np.float32(KVALUES[byte & 15])
            dst[b * BLOCK_SIZE + 16 + j] = d * np.float32(KVALUES[byte >> 4])


def _describe(builder, q, o):
    """The block at byte o of row q as one run: table levels (int16), factor 2^(e - 128)."""
    e = builder.extract_element(load_bytes(builder, q, o, 0, 1), ir.Constant(simd.I32, 0))
    return Runs(table_runs(builder, q, o, 1, 1, KVALUES), simd.splat(builder, e8m0_half(builder, e), 1))


_block, _block_i16, _weights, _runs_i16 = run_blocks("mxfp4", _describe, BLOCK_SIZE)
_words = {}  # four blocks a step, word lookups, x in their order (AVX-512 VBMI)
if table_words.AVAILABLE:
    _block_i16 = table_words.word_dot("mxfp4", BLOCK_BYTES, 1, KVALUES, table_words.e8m0_scales, _block_i16)
    _words = dict(_quantize_rows=table_words.quantize_rows_words)
_X_LEVELS = x_levels(12)  # integer prefill: |x| levels for |weight integers| <= 12
_kernels = quant_driver.instance("mxfp4", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16, **_words)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid MXFP4 bytes [..., C // 32 * 17] for a weight of shape (..., C), values of rms ~ scale.

    The doubled E2M1 levels of uniform random codes have rms ~5.85; each block's factor is the power of two
    at or below scale / 5.85, or twice that (rms of the values 0.8 to 1.6 times scale).
    """
    *lead, cols = shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"random_blocks: {cols} columns is not a multiple of {BLOCK_SIZE}")
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    blocks = rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES), dtype=np.uint8)  # [blocks, 17]
    exponent = 128 + int(np.floor(np.log2(scale / 5.85)))
    blocks[:, 0] = np.clip(exponent + rng.integers(0, 2, size=num_blocks), 2, 254)
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
