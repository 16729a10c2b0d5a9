"""The drivers of the quantized formats, written once and compiled per format around its block code.

A format module (q4_0, q8_0, q4_k, q5_k, q6_k) holds its block layout, its block code (the LLVM builders
`block`, `block_i16`, `block_i8`, `weights`, `runs_i16`) and its scalar `unpack_row`; `instance` turns those into
the format's decode dots, prefill tiles, dequantizer and moe_matmul. Each template below is copied per format
with the format's code as its globals (cpu_kernels.twins.renamed_copy), so every format compiles to its own
machine code and caches under its own name, as if the driver were written out in the format's module.
Numba checks a cache against the file of the function it compiled only (here this file), not the modules
whose code it compiled in; so an instance's name carries a digest of the format's module and of the modules
that build its code (`source_digest`): an edited format, or an upgraded package, compiles afresh.

Kernel shapes (which templates a format gets):
    INT16_DECODE  decode dots float or int16 (int8 runs as int16): Q4_0
    INT8_DECODE   decode dots float, int16 or int8: Q8_0, Q6_K
    SUMS_DECODE   as INT8_DECODE, the float dot taking the mins from the x sums of each 32-weight sub-block: Q4_K, Q5_K

Shape legend: R output rows, C columns, B bytes per row, T tokens, E experts, N (token, expert) rows sorted by
group, G groups, W work items, K unpacked rows (ROWS_PER_ITEM), S token chunks.
"""
import hashlib
import sys
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from . import simd
from .act_quant import FLOAT, INT8, INT16, quantize_rows, quantize_rows_i8, without_int8
from .prefill import dot_tile, tile_f32, token_panels, unpacked_rows_f32
from .prefill_i16 import integer_prefill, tile_i16, token_panels_i16, unpack_row_i16_intrinsic, unpacked_rows
from .tiles import NO_CHUNK, PROMPT_ITEMS, decode_sub_block_sums, work_items
from .tokens_dot import tokens_dot_intrinsic
from .twins import renamed_copy

# Names the templates read from the instance's globals (F821 below): the format's intrinsics _dot_rows,
# _dot_row (and _i16, _i8), _unpack_row_fast, _unpack_row_i16, its _unpack_row, _X_LEVELS and _INT_PREFILL
# (False: prefill multiplies in float under every act_quant), and the other instances of the same format
# (_rows_dot, _tile, _prepare, _run_item).


# -- decode dots: one token's row against rows r0:r1 ------------------------------------------------------

