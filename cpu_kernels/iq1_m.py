"""IQ1_M: GGUF's 1.75-bit lattice format, super-blocks of 256 weights in 56 bytes (ggml block_iq1_m).

Block layout, bytes:
    0:32     qs      low 8 bits of 32 grid indices, one per 8 weights (iq1s_grid, 2048 rows of 8 values -1, 0, 1)
    32:48    qh      a nibble per grid index e (byte e // 2, low nibble first): bits 0..2 the index's high 3 bits,
                     bit 3 the sign of its delta
    48:56    4 u16   bits 3l..3l + 2 of word m: the scale s of weights 16 (4m + l) ..; bits 12..15 of word m: bits
                     4m..4m + 3 of d (f16)
weight = d * (2s + 1) * (iq1s_grid[index][k % 8] + delta),  delta = +-1/8

The kernels take the weight as d / 8 * (2s + 1) * (8 grid +- 1): integers -9..9 times an odd scale.

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 56).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import iq_blocks, iq_grids, simd
from .half import half_bits_to_f32
from .iq_blocks import at, grid_rows, odd
from .kquant import QK_K
from .simd import F32, I8, I16, I32
from .tiles import format_api

QTYPE = GGMLQuantizationType.IQ1_M
BLOCK_SIZE = QK_K
BLOCK_BYTES = 56
_QH, _SCALES = 32, 48
_GRID = iq_grids.IQ1  # [2048, 8]
_GRID8 = (8 * _GRID).astype(np.int8)  # [2048, 8]: -8, 0, 8
_DELTA = np.float32(0.125)
_WEIGHT_MAX = 9 * 15  # |(8 grid +- 1) * (2s + 1)|


@njit(inline="always", nogil=True, cache=True)
def _scale_word(row, at_word):
    return np.int64(row[at_word]) | np.int64(row[at_word + 1]) << 8


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does ((d * (2s + 1)) * (grid + delta))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        bits = 0
        for m in range(4):
            bits |= ((_scale_word(row, o + _SCALES + 2 * m) >> 12) & 15) << (4 * m)
        d = half_bits_to_f32(bits)
        for e in range(32):
            nibble = (np.int64(row[o + _QH + e // 2]) >> (4 * (e % 2))) & 15
            index = np.int64(row[o + e]) | (nibble & 7) << 8
            delta = -_DELTA if nibble & 8 else _DELTA
            k = e // 2  # the scale's number
            dl = d * np.float32(2 * ((_scale_word(row, o + _SCALES + 2 * (k // 4)) >> (3 * (k % 4))) & 7) + 1)
            for m in range(8):
                dst[b * QK_K + 8 * e + m] = dl * (np.float32(_GRID[index, m]) + delta)


def _runs(builder, q, o):
    """The 8 runs of 32 values 8 grid +- 1 (-9..9) of the block at byte o of row q."""
    out = []
    for r in range(8):
        high = simd.load_at(builder, q, at(builder, o, _QH + 2 * r), simd.vec(I8, 2))
        nibbles = builder.and_(builder.lshr(simd.lanes(builder, high, [0, 0, 1, 1]), simd.const_vec(I8, [0, 4, 0, 4])),
                               simd.splat_const(I8, 4, 15))  # <4 x i8>, one per grid index
        low = builder.zext(simd.load_at(builder, q, at(builder, o, 4 * r), simd.vec(I8, 4)), simd.vec(I32, 4))
        bits = builder.zext(builder.and_(nibbles, simd.splat_const(I8, 4, 7)), simd.vec(I32, 4))
        values = grid_rows(builder, "strata_iq1_grid8", _GRID8, builder.or_(low, builder.shl(
            bits, simd.splat_const(I32, 4, 8))))  # <32 x i8>
        negative = builder.icmp_unsigned("!=", builder.and_(nibbles, simd.splat_const(I8, 4, 8)),
                                         ir.Constant(simd.vec(I8, 4), None))
        deltas = builder.select(negative, simd.splat_const(I8, 4, -1), simd.splat_const(I8, 4, 1))
        out.append(builder.add(values, simd.lanes(builder, deltas, [k // 8 for k in range(32)])))
    return out


def _int_scales(builder, q, o):
    """<16 x i8> of 2s + 1 per 16 weights."""
    words = simd.load_at(builder, q, at(builder, o, _SCALES), simd.vec(I16, 4))
    spread = builder.lshr(simd.lanes(builder, words, [k // 4 for k in range(16)]),
                          simd.const_vec(I16, [3 * (k % 4) for k in range(16)]))
    return odd(builder, builder.trunc(builder.and_(spread, simd.splat_const(I16, 16, 7)), simd.vec(I8, 16)))


def _base(builder, q, o):
    """d / 8, d gathered from the top nibbles of the scale words."""
    words = simd.load_at(builder, q, at(builder, o, _SCALES), simd.vec(I16, 4))
    parts = builder.lshr(builder.and_(words, simd.splat_const(I16, 4, 0xF000)), simd.const_vec(I16, [12, 8, 4, 0]))
    bits = builder.extract_element(parts, ir.Constant(I32, 0))
    for m in range(1, 4):
        bits = builder.or_(bits, builder.extract_element(parts, ir.Constant(I32, m)))
    return builder.fmul(simd.half_to_f32(builder, bits), ir.Constant(F32, 0.125), flags=simd.FAST)


_kernels = iq_blocks.instance("iq1_m", BLOCK_BYTES, _unpack_row, _runs, _int_scales, _base, _WEIGHT_MAX)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul
_X_LEVELS = iq_blocks.x_levels(_WEIGHT_MAX)

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def set_d(blocks, d):
    """Write the f16 scales d [n] into the scale words' top nibbles of blocks uint8 [n, 56]."""
    bits = np.asarray(d, dtype=np.float16).view(np.uint16).astype(np.int64)
    words = blocks[:, _SCALES:].view("<u2").astype(np.int64) & 0x0FFF  # [n, 4]
    words |= ((bits[:, None] >> (4 * np.arange(4))) & 15) << 12
    blocks[:, _SCALES:] = words.astype("<u2").view(np.uint8)


def random_blocks(rng, shape, scale):
    """Random valid IQ1_M bytes [..., C // 256 * 56] for a weight of shape (..., C), values of rms ~ scale."""
    *lead, cols = shape
    if cols % QK_K:
        raise ValueError(f"random_blocks: {cols} columns is not a multiple of {QK_K}")
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // QK_K)
    blocks = rng.integers(0, 256, size=(num_blocks, BLOCK_BYTES), dtype=np.uint8)
    set_d(blocks, scale / 7.3 * rng.uniform(0.5, 1.5, size=num_blocks))
    return blocks.reshape(*lead, cols // QK_K * BLOCK_BYTES)
