"""Q8_0: GGUF's 8-bit format, blocks of 32 weights in 34 bytes (ggml block_q8_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:34    qs   32 int8 quants
weight = d * q

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 34), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items, K unpacked rows.
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange

from . import simd
from .half import read_half
from .simd import I8, I64
from .tiles import ROWS_PER_ITEM, UNPACK_ROWS, dot_unpacked, format_api, random_scales, work_items

QTYPE = GGMLQuantizationType.Q8_0
BLOCK_SIZE = 32
BLOCK_BYTES = 34


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


_block.acc_type = simd.vec(simd.F32, BLOCK_SIZE)
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
    """Random valid Q8_0 bytes [..., C // 32 * 34] for a weight of shape (..., C), values of magnitude ~ scale.

    Quants are uniform in -127..127 (mean |q| ~ 64), so d ~ scale / 64.
    """
    *lead, cols = shape
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // BLOCK_SIZE)
    qs = rng.integers(-127, 128, size=(num_blocks, BLOCK_SIZE), dtype=np.int8).view(np.uint8)  # [blocks, 32]
    blocks = np.concatenate([random_scales(rng, num_blocks, scale / 64), qs], axis=1)  # [blocks, 34]
    return blocks.reshape(*lead, cols // BLOCK_SIZE * BLOCK_BYTES)
