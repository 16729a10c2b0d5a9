"""Q4_0: GGUF's 4-bit format, blocks of 32 weights in 18 bytes (ggml block_q4_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:18    qs   16 bytes: weight j (j < 16) in the low nibble of byte j, weight 16 + j in its high nibble
weight = d * (q - 8)   (q in 0..15)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 18), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items, K unpacked rows.
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from .half import read_half
from .simd import dot_q4_block
from .tiles import ROWS_PER_ITEM, UNPACK_ROWS, dot_unpacked, format_api, random_scales, work_items

QTYPE = GGMLQuantizationType.Q4_0
BLOCK_SIZE = 32
BLOCK_BYTES = 18


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


@njit(inline="always", nogil=True, cache=True)
def _block_dot(row, b, x):
    """Block b of row [B] . x [C]: sum(q * x) as one vector op, then the scale."""
    o = b * BLOCK_BYTES
    return read_half(row, o) * dot_q4_block(row, o + 2, x, b * BLOCK_SIZE)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]; 4 rows at a time keep 4 memory streams and FMA chains going."""
    num_blocks = w.shape[1] // BLOCK_BYTES
    r = r0
    while r + 4 <= r1:
        a0 = a1 = a2 = a3 = np.float32(0)
        for b in range(num_blocks):
            a0 += _block_dot(w[r], b, x)
            a1 += _block_dot(w[r + 1], b, x)
            a2 += _block_dot(w[r + 2], b, x)
            a3 += _block_dot(w[r + 3], b, x)
        out[r], out[r + 1], out[r + 2], out[r + 3] = a0, a1, a2, a3
        r += 4
    for rr in range(r, r1):
        acc = np.float32(0)
        for b in range(num_blocks):
            acc += _block_dot(w[rr], b, x)
        out[rr] = acc


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, out, r0, t0, t1):
    """out[t0:t1, r0:r0 + 16] = x[t0:t1] @ W[r0:r0 + 16].T for one expert's raw w [R, B]."""
    r1 = min(r0 + ROWS_PER_ITEM, w.shape[0])
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], out[t0])
        return
    buf = np.zeros((UNPACK_ROWS, x.shape[1]), dtype=np.float32)  # [K, C]
    for k0 in range(r0, r1, UNPACK_ROWS):
        num_rows = min(UNPACK_ROWS, r1 - k0)
        for k in range(num_rows):
            _unpack_row(w[k0 + k], buf[k])
        dot_unpacked(buf, num_rows, x, t0, t1, out, k0)


@njit(parallel=True, nogil=True, cache=True)
def _dequantize(raw, out):
    for r in prange(raw.shape[0]):
        _unpack_row(raw[r], out[r])


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
    """Random valid Q4_0 bytes [..., C // 32 * 18] for a weight of shape (..., C), values of magnitude ~ scale.

    q - 8 is uniform in -8..7 (mean |q - 8| = 4), so d ~ scale / 4.
    """
    *lead, cols = shape
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    qs = rng.integers(0, 256, size=(num_blocks, BLOCK_SIZE // 2), dtype=np.uint8)  # [blocks, 16]
    blocks = np.concatenate([random_scales(rng, num_blocks, scale / 4), qs], axis=1)  # [blocks, 18]
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
