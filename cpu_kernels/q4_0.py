"""Q4_0: GGUF's 4-bit format, blocks of 32 weights in 18 bytes (ggml block_q4_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:18    qs   16 bytes: weight j (j < 16) in the low nibble of byte j, weight 16 + j in its high nibble
weight = d * (q - 8)   (q in 0..15)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 18).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .simd import F32, I8, I16, I32, I64
from .target import int_dot_width
from .tiles import format_api, random_scales

QTYPE = GGMLQuantizationType.Q4_0
BLOCK_SIZE = 32
BLOCK_BYTES = 18
INT_DOT_WIDTH = int_dot_width()


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (d * float(q - 8))."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        xo = b * BLOCK_SIZE
        d = read_half(row, o)
        for j in range(BLOCK_SIZE // 2):
            q = row[o + 2 + j]
            dst[xo + j] = d * np.float32(np.int32(q & 15) - 8)
            dst[xo + 16 + j] = d * np.float32(np.int32(q >> 4) - 8)


def _quants(builder, q, o):
    """The 32 quants of the block at byte o of row q, centered: <32 x i8> in -8..7, weights 0-15 then 16-31."""
    packed = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), simd.vec(I8, 16))
    low = builder.and_(packed, simd.splat_const(I8, 16, 15))
    high = builder.lshr(packed, simd.splat_const(I8, 16, 4))
    both = builder.shuffle_vector(low, high, simd.const_vec(I32, range(BLOCK_SIZE)))
    return builder.sub(both, simd.splat_const(I8, BLOCK_SIZE, 8))


def _weights(builder, q, o):
    """The block at byte o of row q as one <32 x float>: d * (q - 8)."""
    d = simd.splat(builder, simd.load_half(builder, q, o), BLOCK_SIZE)
    return [(0, builder.fmul(builder.sitofp(_quants(builder, q, o), simd.vec(F32, BLOCK_SIZE)), d, flags=simd.FAST))]


def _runs_i16(builder, q, o):
    """The block at byte o of row q for prefill_i16's unpacking: q - 8 as <32 x i16>, factor d, no min."""
    return [builder.sext(_quants(builder, q, o), simd.vec(I16, BLOCK_SIZE))], \
        simd.splat(builder, simd.load_half(builder, q, o), 1), None


def _block(builder, q, o, b, xs, aux, acc):
    """acc <32 x float> += d * float(q - 8) * x[32b:32b + 32] for the block at byte o of row q."""
    f32x = simd.vec(F32, BLOCK_SIZE)
    xv = simd.load_at(builder, xs, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), f32x)
    prod = builder.fmul(builder.sitofp(_quants(builder, q, o), f32x), xv, flags=simd.FAST)
    return simd.fma(builder, prod, simd.splat(builder, simd.load_half(builder, q, o), BLOCK_SIZE), acc)


def _block_i16(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += d * dx_b * ((q - 8) . xq[32b:32b + 32]): one pmaddwd, one conversion and FMA;
    aux [C/16] of (dx, sum) pairs."""
    i16x = simd.vec(I16, BLOCK_SIZE)
    xv = simd.load_at(builder, xq, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), i16x)
    dots = simd.madd_i16(builder, builder.sext(_quants(builder, q, o), i16x), xv, INT_DOT_WIDTH)  # <16 x i32>
    dx = builder.load(builder.gep(aux, [builder.mul(b, ir.Constant(I64, 2))]))
    scale = builder.fmul(simd.load_half(builder, q, o), dx, flags=simd.FAST)
    return simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), simd.splat(builder, scale, 16), acc)


_block.acc_type, _block_i16.acc_type = simd.vec(F32, BLOCK_SIZE), simd.vec(F32, 16)
_X_LEVELS = x_levels(8)  # integer prefill: |x| levels for |weight integers| <= 8
_kernels = quant_driver.instance("q4_0", quant_driver.INT16_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16)
_rows_dot, _rows_dot_i16 = _kernels.rows_dot, _kernels.rows_dot_i16
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_0 bytes [..., C // 32 * 18] for a weight of shape (..., C), values of magnitude ~ scale.

    q - 8 is uniform in -8..7 (mean |q - 8| = 4), so d ~ scale / 4.
    """
    *lead, cols = shape
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    qs = rng.integers(0, 256, size=(num_blocks, BLOCK_SIZE // 2), dtype=np.uint8)  # [blocks, 16]
    blocks = np.concatenate([random_scales(rng, num_blocks, scale / 4), qs], axis=1)  # [blocks, 18]
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
