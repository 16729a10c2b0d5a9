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
from numba import njit, prange

from .kquant import QK_K, SUB, sub_scales, ubits
from .tiles import ROWS_PER_ITEM, format_api, random_weight, work_items

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
            q01 = row[qo + l]  # sub-blocks 0 (low nibble) and 1 (high nibble)
            q23 = row[qo + SUB + l]
            q45 = row[qo + 2 * SUB + l]
            q67 = row[qo + 3 * SUB + l]
            s += ((d0 * ubits(q01, 0, 15) - m0) * x[xo + l]
                  + (d1 * ubits(q01, 4, 15) - m1) * x[xo + SUB + l]
                  + (d2 * ubits(q23, 0, 15) - m2) * x[xo + 2 * SUB + l]
                  + (d3 * ubits(q23, 4, 15) - m3) * x[xo + 3 * SUB + l]
                  + (d4 * ubits(q45, 0, 15) - m4) * x[xo + 4 * SUB + l]
                  + (d5 * ubits(q45, 4, 15) - m5) * x[xo + 5 * SUB + l]
                  + (d6 * ubits(q67, 0, 15) - m6) * x[xo + 6 * SUB + l]
                  + (d7 * ubits(q67, 4, 15) - m7) * x[xo + 7 * SUB + l])
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
def _moe_matmul(raw, x, expert_ids, row_starts, out):
    items = work_items(expert_ids, row_starts, raw.shape[0], raw.shape[1])  # [W, 4]
    for i in prange(items.shape[0]):
        _tile(raw[items[i, 0]], x, out, items[i, 1], items[i, 2], items[i, 3])


dequantize, matvec, matmul, moe_matmul = format_api(__name__, BLOCK_SIZE, BLOCK_BYTES, _dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_K bytes [..., C // 256 * 144] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 7.5 (the mean q), scale_j * q - min_j has mean 0 and rms ~258 for
    uniform random 6-bit scales and mins and 4-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((0, 1.0), (2, 7.5)), 258.0, scale)

