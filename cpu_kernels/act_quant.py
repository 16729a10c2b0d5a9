"""Activations quantized once per call for the integer decode dots.

`STRATA_ACT_QUANT` picks how a decode matvec multiplies: "int16" (the default where the
target has AVX2 or AVX-512BW) rounds x to int16 per 32-value block with a float scale
(relative error ~1e-5 of the block's largest value) and dots it with the integer quants
through pmaddwd; "float" widens the quants to float32 and FMAs them with x. Targets without
AVX2 (STRATA_ISA_FLOOR=avx) always take the float path: their integer vectors are 128 bits.

Shape legend: N rows of x, C columns, C/32 blocks per row.
"""
import os

import numpy as np
from numba import njit

from .target import int_dot_width

QBLOCK = 32  # values per int16 block of x (one Q8_0 / Q4_0 block, one K-quant sub-block)
I16_MAX = np.float32(32767)
ACT_QUANTS = {"float": 0, "int16": 1}  # name: the code kernels take


def default_act_quant():
    """The act_quant code from STRATA_ACT_QUANT (default: int16 where the target has AVX2, else float)."""
    name = (os.environ.get("STRATA_ACT_QUANT") or "int16").strip().lower()
    if name not in ACT_QUANTS:
        raise ValueError(f"STRATA_ACT_QUANT={name!r}: expected one of {', '.join(ACT_QUANTS)}")
    return ACT_QUANTS[name] if int_dot_width() >= 16 else ACT_QUANTS["float"]


def act_quant_code(act_quant):
    """The kernels' code for an act_quant name, or the default for None."""
    if act_quant is None:
        return default_act_quant()
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"act_quant={act_quant!r}: expected one of {', '.join(ACT_QUANTS)}")
    return ACT_QUANTS[act_quant] if int_dot_width() >= 16 else ACT_QUANTS["float"]


@njit(nogil=True, cache=True)
def quantize_rows(x, items, act_quant):
    """x f32 [N, C] -> (xq int16 [N, C], aux f32 [N, C/16]); aux holds (scale, sum of x) per 32-value block,
    x ~= xq * scale. Empty ([0, C], [0, C/16]) when act_quant is 0 (float) or no work item [W, 5] has a
    single token (prefill multiplies in float)."""
    num_rows = 0
    for i in range(items.shape[0] if act_quant else 0):
        if items[i, 3] - items[i, 2] == 1:
            num_rows = x.shape[0]
            break
    return _quantize(x, num_rows)


@njit(nogil=True, fastmath=True, cache=True)
def _quantize(x, num_rows):
    """quantize_rows of x's first num_rows rows. Block maxima first, then one rounding loop over the row:
    written as one loop per block with max() and floor, it did not vectorize (4x slower)."""
    num_blocks = x.shape[1] // QBLOCK
    xq = np.empty((num_rows, x.shape[1]), dtype=np.int16)  # [N, C]
    aux = np.empty((num_rows, 2 * num_blocks), dtype=np.float32)  # [N, C/16]
    inv = np.empty(num_blocks, dtype=np.float32)  # [C/32]
    for n in range(num_rows):
        for j in range(num_blocks):
            amax = np.float32(0)
            total = np.float32(0)
            for c in range(j * QBLOCK, (j + 1) * QBLOCK):
                v = abs(x[n, c])
                amax = v if v > amax else amax
                total += x[n, c]
            inv[j] = I16_MAX / amax if amax > 0 else np.float32(0)
            aux[n, 2 * j] = amax / I16_MAX
            aux[n, 2 * j + 1] = total
        for c in range(x.shape[1]):
            xq[n, c] = np.int16(np.rint(x[n, c] * inv[c // QBLOCK]))
    return xq, aux
