"""Q5_K: GGUF's 5-bit K-quant, super-blocks of 256 weights in 176 bytes (ggml block_q5_K).

Block layout, bytes:
    0:2     d      f16, scale of the sub-block scales
    2:4     dmin   f16, scale of the sub-block mins
    4:16    8 packed 6-bit (scale, min) pairs, one per sub-block of 32 weights (kquant.scale_min)
    16:48   high bits: bit j of byte l is bit 4 of weight l of sub-block j
    48:176  low 4 bits; bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p+1 (high nibbles)
weight = (d * scale_j) * q - dmin * min_j   (q in 0..31, sub-block j)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 176), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .kquant import QK_K, SUB, join_bits, sub_scales
from .tiles import ROWS_PER_ITEM, format_api, random_weight, work_items

QTYPE = GGMLQuantizationType.Q5_K
BLOCK_SIZE = QK_K
BLOCK_BYTES = 176
_QH = 16  # offset of the high bits in a block
_QS = 48  # offset of the low 4 bits


@njit(inline="always", nogil=True, cache=True)
def _dequant_block(row, b, dst):
    """Super-block b of row [B] -> dst [256], rounded exactly as gguf does."""
    o = b * BLOCK_BYTES
    for j in range(8):
        ds, dm = sub_scales(row, o, j)
        qo = o + _QS + (j // 2) * SUB
        shift = 4 * (j % 2)
        for l in range(SUB):
            dst[j * SUB + l] = ds * join_bits(row[qo + l], shift, row[o + _QH + l], j, 1) - dm


@njit(inline="always", nogil=True, fastmath=True, cache=True)
def _row_dot(row, x):
    """row [B] . x [C], weights dequantized in registers: one reduction per super-block."""
    acc = np.float32(0)
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d0, m0 = sub_scales(row, o, 0)
        d1, m1 = sub_scales(row, o, 1)
        d2, m2 = sub_scales(row, o, 2)
        d3, m3 = sub_scales(row, o, 3)
        d4, m4 = sub_scales(row, o, 4)
        d5, m5 = sub_scales(row, o, 5)
        d6, m6 = sub_scales(row, o, 6)
        d7, m7 = sub_scales(row, o, 7)
        qo = o + _QS
        xo = b * QK_K
        s = np.float32(0)
        for l in range(SUB):
            h = row[o + _QH + l]  # bit 4 of weight l of every sub-block
            q01 = row[qo + l]  # low bits of sub-blocks 0 (low nibble) and 1 (high nibble)
            q23 = row[qo + SUB + l]
            q45 = row[qo + 2 * SUB + l]
            q67 = row[qo + 3 * SUB + l]
            s += ((d0 * join_bits(q01, 0, h, 0, 1) - m0) * x[xo + l]
                  + (d1 * join_bits(q01, 4, h, 1, 1) - m1) * x[xo + SUB + l]
                  + (d2 * join_bits(q23, 0, h, 2, 1) - m2) * x[xo + 2 * SUB + l]
                  + (d3 * join_bits(q23, 4, h, 3, 1) - m3) * x[xo + 3 * SUB + l]
                  + (d4 * join_bits(q45, 0, h, 4, 1) - m4) * x[xo + 4 * SUB + l]
                  + (d5 * join_bits(q45, 4, h, 5, 1) - m5) * x[xo + 5 * SUB + l]
                  + (d6 * join_bits(q67, 0, h, 6, 1) - m6) * x[xo + 6 * SUB + l]
                  + (d7 * join_bits(q67, 4, h, 7, 1) - m7) * x[xo + 7 * SUB + l])
        acc += s
    return acc


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, out, r0, t0, t1):
    """out[t0:t1, r0:r0 + 16] = x[t0:t1] @ W[r0:r0 + 16].T for one expert's w [R, B]."""
    r1 = min(r0 + ROWS_PER_ITEM, w.shape[0])
    if t1 - t0 == 1:
        for r in range(r0, r1):
            out[t0, r] = _row_dot(w[r], x[t0])
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
    """Random valid Q5_K bytes [..., C // 256 * 176] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 15.5 (the mean q), scale_j * q - min_j has mean 0 and rms ~527 for
    uniform random 6-bit scales and mins and 5-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((0, 1.0), (2, 15.5)), 527.0, scale)

