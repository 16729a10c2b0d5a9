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
from numba import njit, prange

from .half import read_half
from .kquant import QK_K, SUB, join_bits
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


@njit(inline="always", nogil=True, fastmath=True, cache=True)
def _row_dot(row, x):
    """row [B] . x [C], weights dequantized in registers: one reduction per half super-block."""
    acc = np.float32(0)
    for b in range(row.shape[0] // BLOCK_BYTES):
        o = b * BLOCK_BYTES
        d = read_half(row, o + _D)
        for h in range(2):
            low = o + 64 * h
            high = o + _QH + SUB * h
            sc = o + _SC + 8 * h
            s0, s1 = _scale(row, sc, d), _scale(row, sc + 2, d)  # weights 0-15 of runs 0, 1
            s2, s3 = _scale(row, sc + 4, d), _scale(row, sc + 6, d)
            t0, t1 = _scale(row, sc + 1, d), _scale(row, sc + 3, d)  # weights 16-31 of runs 0, 1
            t2, t3 = _scale(row, sc + 5, d), _scale(row, sc + 7, d)
            xo = b * QK_K + 128 * h
            s = np.float32(0)
            for l in range(16):  # weights l (scales s*) and l + 16 (scales t*) of the four runs
                s += (s0 * _q6(row[low + l], 0, row[high + l], 0) * x[xo + l]
                      + t0 * _q6(row[low + 16 + l], 0, row[high + 16 + l], 0) * x[xo + 16 + l]
                      + s1 * _q6(row[low + SUB + l], 0, row[high + l], 2) * x[xo + SUB + l]
                      + t1 * _q6(row[low + SUB + 16 + l], 0, row[high + 16 + l], 2) * x[xo + SUB + 16 + l]
                      + s2 * _q6(row[low + l], 4, row[high + l], 4) * x[xo + 2 * SUB + l]
                      + t2 * _q6(row[low + 16 + l], 4, row[high + 16 + l], 4) * x[xo + 2 * SUB + 16 + l]
                      + s3 * _q6(row[low + SUB + l], 4, row[high + l], 6) * x[xo + 3 * SUB + l]
                      + t3 * _q6(row[low + SUB + 16 + l], 4, row[high + 16 + l], 6) * x[xo + 3 * SUB + 16 + l])
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
    """Random valid Q6_K bytes [..., C // 256 * 210] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1, scale_k * q has rms ~1366 (74 * 18.5) for uniform random int8 scales and 6-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((_D, 1.0),), 1366.0, scale)

