"""Q3_K: GGUF's 3-bit K-quant, super-blocks of 256 weights in 110 bytes (ggml block_q3_K).

Block layout, bytes:
    0:32     hmask   bit t of byte l: the high bit of weight 32t + l (set: q = low bits, clear: low bits - 4)
    32:96    qs      low 2 bits: weight 128h + 32s + l in bits 2s..2s + 1 of byte 32 + 32h + l
    96:108   scales  16 6-bit scales, minus 32: scale k's low 4 bits in byte k % 8 (high nibble for k >= 8),
                     its top 2 bits in bits 2(k // 4).. of byte 8 + k % 4
    108:110  d       f16 scale of the scales
weight = (d * (scale_k - 32)) * q   (q in -4..3, k = weight index // 16)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 110).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, crumb_runs, load_bytes, offset, run_blocks, widen
from .simd import I8, I16
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q3_K
BLOCK_SIZE = 256
BLOCK_BYTES = 110
HALF_OFFSETS = (108,)  # byte offsets of the f16 scales in a block
_QS = 32  # offset of the low bits
_SC = 96  # offset of the scales
_D = 108  # offset of d


@njit(inline="always", nogil=True, cache=True)
def _scale(row, o, k):
    """Scale k (0-15) of the block at byte o, -32..31."""
    low = (np.int32(row[o + _SC + k % 8]) >> (4 * (k // 8))) & 15
    high = (np.int32(row[o + _SC + 8 + k % 4]) >> (2 * (k // 4))) & 3
    return (low | (high << 4)) - 32


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * float(scale)) * float(q))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o + _D)
        for t in range(8):  # runs of 32 weights
            h, s = t // 4, t % 4
            for half in range(2):
                dl = d * np.float32(_scale(row, o, 2 * t + half))
                for l in range(16 * half, 16 * half + 16):
                    low = (np.int32(row[o + _QS + 32 * h + l]) >> (2 * s)) & 3
                    high = (np.int32(row[o + l]) >> t) & 1
                    dst[b * BLOCK_SIZE + 32 * t + l] = dl * np.float32(low - 4 * (1 - high))


def _scales(builder, q, o):
    """The 16 scales of the block at byte o, <16 x i16> in -32..31."""
    raw = builder.zext(load_bytes(builder, q, o, _SC - 2, 16), simd.vec(I16, 16))  # bytes 94..109: in the block
    low = builder.lshr(simd.lanes(builder, raw, [2 + k % 8 for k in range(16)]),
                       simd.const_vec(I16, [4 * (k // 8) for k in range(16)]))
    high = builder.lshr(simd.lanes(builder, raw, [10 + k % 4 for k in range(16)]),
                        simd.const_vec(I16, [2 * (k // 4) for k in range(16)]))
    scales = builder.or_(builder.and_(low, simd.splat_const(I16, 16, 15)),
                         builder.shl(builder.and_(high, simd.splat_const(I16, 16, 3)), simd.splat_const(I16, 16, 4)))
    return builder.sub(scales, simd.splat_const(I16, 16, 32))


def _describe(builder, q, o):
    """The block at byte o of row q as 8 runs of q * scale_k (|.| <= 128, int16), factors d."""
    scales = _scales(builder, q, o)
    hmask = load_bytes(builder, q, o, 0, 32)
    values = []
    for t, low in enumerate(crumb_runs(builder, q, o, _QS, 8)):
        high = builder.and_(builder.lshr(hmask, simd.splat_const(I8, 32, t)), simd.splat_const(I8, 32, 1))
        quants = builder.sub(builder.or_(low, builder.shl(high, simd.splat_const(I8, 32, 2))),
                             simd.splat_const(I8, 32, 4))  # -4..3
        values.append(builder.mul(widen(builder, quants), simd.lanes(builder, scales, [2 * t] * 16 + [2 * t + 1] * 16)))
    d = simd.load_half(builder, q, offset(builder, o, _D))
    return Runs(values, simd.splat(builder, d, 8))


_block, _block_i16, _weights, _runs_i16 = run_blocks("q3_k", _describe, BLOCK_SIZE)
_X_LEVELS = x_levels(128)  # integer prefill: |x| levels for |weight integers| <= 4 * 32
_kernels = quant_driver.instance("q3_k", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q3_K bytes [..., C // 256 * 110] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, (scale_k - 32) * q has rms ~43 (18.5 * 2.35) for uniform random 6-bit scales and 3-bit quants.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((_D, 1.0),), 43.4, scale)
