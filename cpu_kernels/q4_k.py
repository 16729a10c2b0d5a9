"""Q4_K: GGUF's 4-bit K-quant, super-blocks of 256 weights in 144 bytes (ggml block_q4_K).

Block layout, bytes:
    0:2     d      f16, scale of the sub-block scales
    2:4     dmin   f16, scale of the sub-block mins
    4:16    8 packed 6-bit (scale, min) pairs, one per sub-block of 32 weights (kquant.scale_min)
    16:144  4-bit quants; bytes 32p..32p+31 hold sub-block 2p (low nibbles) and 2p+1 (high nibbles)
weight = (d * scale_j) * q - dmin * min_j   (q in 0..15, sub-block j)

Shape legend: R output rows, C columns, B bytes per row (C // 256 * 144), T tokens,
E experts, N (token, expert) rows sorted by group, G groups, W work items, K unpacked rows (ROWS_PER_ITEM),
S token chunks.
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from . import simd
from .act_quant import INT8, quantize_rows_i8, quantize_rows_split
from .kquant import (QK_K, SUB, integer_runs, split_block_i16, sub_block_pairs, sub_block_quants, sub_scales, ubits,
                     vector_blocks)
from .prefill import dot_tile, token_panels
from .prefill_i16 import (integer_prefill, tile_i16, token_panels_i16, unpack_row_i16_intrinsic, unpacked_rows,
                          x_levels)
from .tiles import ROWS_PER_ITEM, decode_sub_block_sums, format_api, random_weight, work_items

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


_block, _, _block_i8, _weights = vector_blocks("q4_k", sub_block_quants(_QS), sub_block_pairs(_QS))
_block_i16 = split_block_i16(_QS)
_unpack_row_fast = simd.unpack_row_intrinsic(_weights, BLOCK_BYTES, QK_K)
_X_LEVELS = x_levels(15 * 63)  # integer prefill: |x| levels for |weight integers| <= 15 * 63
_unpack_row_i16 = unpack_row_i16_intrinsic(integer_runs("q4_k", sub_block_quants(_QS)), BLOCK_BYTES, QK_K)
_dot_rows = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row = simd.rows_dot_intrinsic(_block, BLOCK_BYTES, 1)
_dot_rows_i16 = simd.rows_dot_intrinsic(_block_i16, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row_i16 = simd.rows_dot_intrinsic(_block_i16, BLOCK_BYTES, 1)
_dot_rows_i8 = simd.rows_dot_intrinsic(_block_i8, BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
_dot_row_i8 = simd.rows_dot_intrinsic(_block_i8, BLOCK_BYTES, 1)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, xsum, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]; xsum [C/32] the sums of x over each 32-weight sub-block."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows(w, r0 + i * step, stride, x, xsum, out)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row(w, rr, x, xsum, out)


@njit(nogil=True, cache=True)
def _unpack_row(row, dst):
    """row [B] -> dst f32 [C], rounded exactly as gguf does."""
    for b in range(row.shape[0] // BLOCK_BYTES):
        _dequant_block(row, b, dst[b * QK_K:(b + 1) * QK_K])


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot_i16(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C], x given as int16 xq [C] (super-blocks in act_quant.SPLIT_ORDER)
    and (scale, sum) pairs aux [C/16]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows_i16(w, r0 + i * step, stride, xq, aux, out)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row_i16(w, rr, xq, aux, out)


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot_i8(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C], x given as int8 xq [C] (sub-blocks in NIBBLE_ORDER) and (scale, sum)
    pairs aux [C/16]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows_i8(w, r0 + i * step, stride, xq, aux, out)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row_i8(w, rr, xq, aux, out)


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums, out, item, act_quant):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's w [R, B] and item (e, r0, t0, t1, s, r1);
    xsum [N, C/32], panels [S, C, 64]; x as int16 (xq, xaux) or int8 (x8, x8aux) for the decode dots."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if t1 - t0 == 1 and act_quant == INT8:
        _rows_dot_i8(w, r0, r1, x8[t0], x8aux[t0], out[t0])
        return
    if t1 - t0 == 1 and act_quant:
        _rows_dot_i16(w, r0, r1, xq[t0], xaux[t0], out[t0])
        return
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], xsum[t0], out[t0])
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
    xsum = decode_sub_block_sums(x, act_quant)  # [N, C/32] (empty unless float decode)
    panels = token_panels(x, items, not integer_prefill(act_quant))  # [S, C, 64] (float prefill)
    pxq, pdx, psums = token_panels_i16(x, items, act_quant, _X_LEVELS)  # integer prefill: prefill_i16
    xq, xaux = quantize_rows_split(x, items, act_quant)  # [N, C], [N, C/16] (empty unless int16 decode)
    x8, x8aux = quantize_rows_i8(x, items, act_quant, True)  # [N, C], [N, C/16] (empty unless int8 decode)
    return items, (xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums)


@njit(nogil=True, fastmath=True, cache=True)
def _run_item(raws, x, items, prep, outs, i, act_quant):
    """Item i of a moe_matmul call over its len(raws) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums = prep
    _tile(raws[k][items[j, 0]], x, xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums, outs[k], items[j], act_quant)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _moe_matmul(raws, x, expert_ids, row_starts, outs, act_quant):
    """outs[k][rows of group g] = x[same rows] @ raws[k][expert_ids[g]].T for each weight k (one parallel region)."""
    items, prep = _prepare(raws, x, expert_ids, row_starts, act_quant)
    for i in prange(items.shape[0] * len(raws)):
        _run_item(raws, x, items, prep, outs, i, act_quant)


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _dequantize, _moe_matmul)


def random_blocks(rng, shape, scale):
    """Random valid Q4_K bytes [..., C // 256 * 144] for a weight of shape (..., C), values of rms ~ scale.

    With d = 1 and dmin = 7.5 (the mean q), scale_j * q - min_j has mean 0 and rms ~258 for
    uniform random 6-bit scales and mins and 4-bit quants.
    """
    return random_weight(rng, shape, QK_K, BLOCK_BYTES, ((0, 1.0), (2, 7.5)), 258.0, scale)

