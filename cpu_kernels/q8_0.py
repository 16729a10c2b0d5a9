"""Q8_0: GGUF's 8-bit format, blocks of 32 weights in 34 bytes (ggml block_q8_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:34    qs   32 int8 quants
weight = d * q

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 34).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .prefill_i16 import x_levels
from .simd import I8, I64
from .target import int_dot_width
from .tiles import format_api, random_scales

QTYPE = GGMLQuantizationType.Q8_0
BLOCK_SIZE = 32
BLOCK_BYTES = 34
INT_DOT_WIDTH = int_dot_width()


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does (float(q) * d)."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o)
        for j in range(BLOCK_SIZE):
            dst[b * BLOCK_SIZE + j] = np.float32(np.int8(row[o + 2 + j])) * d


def _block(builder, q, o, b, xs, aux, acc):
    """acc <32 x float> += d * float(quants) * x[32b:32b + 32] for the block at byte o of row q."""
    f32x = simd.vec(simd.F32, BLOCK_SIZE)
    d = simd.load_half(builder, q, o)
    quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), simd.vec(I8, BLOCK_SIZE))
    xv = simd.load_at(builder, xs, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), f32x)
    prod = builder.fmul(builder.sitofp(quants, f32x), xv, flags=simd.FAST)
    return simd.fma(builder, prod, simd.splat(builder, d, BLOCK_SIZE), acc)


def _weights(builder, q, o):
    """The block at byte o of row q as one <32 x float>: d * float(quants)."""
    f32x = simd.vec(simd.F32, BLOCK_SIZE)
    d = simd.splat(builder, simd.load_half(builder, q, o), BLOCK_SIZE)
    quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), simd.vec(I8, BLOCK_SIZE))
    return [(0, builder.fmul(builder.sitofp(quants, f32x), d, flags=simd.FAST))]


_block.acc_type = simd.vec(simd.F32, BLOCK_SIZE)


def _runs_i16(builder, q, o):
    """The block at byte o of row q for prefill_i16's unpacking: its quants as <32 x i16>, factor d, no min."""
    quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), simd.vec(I8, BLOCK_SIZE))
    d = simd.splat(builder, simd.load_half(builder, q, o), 1)
    return [builder.sext(quants, simd.vec(simd.I16, BLOCK_SIZE))], d, None


def _block_i16(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += d * dx_b * (quants . xq[32b:32b + 32]) for the block at byte o of row q: one pmaddwd
    of the int16-widened quants with int16 x, then one int -> float conversion and FMA; aux [C/16] of (dx, sum)."""
    quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), simd.vec(I8, BLOCK_SIZE))
    xv = simd.load_at(builder, xq, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), simd.vec(simd.I16, BLOCK_SIZE))
    dots = simd.madd_i16(builder, builder.sext(quants, simd.vec(simd.I16, BLOCK_SIZE)), xv, INT_DOT_WIDTH)  # <16 x i32>
    dx = builder.load(builder.gep(aux, [builder.mul(b, ir.Constant(I64, 2))]))
    scale = builder.fmul(simd.load_half(builder, q, o), dx, flags=simd.FAST)
    return simd.fma(builder, builder.sitofp(dots, simd.vec(simd.F32, 16)), simd.splat(builder, scale, 16), acc)


_block_i16.acc_type = simd.vec(simd.F32, 16)


def _blocks_i8(builder, quants, xv, scales, acc):
    """acc <16 x float> += scales * (quants . xv) for <64 x i8> quants and int8 x of two blocks: one vpdpbusd
    of the quants biased to unsigned (q + 128, the shared 128 * x taken off), one conversion and FMA."""
    biased = builder.xor(quants, simd.splat_const(I8, 2 * BLOCK_SIZE, 0x80))
    dots = simd.dot_offset_u8i8(builder, biased, xv, 0x80)  # <16 x i32>, lanes 0-7 block b, 8-15 block b + 1
    return simd.fma(builder, builder.sitofp(dots, simd.vec(simd.F32, 16)), scales, acc)


def _block_i8(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += blocks b and b + 1 (at bytes o and o + 34 of row q) . x for int8 xq [C] and (scale dx,
    sum) pairs aux [C/16]."""
    i8x = simd.vec(I8, BLOCK_SIZE)
    quants = simd.concat(builder, *(simd.load_at(builder, q, builder.add(o, ir.Constant(I64, at)), i8x)
                                    for at in (2, BLOCK_BYTES + 2)))
    xv = simd.load_at(builder, xq, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), simd.vec(I8, 2 * BLOCK_SIZE))
    dx = simd.lanes(builder, simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 2)), simd.vec(simd.F32, 4)),
                    [0, 2])
    d = simd.load_halves(builder, q, [o, builder.add(o, ir.Constant(I64, BLOCK_BYTES))])
    scales = simd.lanes(builder, builder.fmul(d, dx, flags=simd.FAST), [0] * 8 + [1] * 8)
    return _blocks_i8(builder, quants, xv, scales, acc)


def _block_i8_tail(builder, q, o, b, xq, aux, acc):
    """_block_i8 of the row's last block b alone (odd block counts): the upper 32 lanes zero."""
    i8x = simd.vec(I8, BLOCK_SIZE)
    zeros = ir.Constant(i8x, None)
    quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 2)), i8x)
    xv = simd.load_at(builder, xq, builder.mul(b, ir.Constant(I64, BLOCK_SIZE)), i8x)
    dx = builder.load(builder.gep(aux, [builder.mul(b, ir.Constant(I64, 2))]))
    scale = builder.fmul(simd.load_half(builder, q, o), dx, flags=simd.FAST)
    return _blocks_i8(builder, simd.concat(builder, quants, zeros), simd.concat(builder, xv, zeros),
                      simd.splat(builder, scale, 16), acc)


_block_i8.acc_type, _block_i8.blocks_per_step, _block_i8.tail = simd.vec(simd.F32, 16), 2, _block_i8_tail
_X_LEVELS = x_levels(128)  # integer prefill: |x| levels for |weight integers| <= 128
_kernels = quant_driver.instance("q8_0", quant_driver.INT8_DECODE, BLOCK_BYTES, BLOCK_SIZE, _unpack_row, _X_LEVELS,
                                 _block, _block_i16, _weights, _runs_i16, _block_i8)
_rows_dot, _rows_dot_i16, _rows_dot_i8 = _kernels.rows_dot, _kernels.rows_dot_i16, _kernels.rows_dot_i8
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q8_0 bytes [..., C // 32 * 34] for a weight of shape (..., C), values of magnitude ~ scale.

    Quants are uniform in -127..127 (mean |q| ~ 64), so d ~ scale / 64.
    """
    *lead, cols = shape
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    qs = rng.integers(-127, 128, size=(num_blocks, BLOCK_SIZE), dtype=np.int8).view(np.uint8)  # [blocks, 32]
    blocks = np.concatenate([random_scales(rng, num_blocks, scale / 64), qs], axis=1)  # [blocks, 34]
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
