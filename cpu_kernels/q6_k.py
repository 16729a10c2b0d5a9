"""Q6_K: GGUF's 6-bit K-quant, super-blocks of 256 weights in 210 bytes (ggml block_q6_K).

Block layout, bytes (two halves h = 0, 1 of 128 weights; four runs i = 0..3 of 32 weights per half):
    0:128    low 4 bits; run i of half h is in bytes 64h + 32(i % 2) + l, low nibble for i < 2
    128:192  high 2 bits; run i of half h is bits 2i..2i+1 of byte 128 + 32h + l
    192:208  int8 scales, one per 16 weights
    208:210  d  f16, scale of the scales
weight = (d * scale_k) * q   (q in -32..31, k = weight index // 16)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 210).
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit

from . import quant_driver, simd
from .half import read_half
from .act_quant import INT16, decode_rows, quantize_rows
from .kquant import QK_K, SUB, bytes_of_rows, join_bits
from .prefill_i16 import x_levels
from .simd import F32, I8, I32, I64
from .target import int_dot_width, vnni_width
from .tiles import format_api, random_weight

QTYPE = GGMLQuantizationType.Q6_K
BLOCK_SIZE = QK_K
BLOCK_BYTES = 210
_QH = 128  # offset of the high bits in a block
_SC = 192  # offset of the scales
_D = 208  # offset of d
INT_DOT_WIDTH = int_dot_width()


@njit(inline="always", nogil=True, cache=True)
def _q6(low, low_shift, high, high_shift):
    """The quant (-32..31, as float32) whose low 4 bits are in byte `low` and high 2 bits in byte `high`."""
    return join_bits(low, low_shift, high, high_shift, 3) - np.float32(32)


@njit(inline="always", nogil=True, cache=True)
def _scale(row, offset, d):
    """d * the int8 scale at `offset`."""
    return d * np.float32(np.int8(row[offset]))


@njit(inline="always", nogil=True, cache=True)
def _dequant_block(row, b, dst):
    """Super-block b of row [B] -> dst [256], rounded exactly as gguf does."""
    o = b * BLOCK_BYTES
    d = read_half(row, o + _D)
    for j in range(8):
        low = o + 64 * (j // 4) + SUB * (j % 2)
        high = o + _QH + SUB * (j // 4)
        low_shift = 4 * ((j % 4) // 2)
        high_shift = 2 * (j % 4)
        for k in range(2):
            ds = _scale(row, o + _SC + 2 * j + k, d)
            for l in range(16 * k, 16 * k + 16):
                dst[j * SUB + l] = ds * _q6(row[low + l], low_shift, row[high + l], high_shift)


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        _dequant_block(row, b, dst[b * QK_K:(b + 1) * QK_K])


def _scales(builder, q, o):
    """The block's 16 scales times d, <16 x float>."""
    d = simd.load_half(builder, q, builder.add(o, ir.Constant(I64, _D)))
    scales = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _SC)), simd.vec(I8, 16))
    return builder.fmul(builder.sitofp(scales, simd.vec(F32, 16)), simd.splat(builder, d, 16), flags=simd.FAST)


def _quants(builder, q, o):
    """The block at byte o of row q as 8 runs of 32 quants, <32 x i8> in -32..31, each joined from its nibble and
    2 high bits; run r = 4h + i holds weights 32r .. 32r + 31 and takes scales 2r, 2r + 1."""
    i8x = simd.vec(I8, SUB)

    def const(value):
        return simd.splat_const(I8, SUB, value)

    runs = []
    for h in range(2):
        low = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 64 * h)), simd.vec(I8, 2 * SUB))
        high = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _QH + SUB * h)), i8x)
        runs_low = (simd.lanes(builder, low, range(SUB)), simd.lanes(builder, low, range(SUB, 2 * SUB)))
        for i in range(4):
            nibble = runs_low[i % 2]
            nibble = builder.and_(nibble, const(15)) if i < 2 else builder.lshr(nibble, const(4))
            top = builder.and_(builder.lshr(high, const(2 * i)), const(3))
            runs.append(builder.sub(builder.or_(nibble, builder.shl(top, const(4))), const(32)))
    return runs


def _weights(builder, q, o):
    """The block at byte o of row q as 8 <32 x float> runs: quants times a <32 x float> of the run's two scales."""
    scales = _scales(builder, q, o)
    return [(SUB * r, builder.fmul(builder.sitofp(quants, simd.vec(F32, SUB)),
                                   simd.lanes(builder, scales, [2 * r] * 16 + [2 * r + 1] * 16), flags=simd.FAST))
            for r, quants in enumerate(_quants(builder, q, o))]