def rows_dot(w, r0, r1, x, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows(w, r0 + i * step, stride, x, x, out)  # noqa: F821
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row(w, rr, x, x, out)  # noqa: F821


def rows_dot_sums(w, r0, r1, x, xsum, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C]; xsum [C/32] the sums of x over each 32-weight sub-block."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows(w, r0 + i * step, stride, x, xsum, out)  # noqa: F821
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row(w, rr, x, xsum, out)  # noqa: F821


def rows_dot_i16(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C], x given as int16 xq [C] (Q4_K: super-blocks in
    act_quant.SPLIT_ORDER) and (scale, sum) pairs aux [C/16]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows_i16(w, r0 + i * step, stride, xq, aux, out)  # noqa: F821
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row_i16(w, rr, xq, aux, out)  # noqa: F821


def rows_dot_i8(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x [C], x given as int8 xq [C] (Q4_K, Q5_K: sub-blocks in NIBBLE_ORDER)
    and (scale, sum) pairs aux [C/16]."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _dot_rows_i8(w, r0 + i * step, stride, xq, aux, out)  # noqa: F821
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _dot_row_i8(w, rr, xq, aux, out)  # noqa: F821


def tokens_dot_i16(w, r0, r1, t0, t1, xq, aux, out):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T, x as int16 (xq [N, C], aux [N, C/16] as rows_dot_i16 reads them):
    passes of 4 tokens over each row, then 2 (tokens_dot.py); a last lone token as the one-token dots."""
    t = t0
    while t1 - t >= 4:
        for r in range(r0, r1):
            _dot_tokens4_i16(w, r, xq, aux, t, out)  # noqa: F821
        t += 4
    if t1 - t >= 2:
        for r in range(r0, r1):
            _dot_tokens2_i16(w, r, xq, aux, t, out)  # noqa: F821
        t += 2
    if t < t1:
        _rows_dot_i16(w, r0, r1, xq[t], aux[t], out[t])  # noqa: F821


# -- tiles: one work item (e, r0, t0, t1, s, r1) ----------------------------------------------------------

def tile(w, x, xq, xaux, panels, pxq, pdx, psums, out, item, act_quant):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's raw w [R, B] and item (e, r0, t0, t1, s, r1);
    panels [S, C, 64]."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if item[4] == NO_CHUNK and t1 - t0 > 1:  # a prompt's decode item of several tokens (int16: PROMPT_ITEMS)
        _tokens_dot_i16(w, r0, r1, t0, t1, xq, xaux, out)
        return
    if t1 - t0 == 1 and act_quant:
        _rows_dot_i16(w, r0, r1, xq[t0], xaux[t0], out[t0])  # noqa: F821
        return
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], out[t0])  # noqa: F821
        return
    if _INT_PREFILL and integer_prefill(act_quant):  # noqa: F821
        wq, factors, mins = unpacked_rows(x.shape[1], r1 - r0)  # [K, C], [K, C/32], [K, C/32]
        for r in range(r0, r1):
            _unpack_row_i16(w, r, wq[r - r0], factors[r - r0], mins[r - r0])  # noqa: F821
        tile_i16(wq, factors, mins, pxq, pdx, psums, item, out)
        return
    buf = unpacked_rows_f32(x.shape[1], r1 - r0)  # [K, C]
    for r in range(r0, r1):
        _unpack_row_fast(w, r, buf[r - r0])  # noqa: F821
    tile_f32(buf, r1 - r0, panels, item, out)


def tile_i8(w, x, xq, xaux, x8, x8aux, panels, pxq, pdx, psums, out, item, act_quant):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's raw w [R, B] and item (e, r0, t0, t1, s, r1);
    panels [S, C, 64]; x as int16 (xq, xaux) or int8 (x8, x8aux) for the decode dots."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if item[4] == NO_CHUNK and t1 - t0 > 1:  # a prompt's decode item of several tokens (int16: PROMPT_ITEMS)
        _tokens_dot_i16(w, r0, r1, t0, t1, xq, xaux, out)
        return
    if t1 - t0 == 1 and act_quant == INT8:
        _rows_dot_i8(w, r0, r1, x8[t0], x8aux[t0], out[t0])  # noqa: F821
        return
    if t1 - t0 == 1 and act_quant:
        _rows_dot_i16(w, r0, r1, xq[t0], xaux[t0], out[t0])  # noqa: F821
        return
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], out[t0])  # noqa: F821
        return
    if _INT_PREFILL and integer_prefill(act_quant):  # noqa: F821
        wq, factors, mins = unpacked_rows(x.shape[1], r1 - r0)  # [K, C], [K, C/32], [K, C/32]
        for r in range(r0, r1):
            _unpack_row_i16(w, r, wq[r - r0], factors[r - r0], mins[r - r0])  # noqa: F821
        tile_i16(wq, factors, mins, pxq, pdx, psums, item, out)
        return
    buf = unpacked_rows_f32(x.shape[1], r1 - r0)  # [K, C]
    for r in range(r0, r1):
        _unpack_row_fast(w, r, buf[r - r0])  # noqa: F821
    tile_f32(buf, r1 - r0, panels, item, out)


def tile_sums(w, x, xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums, out, item, act_quant):
    """out[t0:t1, r0:r1] = x[t0:t1] @ W[r0:r1].T for one expert's w [R, B] and item (e, r0, t0, t1, s, r1);
    xsum [N, C/32], panels [S, C, 64]; x as int16 (xq, xaux) or int8 (x8, x8aux) for the decode dots."""
    r0, t0, t1 = item[1], item[2], item[3]
    r1 = item[5]
    if item[4] == NO_CHUNK and t1 - t0 > 1:  # a prompt's decode item of several tokens (int16: PROMPT_ITEMS)
        _tokens_dot_i16(w, r0, r1, t0, t1, xq, xaux, out)
        return
    if t1 - t0 == 1 and act_quant == INT8:
        _rows_dot_i8(w, r0, r1, x8[t0], x8aux[t0], out[t0])  # noqa: F821
        return
    if t1 - t0 == 1 and act_quant:
        _rows_dot_i16(w, r0, r1, xq[t0], xaux[t0], out[t0])  # noqa: F821
        return
    if t1 - t0 == 1:
        _rows_dot(w, r0, r1, x[t0], xsum[t0], out[t0])  # noqa: F821
        return
    if _INT_PREFILL and integer_prefill(act_quant):  # noqa: F821
        wq, factors, mins = unpacked_rows(x.shape[1], r1 - r0)  # [K, C], [K, C/32], [K, C/32]
        for r in range(r0, r1):
            _unpack_row_i16(w, r, wq[r - r0], factors[r - r0], mins[r - r0])  # noqa: F821
        tile_i16(wq, factors, mins, pxq, pdx, psums, item, out)
        return
    buf = unpacked_rows_f32(x.shape[1], r1 - r0)  # [K, C]
    for r in range(r0, r1):
        _unpack_row_fast(w, r, buf[r - r0])  # noqa: F821
    tile_f32(buf, r1 - r0, panels, item, out)


# -- moe_matmul: its serial part (prepare), one item (run_item), the parallel region -----------------------

def dequantize(raw, out):
    """out f32 [R, C] = raw [R, B] dequantized row by row."""
    for r in prange(raw.shape[0]):
        _unpack_row(raw[r], out[r])  # noqa: F821


def prepare(raws, x, expert_ids, row_starts, act_quant):
    """(work items [W, 6], what the items read of x) of a moe_matmul call: its serial part."""
    several = act_quant == INT16 + PROMPT_ITEMS
    act_quant %= PROMPT_ITEMS
    int_prefill = _INT_PREFILL and integer_prefill(act_quant)  # noqa: F821
    items = work_items(expert_ids, row_starts, raws[0].shape[0], raws[0].shape[1], raws[0].shape[2],  # [W, 6]
                       several, int_prefill, x.shape[1])
    panels = token_panels(x, items, not int_prefill)  # [S, C, 64] (float prefill)
    pxq, pdx, psums = token_panels_i16(x, items, act_quant if int_prefill else FLOAT, _X_LEVELS)  # noqa: F821
    xq, xaux = _quantize_rows(x, items, without_int8(act_quant))  # noqa: F821 ([N, C], [N, C/16] or empty)
    return items, (xq, xaux, panels, pxq, pdx, psums)


def prepare_i8(raws, x, expert_ids, row_starts, act_quant):
    """(work items [W, 6], what the items read of x) of a moe_matmul call: its serial part."""
    several = act_quant == INT16 + PROMPT_ITEMS
    act_quant %= PROMPT_ITEMS
    int_prefill = _INT_PREFILL and integer_prefill(act_quant)  # noqa: F821
    items = work_items(expert_ids, row_starts, raws[0].shape[0], raws[0].shape[1], raws[0].shape[2],  # [W, 6]
                       several, int_prefill, x.shape[1])
    panels = token_panels(x, items, not int_prefill)  # [S, C, 64] (float prefill)
    pxq, pdx, psums = token_panels_i16(x, items, act_quant if int_prefill else FLOAT, _X_LEVELS)  # noqa: F821
    xq, xaux = _quantize_rows(x, items, act_quant)  # noqa: F821 ([N, C], [N, C/16], empty unless int16 decode)
    x8, x8aux = quantize_rows_i8(x, items, act_quant, False)  # [N, C], [N, C/16] (empty unless int8 decode)
    return items, (xq, xaux, x8, x8aux, panels, pxq, pdx, psums)


def prepare_sums(raws, x, expert_ids, row_starts, act_quant):
    """(work items [W, 6], what the items read of x) of a moe_matmul call: its serial part; x rounded for the
    int16 dots by _quantize_rows (quantize_rows, or quantize_rows_split), for the int8 ones in NIBBLE_ORDER."""
    several = act_quant == INT16 + PROMPT_ITEMS
    act_quant %= PROMPT_ITEMS
    int_prefill = _INT_PREFILL and integer_prefill(act_quant)  # noqa: F821
    items = work_items(expert_ids, row_starts, raws[0].shape[0], raws[0].shape[1], raws[0].shape[2],  # [W, 6]
                       several, int_prefill, x.shape[1])
    xsum = decode_sub_block_sums(x, act_quant)  # [N, C/32] (empty unless float decode)
    panels = token_panels(x, items, not int_prefill)  # [S, C, 64] (float prefill)
    pxq, pdx, psums = token_panels_i16(x, items, act_quant if int_prefill else FLOAT, _X_LEVELS)  # noqa: F821
    xq, xaux = _quantize_rows(x, items, act_quant)  # noqa: F821 ([N, C], [N, C/16], empty unless int16 decode)
    x8, x8aux = quantize_rows_i8(x, items, act_quant, True)  # [N, C], [N, C/16] (empty unless int8 decode)
    return items, (xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums)


def run_item(raws, x, items, prep, outs, i, act_quant):
    """Item i of a moe_matmul call over its len(raws) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    xq, xaux, panels, pxq, pdx, psums = prep
    _tile(raws[k][items[j, 0]], x, xq, xaux, panels, pxq, pdx, psums, outs[k], items[j], act_quant)  # noqa: F821


def run_item_i8(raws, x, items, prep, outs, i, act_quant):
    """Item i of a moe_matmul call over its len(raws) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    xq, xaux, x8, x8aux, panels, pxq, pdx, psums = prep
    _tile(raws[k][items[j, 0]], x, xq, xaux, x8, x8aux, panels, pxq, pdx, psums,  # noqa: F821
          outs[k], items[j], act_quant)


def run_item_sums(raws, x, items, prep, outs, i, act_quant):
    """Item i of a moe_matmul call over its len(raws) weights: work item i % W of weight i // W."""
    num_items = items.shape[0]
    k, j = i // num_items, i % num_items
    xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums = prep
    _tile(raws[k][items[j, 0]], x, xsum, xq, xaux, x8, x8aux, panels, pxq, pdx, psums,  # noqa: F821
          outs[k], items[j], act_quant)


def moe_matmul(raws, x, expert_ids, row_starts, outs, act_quant):
    """outs[k][rows of group g] = x[same rows] @ raws[k][expert_ids[g]].T for each weight k (one parallel region);
    act_quant plus tiles.PROMPT_ITEMS: a prompt's call (int16 groups of a few tokens as several-token items)."""
    items, prep = _prepare(raws, x, expert_ids, row_starts, act_quant)  # noqa: F821
    plain = act_quant % PROMPT_ITEMS
    for i in prange(items.shape[0] * len(raws)):
        _run_item(raws, x, items, prep, outs, i, plain)  # noqa: F821


# -- instances ----------------------------------------------------------------------------------------------

_DOT = dict(nogil=True, fastmath=True)
_OPTIONS = {  # each template's njit options (and cache=True)
    rows_dot: _DOT, rows_dot_sums: _DOT, rows_dot_i16: _DOT, rows_dot_i8: _DOT, tokens_dot_i16: _DOT,
    tile: _DOT, tile_i8: _DOT, tile_sums: _DOT,
    dequantize: dict(parallel=True, nogil=True),
    prepare: dict(nogil=True), prepare_i8: dict(nogil=True), prepare_sums: dict(nogil=True),
    run_item: _DOT, run_item_i8: _DOT, run_item_sums: _DOT,
    moe_matmul: dict(parallel=True, fastmath=True, nogil=True),
}
# shapes: the templates of (rows_dot, rows_dot_i16, rows_dot_i8, tile, prepare, run_item); dequantize and
# moe_matmul are the same for all
INT16_DECODE = (rows_dot, rows_dot_i16, None, tile, prepare, run_item)
INT8_DECODE = (rows_dot, rows_dot_i16, rows_dot_i8, tile_i8, prepare_i8, run_item_i8)
SUMS_DECODE = (rows_dot_sums, rows_dot_i16, rows_dot_i8, tile_sums, prepare_sums, run_item_sums)


class Kernels(NamedTuple):
    """A format's compiled driver: the decode dots (rows_dot_i8 None without int8 dots), its tile, and moe_matmul
    with its serial part (prepare) and one item (run_item), which the fused decode layer calls itself."""
    rows_dot: object
    rows_dot_i16: object
    rows_dot_i8: object
    tile: object
    dequantize: object
    prepare: object
    run_item: object
    moe_matmul: object


def instance(name, shape, block_bytes, block_size, unpack_row, x_levels, block, block_i16, weights, runs_i16,
             block_i8=None, int_prefill=True, **shape_globals):
    """The Kernels of format `name` (q8_0, ...) around its block code, of the given shape (INT16_DECODE,
    INT8_DECODE, SUMS_DECODE):

    block, block_i16, block_i8: simd.rows_dot_intrinsic's block_fn for float, int16 and int8 x (block_i8 None
        for INT16_DECODE); weights: simd.unpack_row_intrinsic's weights_fn; runs_i16: prefill_i16's block_fn;
    unpack_row(row [B], dst f32 [C]): the scalar dequantizer; x_levels: prefill_i16.x_levels of its weights;
    int_prefill: False for a format whose weights are no int16 rows with one factor and min per 32 columns
        (Q2_K's mins per 16): its prefill multiplies in float (runs_i16 must still build; it never runs);
    shape_globals: what the shape's templates read besides (_quantize_rows: how x is rounded for the int16 decode
        dots, act_quant.quantize_rows unless given; SUMS_DECODE gives its own).
    """
    names = dict(_X_LEVELS=x_levels, _INT_PREFILL=int_prefill, _unpack_row=unpack_row,
                 **{"_quantize_rows": quantize_rows, **shape_globals},
                 _unpack_row_fast=simd.unpack_row_intrinsic(weights, block_bytes, block_size),
                 _unpack_row_i16=unpack_row_i16_intrinsic(runs_i16, block_bytes, block_size))
    for suffix, block_fn in (("", block), ("_i16", block_i16), ("_i8", block_i8)):
        if block_fn is not None:
            names[f"_dot_rows{suffix}"] = simd.rows_dot_intrinsic(block_fn, block_bytes, simd.ROWS_IN_FLIGHT)
            names[f"_dot_row{suffix}"] = simd.rows_dot_intrinsic(block_fn, block_bytes, 1)
    for num_tokens in (2, 4):  # (a 3-token pass measured no faster: one fewer loop to compile per format)
        names[f"_dot_tokens{num_tokens}_i16"] = tokens_dot_intrinsic(block_i16, block_bytes, 1, num_tokens)
    templates = dict(zip(("rows_dot", "rows_dot_i16", "rows_dot_i8", "tokens_dot_i16", "tile", "dequantize", "prepare",
                          "run_item", "moe_matmul"), (*shape[:3], tokens_dot_i16, shape[3], dequantize, *shape[4:],
                                                      moe_matmul)))
    suffix = f"{name}_{source_digest(sys.modules[unpack_row.__module__])}"
    for kernel, template in templates.items():  # each compiled with the instances before it as globals
        if template is not None:
            names[f"_{kernel}"] = njit(cache=True, **_OPTIONS[template])(renamed_copy(template, suffix, **names))
    return Kernels(**{kernel: names.get(f"_{kernel}") for kernel in Kernels._fields})


def source_digest(format_module):
    """8 hex digits of the sources an instance is compiled from: the format's module, the cpu_kernels modules
    it imports (their block builders and tables compile in), and the modules whose builders and kernels the
    templates compile in."""
    digest = hashlib.sha1()
    imported = {getattr(value, "__module__", None) for value in vars(format_module).values()}
    imported |= {value.__name__ for value in vars(format_module).values() if isinstance(value, type(sys))}
    own = sorted(name for name in imported if name and name.startswith(f"{__package__}."))
    for module in (format_module, simd, sys.modules[__name__], sys.modules[quantize_rows.__module__],
                   sys.modules[dot_tile.__module__], sys.modules[integer_prefill.__module__],
                   sys.modules[work_items.__module__], sys.modules[tokens_dot_intrinsic.__module__],
                   *(sys.modules[name] for name in own)):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]
