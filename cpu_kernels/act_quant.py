"""Activations quantized once per call for the integer decode dots.

`STRATA_ACT_QUANT` picks how a decode matvec multiplies: "int16" (the default where the
target has AVX2 or AVX-512BW) rounds x to int16 per 32-value block with a float scale
(relative error ~1e-5 of the block's largest value) and dots it with the integer quants
through pmaddwd; "float" widens the quants to float32 and FMAs them with x; "int8" (opt-in)
rounds x to int8 per 32-value block (error up to 1/254 of the block's largest value, as
llama.cpp's q8_0 / q8_K activations) and dots it through vpdpbusd (AVX-512 VNNI / AVX-VNNI):
Q8_0, Q4_K and Q6_K have int8 dots, the other formats take their int16 dot, and a target
without VNNI takes int16 with a warning. Targets without AVX2 (STRATA_ISA_FLOOR=avx) always
take the float path: their integer vectors are 128 bits.

Shape legend: N rows of x, C columns, C/32 blocks per row.
"""
import functools
import logging
import os

import numpy as np
from numba import njit

from .target import int_dot_width, vnni_width

log = logging.getLogger(__name__)

QBLOCK = 32  # values per int16 / int8 block of x (one Q8_0 / Q4_0 block, one K-quant sub-block)
I16_MAX = np.float32(32767)
I8_MAX = np.float32(127)
FLOAT, INT16, INT8 = 0, 1, 2
ACT_QUANTS = {"float": FLOAT, "int16": INT16, "int8": INT8}  # name: the code kernels take
# Sub-block order of a 256-value super-block in int8 x for Q4_K / Q5_K, whose 64-byte quant loads hold
# sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) (low and high nibbles of two 32-byte runs).
NIBBLE_ORDER = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.int64)


def _split_order():
    """[256]: the natural index (in a super-block) of the x value int16 x stores at each position for Q4_K.
    Q4_K's int16 dot reads 64 quant bytes as 32 int16 lanes and takes four vectors out of them with shifts and
    masks alone (low and high nibbles of the even and odd bytes); x is stored to match. Positions
    128h + 32v + i: v = 0, 1 the low nibbles (sub-block 4h, lanes 16-31 sub-block 4h + 2) of even and odd
    bytes, v = 2, 3 the high nibbles (sub-blocks 4h + 1 and 4h + 3)."""
    order = np.empty(256, dtype=np.int64)
    for h in range(2):
        for v in range(4):
            for i in range(32):
                sub_block = 4 * h + v // 2 + (2 if i >= 16 else 0)
                order[128 * h + 32 * v + i] = 32 * sub_block + 2 * (i % 16) + v % 2
    return order


SPLIT_ORDER = _split_order()


def default_act_quant():
    """The act_quant code from STRATA_ACT_QUANT (default: int16 where the target has AVX2, else float)."""
    name = (os.environ.get("STRATA_ACT_QUANT") or "int16").strip().lower()
    if name not in ACT_QUANTS:
        raise ValueError(f"STRATA_ACT_QUANT={name!r}: expected one of {', '.join(ACT_QUANTS)}")
    return _supported(name)


def act_quant_code(act_quant):
    """The kernels' code for an act_quant name, or the default for None."""
    if act_quant is None:
        return default_act_quant()
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"act_quant={act_quant!r}: expected one of {', '.join(ACT_QUANTS)}")
    return _supported(act_quant)


def _supported(name):
    """The code of `name`, or of what the target runs instead (int8 -> int16 without VNNI, float without AVX2)."""
    if name == "int8" and not vnni_width():
        _warn_no_vnni()
        name = "int16"
    return ACT_QUANTS[name] if int_dot_width() >= 16 else FLOAT


@functools.cache
def _warn_no_vnni():
    log.warning("STRATA_ACT_QUANT=int8: the target CPU has no AVX-512 VNNI or AVX-VNNI; decode uses int16 activations")


@njit(inline="always", nogil=True, cache=True)
def without_int8(act_quant):
    """The code a format without int8 dots runs: int16 for int8."""
    return INT16 if act_quant == INT8 else act_quant


@njit(nogil=True, cache=True)
def _num_decode_rows(x, items, wanted):
    """x's row count if `wanted` and a work item [W, 6] has a single token (prefill multiplies in float), else 0."""
    for i in range(items.shape[0] if wanted else 0):
        if items[i, 3] - items[i, 2] == 1:
            return x.shape[0]
    return 0


@njit(nogil=True, cache=True)
def quantize_rows(x, items, act_quant):
    """x f32 [N, C] -> (xq int16 [N, C], aux f32 [N, C/16]); aux holds (scale, sum of x) per 32-value block,
    x ~= xq * scale. Empty ([0, C], [0, C/16]) unless act_quant is INT16 and a work item [W, 6] has a single
    token."""
    return _quantize(x, _num_decode_rows(x, items, act_quant == INT16))


