"""TQ2_0: GGUF's 2-bit ternary format, super-blocks of 256 weights in 66 bytes (ggml block_tq2_0).

Block layout, bytes:
    0:64    qs   2-bit quants: weight 128h + 32s + l in bits 2s..2s + 1 of byte 32h + l
    64:66   d    f16 scale
weight = d * (q - 1)   (q in 0..2; 3 decodes as 2, as in gguf)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 66).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, crumb_runs, offset, run_blocks, widen
from .simd import I8
from .tiles import format_api

QTYPE = GGMLQuantizationType.TQ2_0
BLOCK_SIZE = 256
BLOCK_BYTES = 66
HALF_OFFSETS = (64,)  # byte offsets of the f16 scales in a block
_D = 64  # offset of d


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (d * float(q - 1))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o + _D)
        for t in range(8):
            for l in range(32):
                q = (np.int32(row[o + 32 * (t // 4) + l]) >> (2 * (t % 4))) & 3
                dst[b * BLOCK_SIZE + 32 * t + l] = d * np.float32(q - 1)


def _describe(builder, q, o):
    """The block at byte o of row q as 8 runs of q - 1 (int16), factors d."""
    values = [widen(builder, builder.sub(quants, simd.splat_const(I8, 32, 1)))
              for quants in crumb_runs(builder, q, o, 0, 8)]
    return Runs(values, simd.splat(builder, simd.load_half(builder, q, offset(builder, o, _D)), 8))


_block, _block_i16, _weights, _runs_i16 = run_blocks("tq2_0", _describe, BLOCK_SIZE)
_X_LEVELS = x_levels(2)  # integer prefill: |x| levels for |weight integers| <= 2
_kernels = quant_driver.instance("tq2_0", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid TQ2_0 bytes [..., C // 256 * 66] for a weight of shape (..., C), values of rms ~ scale:
    ternary quants (0..2, uniform; rms of q - 1 ~0.82) and d = scale / 0.82 times 0.5..1.5."""
    *lead, cols = shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"random_blocks: {cols} columns is not a multiple of {BLOCK_SIZE}")
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    crumbs = rng.integers(0, 3, size=(num_blocks, _D, 4), dtype=np.uint8)  # [blocks, 64, 4]
    qs = crumbs[..., 0] | (crumbs[..., 1] << 2) | (crumbs[..., 2] << 4) | (crumbs[..., 3] << 6)
    d = (scale / 0.82 * rng.uniform(0.5, 1.5, size=num_blocks)).astype(np.float16)
    blocks = np.concatenate([qs, d.view(np.uint8).reshape(num_blocks, 2)], axis=1)  # [blocks, 66]
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
