"""Q6_K: GGUF's 6-bit K-quant, super-blocks of 256 weights in 210 bytes (ggml block_q6_K).

Block layout, bytes (two halves h = 0, 1 of 128 weights; four runs i = 0..3 of 32 weights per half):
    0:128    low 4 bits; run i of half h is in bytes 64h + 32(i % 2) + l, low nibble for i < 2
    128:192  high 2 bits; run i of half h is bits 2i..2i+1 of byte 128 + 32h + l
    192:208  int8 scales, one per 16 weights
    208:210  d  f16, scale of the scales
weight = (d * scale_k) * q   (q in -32..31, k = weight index // 16)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 210), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange

from . import simd
from .half import read_half
from .kquant import QK_K, SUB, join_bits
from .simd import F32, I8, I64
from .tiles import ROWS_PER_ITEM, format_api, random_weight, work_items

QTYPE = GGMLQuantizationType.Q6_K
BLOCK_SIZE = QK_K
BLOCK_BYTES = 210
_QH = 128  # offset of the high bits in a block
_SC = 192  # offset of the scales
_D = 208  # offset of d


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


def _block(builder, q, o, b, xs, aux, acc):
    """acc <32 x float> += block b (at byte o of row q) . x: per run of 32 weights, the 6-bit quants
    joined from their nibble and 2 high bits, centered, times a <32 x float> of its two scales, FMA with x."""
    f32x, i8x = simd.vec(F32, SUB), simd.vec(I8, SUB)

    def const(value):
        return simd.splat_const(I8, SUB, value)

    def at(offset):
        return builder.add(o, ir.Constant(I64, offset))

    d = simd.load_half(builder, q, at(_D))
    scales = simd.load_at(builder, q, at(_SC), simd.vec(I8, 16))
    scales = builder.fmul(builder.sitofp(scales, simd.vec(F32, 16)), simd.splat(builder, d, 16), flags=simd.FAST)
    xo = builder.mul(b, ir.Constant(I64, QK_K))
    for h in range(2):
        low = simd.load_at(builder, q, at(64 * h), simd.vec(I8, 2 * SUB))
        high = simd.load_at(builder, q, at(_QH + SUB * h), i8x)
        runs_low = (simd.lanes(builder, low, range(SUB)), simd.lanes(builder, low, range(SUB, 2 * SUB)))
        for i in range(4):
            nibble = runs_low[i % 2]
            nibble = builder.and_(nibble, const(15)) if i < 2 else builder.lshr(nibble, const(4))
            top = builder.and_(builder.lshr(high, const(2 * i)), const(3))
            quants = builder.sub(builder.or_(nibble, builder.shl(top, const(4))), const(32))  # -32..31
            run_scales = simd.lanes(builder, scales, [8 * h + 2 * i] * 16 + [8 * h + 2 * i + 1] * 16)
            weights = builder.fmul(builder.sitofp(quants, f32x), run_scales, flags=simd.FAST)
            xv = simd.load_at(builder, xs, builder.add(xo, ir.Constant(I64, 128 * h + SUB * i)), f32x)
            acc = simd.fma(builder, weights, xv, acc)
    return acc


_block.acc_type = simd.vec(F32, SUB)
_dot_rows = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, 1)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]."""
    r = r0
    while r + simd.ROWS_IN_FLIGHT <= r1:
        _dot_rows(w, r, x, x, out)
        r += simd.ROWS_IN_FLIGHT
    for rr in range(r, r1):
        _dot_row(w, rr, x, x, out)


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, out, r0, t0, t1):
    """out[t0:t1, r0:r0 + 16] = x[t0:t1] @ W[r0:r0 + 16].T for one expert's w [R, B]."""
    r1 = min(r0 + ROWS_PER_ITEM, w.shape[0])
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], out[t0])
        return
    acc = np.zeros((r1 - r0, t1 - t0), dtype=np.float32)  # [rows, tokens]
    buf = np.empty(QK_K, dtype=np.float32)  # one dequantized super-block, reused by every token
    for b in range(w.shape[1] // BLOCK_BYTES):
        xo = b * QK_K
        for r in range(r0, r1):
            _dequant_block(w[r], b, buf)
            for t in range(t0, t1):
                s = np.float32(0)
                for l in range(QK_K):
                    s += buf[l] * x[t, xo + l]
                acc[r - r0, t - t0] += s
    for t in range(t0, t1):
        for r in range(r0, r1):
            out[t, r] = acc[r - r0, t - t0]


@njit(parallel=True, nogil=True, cache=True)
def _dequantize(raw, out):
    for r in prange(raw.shape[0]):
        for b in range(raw.shape[1] // BLOCK_BYTES):
            _dequant_block(raw[r], b, out[r, b * QK_K:(b + 1) * QK_K])


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _moe_matmul(raws, x, expert_ids, row_starts, outs):
    """outs[k][rows of group g] = x[same rows] @ raws[k][expert_ids[g]].T for each weight k (one parallel region)."""
    items = work_items(expert_ids, row_starts, raws[0].shape[0], raws[0].shape[1])  # [W, 4]
    num_items = items.shape[0]
    for i in prange(num_items * len(raws)):
        k, j = i // num_items, i % num_items
        _tile(raws[k][items[j, 0]], x, outs[k], items[j, 1], items[j, 2], items[j, 3])


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q6_K bytes [..., C // 256 * 210] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, scale_k * q has rms ~1366 (74 * 18.5) for uniform random int8 scales and 6-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((_D, 1.0),), 1366.0, scale)