def _runs_i16(builder, q, o):
    """The block at byte o of row q for prefill_i16's unpacking: 8 runs <32 x i16> of quants times their int8
    scales (|q * scale| <= 4096), factors <8 x float> of d, no mins."""
    scales = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _SC)), simd.vec(I8, 16))
    scales = builder.sext(scales, simd.vec(simd.I16, 16))
    runs = [builder.mul(builder.sext(quants, simd.vec(simd.I16, SUB)),
                        simd.lanes(builder, scales, [2 * r] * 16 + [2 * r + 1] * 16))
            for r, quants in enumerate(_quants(builder, q, o))]
    return runs, simd.splat(builder, simd.load_half(builder, q, builder.add(o, ir.Constant(I64, _D))), 8), None


def _block_i16(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += block b (at byte o of row q) . x for int16 xq [C] and (scale dx, sum) pairs aux [C/16]:
    per run, one pmaddwd of the quants with xq (lanes 0-7 hold the first 16 weights, 8-15 the next 16), converted
    and FMA'd with d * scale * dx."""
    pairs = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 16)), simd.vec(F32, 16))
    dx = simd.lanes(builder, pairs, [2 * (k // 2) for k in range(16)])  # run k // 2's dx for scale k
    factors = builder.fmul(_scales(builder, q, o), dx, flags=simd.FAST)  # [16]
    xo = builder.mul(b, ir.Constant(I64, QK_K))
    i16x = simd.vec(simd.I16, SUB)
    for r, quants in enumerate(_quants(builder, q, o)):
        xv = simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, SUB * r)), i16x)
        dots = simd.madd_i16(builder, builder.sext(quants, i16x), xv, INT_DOT_WIDTH)  # <16 x i32>
        acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)),
                       simd.lanes(builder, factors, [2 * r] * 8 + [2 * r + 1] * 8), acc)
    return acc


def _block_bytes(builder, q, o, b, xq, aux, acc):
    """_block_i16 for targets with VNNI, int16 xq [C] held as bytes (quantize_rows_bytes): per two runs (64
    weights, 4 scales) the unsigned quants (as _block_i8 unpacks them) dotted by vpdpbusd with the values' high
    bytes (signed; the shared 32 * x taken off), shifted up 8 bits, then the low bytes (unsigned) with q (signed),
    converted and FMA'd with d * scale * dx (lanes 4k..4k + 3 hold scale k's 16 weights): 64 products an
    instruction where pmaddwd makes 32, no widening of the quants."""
    dx_sums = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 16)), simd.vec(F32, 16))
    dx = simd.lanes(builder, dx_sums, [2 * (k // 2) for k in range(16)])  # run k // 2's dx for scale k
    factors = builder.fmul(_scales(builder, q, o), dx, flags=simd.FAST)  # [16]
    xb = builder.bitcast(xq, I8.as_pointer())
    base = builder.mul(b, ir.Constant(I64, 2 * QK_K))  # bytes
    i8x, eight = simd.vec(I8, 2 * SUB), simd.splat_const(I32, 16, 8)

    def const(value):
        return simd.splat_const(I8, 2 * SUB, value)

    for h in range(2):
        low = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 64 * h)), i8x)
        high = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _QH + SUB * h)), simd.vec(I8, SUB))
        high = simd.concat(builder, high, high)
        for m, nibbles in enumerate((builder.and_(low, const(15)), builder.lshr(low, const(4)))):
            top = builder.and_(simd.word_lshr(builder, high, [4 * m] * 16 + [4 * m + 2] * 16), const(3))
            quants = builder.or_(nibbles, builder.shl(top, const(4)))  # runs 4h + 2m, 4h + 2m + 1; 0..63
            at = builder.add(base, ir.Constant(I64, 128 * h + 64 * m))
            dots = simd.dot_offset_u8i8(builder, quants, simd.load_at(builder, xb, at, i8x), 32)
            x_low = simd.load_at(builder, xb, builder.add(at, ir.Constant(I64, QK_K)), i8x)
            dots = simd.dot_u8i8(builder, builder.shl(dots, eight), x_low, builder.sub(quants, const(32)))
            factor = simd.lanes(builder, factors, [8 * h + 4 * m + lane // 4 for lane in range(16)])
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), factor, acc)
    return acc


