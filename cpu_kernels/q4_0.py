"""Q4_0: GGUF's 4-bit format, blocks of 32 weights in 18 bytes (ggml block_q4_0).

Block layout, bytes:
    0:2     d    f16 scale
    2:18    qs   16 bytes: weight j (j < 16) in the low nibble of byte j, weight 16 + j in its high nibble
weight = d * (q - 8)   (q in 0..15)

Shape legend: R output rows, C columns, B bytes per row (C // 32 * 18), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items, K unpacked rows (ROWS_PER_ITEM),
S token chunks.
"""
import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange

from . import simd
from .act_quant import quantize_rows, without_int8
from .half import read_half
from .prefill import dot_tile, token_panels
from .prefill_i16 import (integer_prefill, tile_i16, token_panels_i16, unpack_row_i16_intrinsic, unpacked_rows,
                          x_levels)
from .simd import F32, I8, I16, I32, I64
from .target import int_dot_width
from .tiles import ROWS_PER_ITEM, format_api, random_scales, work_items

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
_unpack_row_fast = simd.unpack_row_intrinsic(_weights, BLOCK_BYTES, BLOCK_SIZE)
_X_LEVELS = x_levels(8)  # integer prefill: |x| levels for |weight integers| <= 8
_unpack_row_i16 = unpack_row_i16_intrinsic(_runs_i16, BLOCK_BYTES, BLOCK_SIZE)
_dot_rows = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, 1)
_dot_rows_i16 = simd.rows_dot_intrinsic(_block_i16, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row_i16 = simd.rows_dot_intrinsic(_block_i16, BLOCK_BYTES, 1)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows(w, r0 + i * step, stride, x, x, out)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row(w, rr, x, x, out)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot_i16(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C], x given as int16 xq [C] and (scale, sum) pairs aux [C/16]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows_i16(w, r0 + i * step, stride, xq, aux, out)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row_i16(w, rr, xq, aux, out)


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, xq, xaux, panels, pxq, pdx, psums, out, item, act_quant):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's raw w [R, B] and item (e, r0, t0, t1, s, r1);
    panels [S, C, 64]."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if t1 - t0 == 1 and act_quant:
        _rows_dot_i16(w, r0, r1, xq[t0], xaux[t0], out[t0])
        return
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], out[t0])
        return
    if integer_prefill(act_quant):
        wq, factors, mins = unpacked_rows(x.shape[1])  # [K, C], [K, C/32], [K, C/32]
        for r in range(r0, r1):
            _unpack_row_i16(w, r, wq[r - r0], factors[r - r0], mins[r - r0])
        tile_i16(wq, factors, mins, pxq, pdx, psums, item, out)
        return
    buf = np.zeros((ROWS_PER_ITEM, x.shape[1]), dtype=np.float32)  # [K, C]
    for r in range(r0, r1):
        _unpack_row_fast(w, r, buf[r - r0])
    dot_tile(buf, r1 - r0, panels[item[4]], t0, t1, out, r0)


@njit(parallel=True, nogil=True, cache=True)
def _dequantize(raw, out):
    for r in prange(raw.shape[0]):
        _unpack_row(raw[r], out[r])


@njit(nogil=True, cache=True)
def _prepare(raws, x, expert_ids, row_starts, act_quant):
    """(work items [W, 6], what the items read of x) of a moe_matmul call: its serial part."""
    items = work_items(expert_ids, row_starts, raws[0].shape[0], raws[0].shape[1])  # [W, 6]
    panels = token_panels(x, items, not integer_prefill(act_quant))  # [S, C, 64] (float prefill)
    pxq, pdx, psums = token_panels_i16(x, items, act_quant, _X_LEVELS)  # integer prefill: prefill_i16
    xq, xaux = quantize_rows(x, items, without_int8(act_quant))  # [N, C], [N, C/16] (empty unless int16 decode)
    return items, (xq, xaux, panels, pxq, pdx, psums)


@njit(nogil=True, fastmath=True, cache=True)
def _run_item(raws, x, items, prep, outs, i, act_quant):
    """Item i of a moe_matmul call over its len(raws) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    xq, xaux, panels, pxq, pdx, psums = prep
    _tile(raws[k][items[j, 0]], x, xq, xaux, panels, pxq, pdx, psums, outs[k], items[j], act_quant)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _moe_matmul(raws, x, expert_ids, row_starts, outs, act_quant):
    """outs[k][rows of group g] = x[same rows] @ raws[k][expert_ids[g]].T for each weight k (one parallel region)."""
    items, prep = _prepare(raws, x, expert_ids, row_starts, act_quant)
    for i in prange(items.shape[0] * len(raws)):
        _run_item(raws, x, items, prep, outs, i, act_quant)


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
