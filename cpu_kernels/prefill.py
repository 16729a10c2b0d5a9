"""The prefill micro-kernel every format shares: dequantized rows times a panel of tokens.

A prefill work item unpacks its ROWS_PER_ITEM weight rows to float32 once, then
multiplies them with up to TOKENS_PER_ITEM tokens at a time. The activations are
read transposed (tokens along a vector), so each weight value is broadcast once and
FMAs a whole vector of tokens: per column, `ROWS_PER_PASS` broadcasts and one or two
vector loads of x feed `ROWS_PER_PASS` x (lanes / vector width) FMAs, with the
accumulators in registers and no horizontal sums at all (a row-by-row dot sums
every (row, token) pair horizontally and loads x once per row).

Each item's tokens are read from a panel [C, 64] of their own (x transposed, built once
per call): a transposed x [C, N] read 32 tokens at a time strides by N floats per
column, and ran at 60 % of the contiguous panel's speed (78 vs 128 GFLOP/s, one core).
The pass shape suits AVX-512's 32 registers; with AVX2's 16 it spills (correct, slower).

Shape legend: N (token, expert) rows, C columns, K unpacked rows (ROWS_PER_ITEM),
S token chunks, L lanes (tokens per pass).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import aligned, simd
from .simd import F32, I64
from .tiles import ROWS_PER_ITEM, TOKENS_PER_ITEM
from .twins import serial_twin

ROWS_PER_PASS = 8  # weight rows per micro-kernel pass: 8 x 32 tokens = 16 AVX-512 accumulators
PASS_TOKENS = 32  # tokens per micro-kernel pass
PARALLEL_MIN_PANELS = 4  # fewer token chunks are transposed serially (no parallel region to open)
TRANSPOSE_BLOCK = 32  # x is transposed 32 columns at a time (both sides stay in L1)


def _outer_intrinsic(num_lanes, num_rows):
    """An intrinsic f(w f32 [K, C], k, xt f32 [C, >= t + L], t, res f32 [num_rows, >= L]) -> None:
    res[i, :L] = sum over c of w[k + i, c] * xt[c, t:t + L] for i < num_rows, L = num_lanes."""
    def impl(typingctx, w, k, xt, t, res):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
                   for a in (w, xt, res)):
            return None
        sig = types.void(w, k, xt, t, res)

        def codegen(context, builder, signature, args):
            w_ty, k_ty, xt_ty, t_ty, res_ty = signature.args
            wa = context.make_array(w_ty)(context, builder, value=args[0])
            xa = context.make_array(xt_ty)(context, builder, value=args[2])
            num_cols = cgutils.unpack_tuple(builder, wa.shape)[1]
            stride = cgutils.unpack_tuple(builder, xa.shape)[1]
            first = context.cast(builder, args[1], k_ty, types.int64)
            rows = [builder.gep(wa.data, [builder.mul(builder.add(first, ir.Constant(I64, i)), num_cols)])
                    for i in range(num_rows)]
            x0 = builder.gep(xa.data, [context.cast(builder, args[3], t_ty, types.int64)])
            lanes_ty = simd.vec(F32, num_lanes)

            def step(c, accs):
                xv = simd.load_at(builder, x0, builder.mul(c, stride), lanes_ty)
                return [simd.fma(builder, simd.splat(builder, builder.load(builder.gep(row, [c])), num_lanes), xv, acc)
                        for row, acc in zip(rows, accs)]

            accs = simd.row_loop(builder, num_cols, step, [ir.Constant(lanes_ty, None)] * num_rows)
            ra = context.make_array(res_ty)(context, builder, value=args[4])
            res_stride = cgutils.unpack_tuple(builder, ra.shape)[1]
            for i, acc in enumerate(accs):
                row = builder.gep(ra.data, [builder.mul(ir.Constant(I64, i), res_stride)])
                ptr = builder.bitcast(row, lanes_ty.as_pointer())
                builder.store(acc, ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"outer_rows{num_rows}_x{num_lanes}"
    return intrinsic(impl)


_outer16 = _outer_intrinsic(PASS_TOKENS // 2, ROWS_PER_PASS)
_outer32 = _outer_intrinsic(PASS_TOKENS, ROWS_PER_PASS)


@njit(nogil=True, cache=True)
def chunk_spans(items, wanted):
    """[S, 2]: each token chunk's (first token, end token) of the work items [W, 6] (decode items have none:
    tiles.NO_CHUNK; an item of more than TOKENS_PER_ITEM tokens has chunks s, s + 1, ... of that many); [0, 2]
    when every item has one token (decode reads x directly) or not wanted."""
    several, last = False, -1
    for i in range(items.shape[0] if wanted else 0):
        several = several or items[i, 3] - items[i, 2] > 1
        if items[i, 4] >= 0:
            last = max(last, items[i, 4] + (items[i, 3] - items[i, 2] - 1) // TOKENS_PER_ITEM)
    num_chunks = last + 1 if several else 0
    spans = np.empty((num_chunks, 2), dtype=np.int64)  # [S, 2]
    for i in range(items.shape[0] if num_chunks else 0):
        s = items[i, 4]
        for c0 in range(items[i, 2], items[i, 3] if s >= 0 else items[i, 2], TOKENS_PER_ITEM):
            spans[s, 0], spans[s, 1] = c0, min(c0 + TOKENS_PER_ITEM, items[i, 3])
            s += 1
    return spans


@njit(nogil=True, cache=True)
def token_panels(x, items, wanted=True):
    """x f32 [N, C] -> panels f32 [S, C, 64]: panel s holds token chunk s of the work items [W, 6] transposed,
    zero past its end token; [0, C, 64] when every item has one token or not wanted (integer prefill:
    prefill_i16)."""
    spans = chunk_spans(items, wanted)
    num_chunks = spans.shape[0]
    if num_chunks < PARALLEL_MIN_PANELS:
        return _panels_serial(x, spans)
    return _panels(x, spans)


@njit(parallel=True, nogil=True, cache=True)
def _panels(x, spans):
    """The panels of token_panels, one chunk per parallel iteration: a 512-token prompt's ~64 panels
    (16 MB) took 5 ms serially, an eighth of a 2-thread prefill matmul and more at 16 threads."""
    panels = aligned.zeros(spans.shape[0] * x.shape[1] * TOKENS_PER_ITEM, np.float32).reshape(
        (spans.shape[0], x.shape[1], TOKENS_PER_ITEM))  # [S, C, 64]
    for s in prange(spans.shape[0]):
        _fill_panel(x, spans[s, 0], spans[s, 1], panels[s])
    return panels


@njit(nogil=True, cache=True)
def _fill_panel(x, t0, t1, panel):
    """panel [C, 64] = x[t0:t1].T (t1 - t0 <= 64), in column blocks that stay in cache."""
    for c0 in range(0, x.shape[1], TRANSPOSE_BLOCK):
        for c in range(c0, min(c0 + TRANSPOSE_BLOCK, x.shape[1])):
            for t in range(t0, t1):
                panel[c, t - t0] = x[t, c]


_panels_serial = serial_twin(_panels)


@njit(nogil=True, fastmath=True, cache=True)
def dot_tile(w, num_rows, panel, t0, t1, out, r0):
    """out[t0:t1, r0:r0 + num_rows] = x[t0:t1] @ w[:num_rows].T for t1 - t0 <= 64, in passes of up to 32 tokens.

    w f32 [K, C]: unpacked rows, K a multiple of ROWS_PER_PASS, the rows past num_rows finite (zeros);
    panel f32 [C, 64]: x[t0:t1] transposed (token_panels).
    """
    res = np.empty((ROWS_PER_PASS, PASS_TOKENS), dtype=np.float32)  # [rows, 32]
    for p0 in range(t0, t1, PASS_TOKENS):
        p1 = min(p0 + PASS_TOKENS, t1)
        for k in range(0, num_rows, ROWS_PER_PASS):
            if p1 - p0 <= PASS_TOKENS // 2:
                _outer16(w, k, panel, p0 - t0, res)
            else:
                _outer32(w, k, panel, p0 - t0, res)
            for t in range(p0, p1):
                for i in range(min(ROWS_PER_PASS, num_rows - k)):
                    out[t, r0 + k + i] = res[i, t - p0]


@njit(nogil=True, cache=True)
def unpacked_rows_f32(num_cols, num_rows):
    """The work buffer of one float prefill item of num_rows rows: w f32 [K, C], the rows past num_rows zero (a pass
    multiplies ROWS_PER_PASS rows; their results are dropped, but must stay finite), the others for the item to fill
    (zeroing all K rows, 128 KB at C = 2048, cost as much as the item's unpacking)."""
    w = np.empty((ROWS_PER_ITEM, num_cols), dtype=np.float32)
    w[num_rows:] = 0
    return w


@njit(nogil=True, fastmath=True, cache=True)
def tile_f32(w, num_rows, panels, item, out):
    """dot_tile of work item (e, r0, t0, t1, s, r1) with its chunks' panels [S, C, 64] (token_panels): tokens t0:t1
    in chunks of TOKENS_PER_ITEM (chunk s, then s + 1, ...), the item's rows w [K, C] unpacked once for all."""
    s = item[4]
    for c0 in range(item[2], item[3], TOKENS_PER_ITEM):
        dot_tile(w, num_rows, panels[s], c0, min(c0 + TOKENS_PER_ITEM, item[3]), out, item[1])
        s += 1
