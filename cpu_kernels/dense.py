"""Kernels shared by the unquantized formats F32, F16 and BF16 (one module each holds its interface).

A weight is one little-endian word of the file (uint32 for F32, uint16 for F16 and
BF16). Its float32 bits are `((w & sign_mask) << sign_shift) | ((w & mag_mask) << mag_shift)`
and its value those bits times `scale` (a SPEC tuple): shifts and one multiply that
vectorize, where a branchy half -> float conversion would not. For F16 the bits
are the half's exponent and mantissa moved into float32 position, so the value is
2^-112 too small and scale = 2^112 fixes it: exact for normal and subnormal halves
(inf and NaN come out finite, which fastmath dot kernels may assume away anyway).

Shape legend: R output rows, C columns, T tokens, E experts, N (token, expert) rows
sorted by group, G groups, W work items, K unpacked rows.
"""
import numpy as np
from numba import njit, prange

from .half import _u32_as_f32
from .tiles import ROWS_PER_ITEM, UNPACK_ROWS, dot_unpacked, work_items


def spec(sign_mask, sign_shift, mag_mask, mag_shift, scale):
    """The word -> float32 recipe of a format, typed for the kernels."""
    return (np.uint32(sign_mask), np.uint32(sign_shift), np.uint32(mag_mask), np.uint32(mag_shift), np.float32(scale))


@njit(inline="always", nogil=True, cache=True)
def _value(word, recipe):
    """The float32 value of one weight word."""
    sign_mask, sign_shift, mag_mask, mag_shift, scale = recipe
    w = np.uint32(word)
    return _u32_as_f32(np.uint32(((w & sign_mask) << sign_shift) | ((w & mag_mask) << mag_shift))) * scale


@njit(nogil=True, fastmath=True, cache=True)
def _rows_dot(w, r0, r1, x, recipe, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C] for words w [R, C]; 4 rows at a time share each x load."""
    r = r0
    while r + 4 <= r1:
        a0 = a1 = a2 = a3 = np.float32(0)
        for c in range(w.shape[1]):
            xc = x[c]
            a0 += _value(w[r, c], recipe) * xc
            a1 += _value(w[r + 1, c], recipe) * xc
            a2 += _value(w[r + 2, c], recipe) * xc
            a3 += _value(w[r + 3, c], recipe) * xc
        out[r], out[r + 1], out[r + 2], out[r + 3] = a0, a1, a2, a3
        r += 4
    for rr in range(r, r1):
        acc = np.float32(0)
        for c in range(w.shape[1]):
            acc += _value(w[rr, c], recipe) * x[c]
        out[rr] = acc


@njit(nogil=True, fastmath=True, cache=True)
def _tile(w, x, recipe, out, r0, t0, t1):
    """out[t0:t1, r0:r0 + 16] = x[t0:t1] @ W[r0:r0 + 16].T for one expert's words w [R, C]."""
    r1 = min(r0 + ROWS_PER_ITEM, w.shape[0])
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], recipe, out[t0])
        return
    buf = np.zeros((UNPACK_ROWS, x.shape[1]), dtype=np.float32)  # [K, C]
    for k0 in range(r0, r1, UNPACK_ROWS):
        num_rows = min(UNPACK_ROWS, r1 - k0)
        for k in range(num_rows):
            for c in range(w.shape[1]):
                buf[k, c] = _value(w[k0 + k, c], recipe)
        dot_unpacked(buf, num_rows, x, t0, t1, out, k0)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def moe_matmul(words, x, expert_ids, row_starts, recipe, out):
    """out[row_starts[g]:row_starts[g+1]] = x[same rows] @ W[expert_ids[g]].T; words [E, R, C], x [N, C], out [N, R]."""
    items = work_items(row_starts, words.shape[1])  # [W, 4]
    for i in prange(items.shape[0]):
        _tile(words[expert_ids[items[i, 0]]], x, recipe, out, items[i, 1], items[i, 2], items[i, 3])