_BYTE_RUNS = np.arange(0, QK_K, SUB)  # x values of each 32-byte run of _block_bytes's: in order


@njit(nogil=True, cache=True)
def quantize_rows_bytes(x, items, act_quant):
    """act_quant.quantize_rows with each 256-value super-block's int16 values stored as _block_bytes reads them:
    their high bytes, then their low bytes (in xq int16 [N, C]'s bytes; aux f32 [N, C/16] as quantize_rows)."""
    xq, aux = quantize_rows(x, items, act_quant)
    return bytes_of_rows(xq, _BYTE_RUNS, decode_rows(x, items, act_quant == INT16)), aux


def _block_i8(builder, q, o, b, xq, aux, acc):
    """acc <16 x float> += block b (at byte o of row q) . x for int8 xq [C] and (scale dx, sum) pairs aux [C/16]:
    per two runs (64 weights, 4 scales) one 64-byte load of nibbles shared with the next two runs, the 2-bit tops
    shifted out of 16-bit words, one vpdpbusd of the unsigned quants (q + 32, the shared 32 * x taken off),
    converted and FMA'd with d * scale * dx (lanes 4k..4k + 3 hold scale k's 16 weights)."""
    dx_sums = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 16)), simd.vec(F32, 16))
    dx = simd.lanes(builder, dx_sums, [2 * (k // 2) for k in range(16)])  # run k // 2's dx for scale k
    factors = builder.fmul(_scales(builder, q, o), dx, flags=simd.FAST)  # [16]
    xo = builder.mul(b, ir.Constant(I64, QK_K))
    i8x = simd.vec(I8, 2 * SUB)

    def const(value):
        return simd.splat_const(I8, 2 * SUB, value)

    for h in range(2):
        low = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 64 * h)), i8x)
        high = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _QH + SUB * h)), simd.vec(I8, SUB))
        high = simd.concat(builder, high, high)
        for m, nibbles in enumerate((builder.and_(low, const(15)), builder.lshr(low, const(4)))):
            top = builder.and_(simd.word_lshr(builder, high, [4 * m] * 16 + [4 * m + 2] * 16), const(3))
            quants = builder.or_(nibbles, builder.shl(top, const(4)))  # runs 4h + 2m, 4h + 2m + 1; 0..63
            xv = simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, 128 * h + 64 * m)), i8x)
            dots = simd.dot_offset_u8i8(builder, quants, xv, 32)  # <16 x i32>
            factor = simd.lanes(builder, factors, [8 * h + 4 * m + lane // 4 for lane in range(16)])
            acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), factor, acc)
    return acc


def _block(builder, q, o, b, xs, aux, acc):
    """acc <32 x float> += block b (at byte o of row q) . x, one FMA per run of 32 weights."""
    xo = builder.mul(b, ir.Constant(I64, QK_K))
    for offset, weights in _weights(builder, q, o):
        xv = simd.load_at(builder, xs, builder.add(xo, ir.Constant(I64, offset)), simd.vec(F32, SUB))
        acc = simd.fma(builder, weights, xv, acc)
    return acc


_block.acc_type = simd.vec(F32, SUB)
_block_i16.acc_type = _block_i8.acc_type = _block_bytes.acc_type = simd.vec(F32, 16)
_BYTES = vnni_width() > 0  # int16 x as bytes for vpdpbusd (_block_bytes), else as words (_block_i16)
_X_LEVELS = x_levels(32 * 128)  # integer prefill: |x| levels for |weight integers| <= 32 * 128
_kernels = quant_driver.instance("q6_k", quant_driver.INT8_DECODE, BLOCK_BYTES, QK_K, _unpack_row, _X_LEVELS,
                                 _block, _block_bytes if _BYTES else _block_i16, _weights, _runs_i16, _block_i8,
                                 _quantize_rows=quantize_rows_bytes if _BYTES else quantize_rows)
_rows_dot, _rows_dot_i16, _rows_dot_i8 = _kernels.rows_dot, _kernels.rows_dot_i16, _kernels.rows_dot_i8
_prepare, _run_item, _moe_matmul = _kernels.prepare, _kernels.run_item, _kernels.moe_matmul

dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _kernels.dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q6_K bytes [..., C // 256 * 210] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, scale_k * q has rms ~1366 (74 * 18.5) for uniform random int8 scales and 6-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((_D, 1.0),), 1366.0, scale)