@njit(nogil=True, cache=True)
def quantize_rows_split(x, items, act_quant):
    """quantize_rows with each 256-value super-block's int16 values in SPLIT_ORDER (aux stays in column order)."""
    return _quantize_split(x, _num_decode_rows(x, items, act_quant == INT16))


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_split(x, num_rows):
    """quantize_rows_split of x's first num_rows rows, rounded straight into SPLIT_ORDER: each run of 16
    positions takes every other value of one sub-block (a strided load, no index table; a 1 x 1024 call
    takes 1.9 us where rounding in column order and then permuting took 2.6)."""
    xq, aux, inv = _quantized_arrays(x, num_rows, np.int16)
    for n in range(num_rows):
        _block_scales(x, n, I16_MAX, inv, aux[n])
        for base in range(0, x.shape[1], 256):
            for run in range(16):  # positions base + 16 run ..: h = run // 8, v = run // 2 % 4, half = run % 2
                h, v, half = run // 8, run // 2 % 4, run % 2
                sub_block = base // QBLOCK + 4 * h + v // 2 + 2 * half
                src, dst, scale = QBLOCK * sub_block + v % 2, base + 16 * run, inv[sub_block]
                for k in range(16):
                    xq[n, dst + k] = np.int16(np.rint(x[n, src + 2 * k] * scale))
    return xq, aux


@njit(nogil=True, cache=True)
def quantize_rows_i8(x, items, act_quant, nibble_order):
    """x f32 [N, C] -> (xq int8 [N, C], aux f32 [N, C/16]) as quantize_rows, rounded to -127..127; empty unless
    act_quant is INT8 and a work item has a single token. nibble_order: each 256-value super-block's
    sub-blocks stored in NIBBLE_ORDER (aux stays in column order)."""
    return _quantize_i8(x, _num_decode_rows(x, items, act_quant == INT8), nibble_order)


@njit(inline="always", nogil=True, cache=True)
def _quantized_arrays(x, num_rows, dtype):
    """The (xq [N, C] of dtype, aux f32 [N, C/16], inv f32 [C/32]) that quantizing num_rows rows of x fills."""
    num_blocks = x.shape[1] // QBLOCK
    return (np.empty((num_rows, x.shape[1]), dtype=dtype), np.empty((num_rows, 2 * num_blocks), dtype=np.float32),
            np.empty(num_blocks, dtype=np.float32))


@njit(nogil=True, fastmath=True, cache=True)
def _block_scales(x, n, levels, inv, aux):
    """inv [C/32] = levels / max|x[n] over each block| (0 for all-zero blocks); aux [C/16] = (scale, sum) pairs."""
    for j in range(x.shape[1] // QBLOCK):
        amax = np.float32(0)
        total = np.float32(0)
        for c in range(j * QBLOCK, (j + 1) * QBLOCK):
            v = abs(x[n, c])
            amax = v if v > amax else amax
            total += x[n, c]
        inv[j] = levels / amax if amax > 0 else np.float32(0)
        aux[2 * j] = amax / levels
        aux[2 * j + 1] = total


@njit(nogil=True, fastmath=True, cache=True)
def _quantize(x, num_rows):
    """quantize_rows of x's first num_rows rows. Block maxima first, then one rounding loop over the row:
    written as one loop per block with max() and floor, it did not vectorize (4x slower)."""
    xq, aux, inv = _quantized_arrays(x, num_rows, np.int16)
    for n in range(num_rows):
        _block_scales(x, n, I16_MAX, inv, aux[n])
        for c in range(x.shape[1]):
            xq[n, c] = np.int16(np.rint(x[n, c] * inv[c // QBLOCK]))
    return xq, aux


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_i8(x, num_rows, nibble_order):
    """quantize_rows_i8 of x's first num_rows rows."""
    num_blocks = x.shape[1] // QBLOCK
    xq, aux, inv = _quantized_arrays(x, num_rows, np.int8)
    slot = np.arange(num_blocks)  # [C/32]: where block j goes in xq
    if nibble_order:
        for j in range(num_blocks):
            slot[j] = j - j % 8 + np.argmax(NIBBLE_ORDER == j % 8)
    for n in range(num_rows):
        _block_scales(x, n, I8_MAX, inv, aux[n])
        for j in range(num_blocks):
            dst = slot[j] * QBLOCK
            for c in range(QBLOCK):
                xq[n, dst + c] = np.int8(np.rint(x[n, j * QBLOCK + c] * inv[j]))
    return xq, aux
