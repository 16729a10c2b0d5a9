"""Kernels shared by the unquantized formats F32, F16 and BF16 (one module each holds its interface).

A weight is one little-endian word of the file (uint32 for F32, uint16 for F16 and
BF16), widened to float32 by a recipe that vectorizes, where a branchy conversion would not.
The recipe's Numba type picks the conversion at compile time, so its shifts are constants:
runtime shift counts made Numba widen every word to 64 bits (F32 router, 1 thread, hot:
10.5 us for [64, 1024], numpy 3.3 us).

    F32_BITS      F32: the word is the float's bits
    BF16_BITS     BF16: the word is the float's top 16 bits
    HALF          F16: the hardware conversion where the target has F16C; elsewhere
                  the half's exponent and mantissa moved into float32 position and
                  the exponent re-biased (+112) as an integer; where the half's exponent
                  field is 0 (zero, subnormal) the magnitude is float(mantissa) * 2^-24
                  instead, blended in without a branch. Exact for every finite half, and
                  no float32 subnormal is ever made (those take slow microcode assists).
                  Inf and NaN come out finite, which fastmath dot kernels may assume away anyway.

Shape legend: R output rows, C columns, T tokens, E experts, N (token, expert) rows
sorted by group, G groups, W work items, K unpacked rows (ROWS_PER_ITEM).
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .half import half_bits_as_f32, u32_as_f32
from .prefill import dot_tile, token_panels
from .target import has_f16c
from .tiles import ROWS_PER_ITEM, work_items
from .twins import serial_twin


F32_BITS = np.float32(0)  # recipe of F32 (its type, float32, is what counts)
BF16_BITS = np.uint16(0)  # recipe of BF16 (its type, uint16, is what counts)
# recipe of F16: (exponent re-bias, smallest normal magnitude, value of a subnormal's mantissa unit);
# its length (3) picks the half conversion in `_value`.
HALF = (np.int32(112 << 23), np.int32(0x400), np.float32(2.0**-24))


def moe_kernels(word_dtype, recipe):
    """The (parallel, serial) moe_matmul kernels of a format of `word_dtype` words widened by `recipe` (F32_BITS,
    BF16_BITS or HALF)."""
    def kernel(compiled):
        def moe_matmul(raws, x, expert_ids, row_starts, outs, act_quant):  # float formats: no integer path
            compiled(tuple(raw.view(word_dtype) for raw in raws), x, expert_ids, row_starts, recipe, outs)
        moe_matmul.compiled, moe_matmul.word_dtype, moe_matmul.recipe = compiled, word_dtype, recipe  # for callers
        moe_matmul.prepare, moe_matmul.run_item = _prepare, _run_item
        return moe_matmul  # in compiled code (hybrid/backends/cpu_decode.py)

    return kernel(_moe_matmul), kernel(_moe_matmul_serial)


# Not inline="always": Numba's IR inliner warns (NumbaIRAssumptionWarning) on the reassigned `value`;
# LLVM inlines the call into the dot loops all the same.
@njit(nogil=True, cache=True)
def half_by_integers(word, recipe):
    """The float32 value of a half word for targets without F16C, recipe HALF (see the module doc)."""
    exp_bias, min_normal, unit = recipe
    w = np.int32(word)  # int32 math: a uint32 form with an integer mask blend ran 2.5x slower
    mag = w & np.int32(0x7FFF)
    value = u32_as_f32(np.uint32((mag << np.int32(13)) + exp_bias))
    if mag < min_normal:  # zero or subnormal; a select, not a branch, once vectorized
        value = np.float32(mag) * unit
    if w & np.int32(0x8000):
        value = -value
    return value


def _value(word, recipe):
    """The float32 value of one weight word; compiled through the overload below, per kind of recipe."""
    raise NotImplementedError("_value runs inside Numba kernels only")


@overload(_value)
def _value_impl(word, recipe):
    if isinstance(recipe, types.Float):  # F32_BITS
        return lambda word, recipe: u32_as_f32(np.uint32(word))
    if isinstance(recipe, types.Integer):  # BF16_BITS
        return lambda word, recipe: u32_as_f32(np.uint32(np.uint32(word) << 16))
    if isinstance(recipe, types.BaseTuple) and len(recipe) == len(HALF) and has_f16c():
        return lambda word, recipe: half_bits_as_f32(word)
    if isinstance(recipe, types.BaseTuple) and len(recipe) == len(HALF):
        return lambda word, recipe: half_by_integers(word, recipe)
    return None


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
def _tile(w, x, recipe, panels, out, item):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's words w [R, C] and item (e, r0, t0, t1, s, r1);
    panels [S, C, 64]."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], recipe, out[t0])
        return
    buf = np.zeros((ROWS_PER_ITEM, x.shape[1]), dtype=np.float32)  # [K, C]
    for r in range(r0, r1):
        for c in range(w.shape[1]):
            buf[r - r0, c] = _value(w[r, c], recipe)
    dot_tile(buf, r1 - r0, panels[item[4]], t0, t1, out, r0)


@njit(nogil=True, cache=True)
def _prepare(words, x, expert_ids, row_starts):
    """(work items [W, 6], token panels [S, C, 64] of the prefill items' chunks, [0, C, 64] where every item has one
    token: decode, and groups of up to tiles.DECODE_MAX_TOKENS, whose items have no chunk) of a moe_matmul call: its
    serial part."""
    items = work_items(expert_ids, row_starts, words[0].shape[0], words[0].shape[1],
                       words[0].shape[2] * words[0].itemsize)  # [W, 6]
    return items, token_panels(x, items)


@njit(nogil=True, fastmath=True, cache=True)
def _run_item(words, x, items, panels, recipe, outs, i):
    """Item i of a moe_matmul call over its len(words) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    _tile(words[k][items[j, 0]], x, recipe, panels, outs[k], items[j])


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _moe_matmul(words, x, expert_ids, row_starts, recipe, outs):
    """outs[k][rows of group g] = x[same rows] @ words[k][expert_ids[g]].T; words[k] [E, R, C], x [N, C], outs[k] [N, R]."""
    items, panels = _prepare(words, x, expert_ids, row_starts)
    for i in prange(items.shape[0] * len(words)):
        _run_item(words, x, items, panels, recipe, outs, i)


_moe_matmul_serial = serial_twin(_moe_matmul)
