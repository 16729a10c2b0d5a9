"""Q4_K: GGUF's 4-bit K-quant, super-blocks of 256 weights in 144 bytes (ggml block_q4_K).

Block layout, bytes:
    0:2     d      f16, scale of the sub-block scales
    2:4     dmin   f16, scale of the sub-block mins
    4:16    8 packed 6-bit (scale, min) pairs, one per sub-block of 32 weights (kquant.scale_min)
    16:144  4-bit quants; bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p+1 (high nibbles)
weight = (d * scale_j) * q - dmin * min_j   (q in 0..15, sub-block j)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 144), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange

from . import simd
from .kquant import QK_K, SUB, sub_scales, ubits
from .simd import F32, I8, I32, I64
from .tiles import ROWS_PER_ITEM, format_api, random_weight, sub_block_sums, work_items

QTYPE = GGMLQuantizationType.Q4_K
BLOCK_SIZE = QK_K
BLOCK_BYTES = 144
_QS = 16  # offset of the quants in a block


@njit(inline="always", nogil=True, cache=True)
def _dequant_block(row, b, dst):
    """Super-block b of row [B] -> dst [256], rounded exactly as gguf does."""
    o = b * BLOCK_BYTES
    for j in range(8):
        ds, dm = sub_scales(row, o, j)
        qo = o + _QS + (j // 2) * SUB
        shift = 4 * (j % 2)
        for l in range(SUB):
            dst[j * SUB + l] = ds * ubits(row[qo + l], shift, 15) - dm


def _scales_mins(builder, q, o):
    """The 8 sub-block (scale, min) 6-bit pairs of the block at byte o, unpacked as two <8 x i8> (kquant.scale_min)."""
    packed = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, 4)), simd.vec(I8, 16))  # bytes 4..19
    low6 = simd.const_vec(I8, [63] * 4 + [15] * 4)
    top2 = simd.const_vec(I8, [0] * 4 + [0x30] * 4)

    def six_bits(low_lanes, low_shift, top_lanes):
        low = builder.and_(builder.lshr(simd.lanes(builder, packed, low_lanes), simd.const_vec(I8, low_shift)), low6)
        top = builder.shl(builder.lshr(simd.lanes(builder, packed, top_lanes), simd.splat_const(I8, 8, 6)),
                          simd.splat_const(I8, 8, 4))
        return builder.or_(low, builder.and_(top, top2))

    scales = six_bits([0, 1, 2, 3, 8, 9, 10, 11], [0] * 8, [0, 1, 2, 3, 0, 1, 2, 3])
    mins = six_bits([4, 5, 6, 7, 8, 9, 10, 11], [0] * 4 + [4] * 4, [4, 5, 6, 7, 4, 5, 6, 7])
    return scales, mins


def _block(builder, q, o, b, xs, xsum, acc):
    """acc <32 x float> += block b (at byte o of row q) . x, with the mins taken from the sub-block sums xsum [C/32]."""
    f32x8, f32x = simd.vec(F32, 8), simd.vec(F32, SUB)
    d = simd.load_half(builder, q, o)
    dmin = simd.load_half(builder, q, builder.add(o, ir.Constant(I64, 2)))
    scales, mins = _scales_mins(builder, q, o)
    scales = builder.fmul(builder.uitofp(scales, f32x8), simd.splat(builder, d, 8), flags=simd.FAST)  # [8]
    mins = builder.fmul(builder.uitofp(mins, f32x8), simd.splat(builder, dmin, 8), flags=simd.FAST)
    sums = simd.load_at(builder, xsum, builder.mul(b, ir.Constant(I64, 8)), f32x8)
    min_terms = builder.fmul(mins, sums, flags=simd.FAST)  # [8], lanes 0-7 of a <32 x float> below
    acc = builder.fsub(acc, builder.shuffle_vector(min_terms, ir.Constant(f32x8, None),
                                                   simd.const_vec(I32, list(range(8)) + [8] * 24)), flags=simd.FAST)
    xo = builder.mul(b, ir.Constant(I64, QK_K))
    for p in range(4):
        quants = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, _QS + SUB * p)), simd.vec(I8, SUB))
        halves = (builder.and_(quants, simd.splat_const(I8, SUB, 15)), builder.lshr(quants, simd.splat_const(I8, SUB, 4)))
        for k, nibbles in enumerate(halves):
            j = 2 * p + k  # sub-block
            xv = simd.load_at(builder, xs, builder.add(xo, ir.Constant(I64, SUB * j)), f32x)
            weights = builder.fmul(builder.uitofp(nibbles, f32x), simd.lanes(builder, scales, [j] * SUB), flags=simd.FAST)
            acc = simd.fma(builder, weights, xv, acc)
    return acc


_block.acc_type = simd.vec(F32, SUB)
_dot_rows = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, 1)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, xsum, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]; xsum [C/32] the sums of x over each 32-weight sub-block."""
    r = r0
    while r + simd.ROWS_IN_FLIGHT <= r1:
        _dot_rows(w, r, x, xsum, out)
        r += simd.ROWS_IN_FLIGHT
    for rr in range(r, r1):
        _dot_row(w, rr, x, xsum, out)


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, xsum, out, r0, t0, t1):
    """out[t0:t1, r0:r0 + 16] = x[t0:t1] @ W[r0:r0 + 16].T for one expert's w [R, B]; xsum [N, C/32]."""
    r1 = min(r0 + ROWS_PER_ITEM, w.shape[0])
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], xsum[t0], out[t0])
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
    xsum = sub_block_sums(x)  # [N, C/32]
    num_items = items.shape[0]
    for i in prange(num_items * len(raws)):
        k, j = i // num_items, i % num_items
        _tile(raws[k][items[j, 0]], x, xsum, outs[k], items[j, 1], items[j, 2], items[j, 3])


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_K bytes [..., C // 256 * 144] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 7.5 (the mean q), scale_j * q - min_j has mean 0 and rms ~258 for
    uniform random 6-bit scales and mins and 4-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((0, 1.0), (2, 7.5)), 258.0, scale)

