"""Q2_K: GGUF's 2-bit K-quant, super-blocks of 256 weights in 84 bytes (ggml block_q2_K).

Block layout, bytes:
    0:16    scales  one byte per 16 weights: scale in the low nibble, min in the high nibble
    16:80   qs      2-bit quants: weight 128h + 32s + l in bits 2s..2s + 1 of byte 16 + 32h + l
    80:82   d       f16 scale of the scales
    82:84   dmin    f16 scale of the mins
weight = (d * scale_k) * q - dmin * min_k   (q in 0..3, k = weight index // 16)

The mins change every 16 weights, which the integer prefill (one min per 32 columns) cannot take: Q2_K's
prefill multiplies in float; its int16 decode dot takes the mins from x's integer sums per 16 values.

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 84).
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .runs import Runs, crumb_runs, load_bytes, offset, run_blocks, widen
from .simd import F32, I16
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q2_K
BLOCK_SIZE = 256
BLOCK_BYTES = 84
HALF_OFFSETS = (80, 82)  # byte offsets of the f16 scales in a block
_QS = 16  # offset of the quants
_D = 80  # offset of d (dmin follows)


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * scale) * q - dmin * min)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d, dmin = read_half(row, o + _D), read_half(row, o + _D + 2)
        for k in range(16):
            dl = d * np.float32(row[o + k] & 15)
            ml = dmin * np.float32(row[o + k] >> 4)
            t = k // 2  # run of 32: bits 2(t % 4) of bytes 32(t // 4)..
            for l in range(16 * (k % 2), 16 * (k % 2) + 16):
                q = (row[o + _QS + 32 * (t // 4) + l] >> (2 * (t % 4))) & 3
                dst[b * BLOCK_SIZE + 32 * t + l] = dl * np.float32(q) - ml


def abs_parts(raw):
    """|d * scale * q| + |dmin * min| per weight, float64 [..., C]: what the int16 dot's rounding of x is
    multiplied with (the scaled quants and the mins take the rounded x apart)."""
    blocks = raw.reshape(-1, BLOCK_BYTES)
    d = blocks[:, _D:_D + 2].copy().view(np.float16).astype(np.float64)  # [blocks, 1]
    dmin = blocks[:, _D + 2:_D + 4].copy().view(np.float16).astype(np.float64)
    scales, mins = (blocks[:, :16] & 15).astype(np.float64), (blocks[:, :16] >> 4).astype(np.float64)  # [blocks, 16]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((blocks[:, _QS:_D].reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16).astype(np.float64)
    parts = np.abs(d[:, :, None] * scales[:, :, None] * q) + np.abs(dmin[:, :, None] * mins[:, :, None])
    return parts.reshape(*raw.shape[:-1], raw.shape[-1] // BLOCK_BYTES * BLOCK_SIZE)


def _describe(builder, q, o):
    """The block at byte o of row q as 8 runs of q * scale_k (<= 45, int16), factors d, and group mins
    dmin * min_k."""
    packed = builder.zext(load_bytes(builder, q, o, 0, 16), simd.vec(I16, 16))
    scales = builder.and_(packed, simd.splat_const(I16, 16, 15))
    mins = builder.lshr(packed, simd.splat_const(I16, 16, 4))
    values = [builder.mul(widen(builder, quants), simd.lanes(builder, scales, [2 * t] * 16 + [2 * t + 1] * 16))
              for t, quants in enumerate(crumb_runs(builder, q, o, _QS, 8))]
    d = simd.load_half(builder, q, offset(builder, o, _D))
    dmin = simd.load_half(builder, q, offset(builder, o, _D + 2))
    group_mins = builder.fmul(builder.uitofp(mins, simd.vec(F32, 16)), simd.splat(builder, dmin, 16), flags=simd.FAST)
    return Runs(values, simd.splat(builder, d, 8), None, group_mins)


_block, _block_i16, _weights, _runs_i16 = run_blocks("q2_k", _describe, BLOCK_SIZE)
_X_LEVELS = x_levels(45)  # (unused: float prefill)
_kernels = quant_driver.instance("q2_k", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16, int_prefill=False)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q2_K bytes [..., C // 256 * 84] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 1.5 (mean scale * q = 7.5 * 1.5 = 1.5 * mean min), scale * q - 1.5 * min has mean 0
    and rms ~15 for uniform random 4-bit scales and mins and 2-bit quants.
    """
    return random_weight(rng, shape, BLOCK_SIZE, BLOCK_BYTES, ((_D, 1.0), (_D + 2, 1.5)), 15.1, scale)
