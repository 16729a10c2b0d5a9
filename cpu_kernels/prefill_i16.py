"""The integer prefill micro-kernel: int16 weight rows times int16 token panels through pmaddwd.

The float prefill (`prefill`) runs one FMA per weight and token: 16 multiply-adds per AVX-512
instruction. Here a format unpacks its rows to exact int16 integers (a quant times its
integer sub-block scale: Q4_K q * scale <= 945, Q6_K q * scale <= 4096, Q8_0 q) with one float
factor and one float min per 32 columns, x is rounded to int16 per (token, 32 columns), and
one pmaddwd does 32 multiply-adds: two columns of 16 tokens against a broadcast pair of
weights. Per 32 columns a (row, 16 tokens) accumulator is converted once and FMA'd with the
row's factor times the tokens' scales; the min term comes from the tokens' float sums.

An int32 accumulator holds 32 columns of products, so x is rounded to at most 2^31 / (32 max|w|)
levels (`x_levels`): 32767 (int16's), or 16383 for Q6_K; a value moves by at most half a level,
max|x| / 65534 of its 32 columns (Q6_K: / 32766). Where the target has AVX-512 a pass covers
4 rows x 32 tokens (16 of the 32 registers hold accumulators), or for at most 16 tokens 8 rows x 16
tokens (each token vector read from the panel serves twice the rows), on AVX2 4 rows x 16 tokens.
Integer prefill runs wherever the integer decode dots do (act_quant not FLOAT);
STRATA_ACT_QUANT=float keeps the float path.

Shape legend: N (token, expert) rows, C columns, J = C / 32 sub-blocks, K unpacked rows
(ROWS_PER_ITEM), S token chunks, P = C / 2 column pairs, L int32 lanes of a vector.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import aligned, simd
from .act_quant import FLOAT, _block_stats, _round_block
from .simd import F32, I16, I32, I64
from .target import int_dot_width
from .prefill import chunk_spans
from .tiles import ROWS_PER_ITEM, TOKENS_PER_ITEM
from .twins import serial_twin

SUB = 32  # columns per x scale and per weight factor
INT_DOT_WIDTH = int_dot_width()
LANES = INT_DOT_WIDTH // 2  # int32 lanes of one pmaddwd result: 16 on AVX-512BW, 8 on AVX2
PASS_ROWS = 4  # weight rows per micro-kernel pass
PASS_VECTORS = 2  # token vectors per pass: 2 x LANES tokens
TINY = np.float32(1e-30)
PARALLEL_MIN_PANELS = 4  # fewer token chunks are rounded serially (no parallel region to open)


def x_levels(weight_max):
    """The largest |x| after rounding for integer weights of |w| <= weight_max: int32 sums of 32 columns of
    products stay exact (Q6_K's 4096: 16383; the other formats: int16's 32767)."""
    return np.float32(min(32767, (2**31 - 1) // (SUB * weight_max)))


@njit(inline="always", nogil=True, cache=True)
def integer_prefill(act_quant):
    """Whether prefill multiplies in int16 for this act_quant code."""
    return act_quant != FLOAT and INT_DOT_WIDTH >= 16


def unpack_row_i16_intrinsic(block_fn, block_bytes, block_size):
    """An intrinsic f(w uint8 [R, B], r, dst int16 [C], factors f32 [J], mins f32 [J]) -> None: row r of W as
    exact integers dst with weight[c] = factors[c // 32] * dst[c] - mins[c // 32].

    block_fn(builder, q, o) -> (runs, factors, mins) gives the block at byte o of row pointer q as its
    block_size / 32 runs <32 x i16>, and <block_size / 32 x float> factors and mins (mins None: all zero).
    """
    runs_per_block = block_size // SUB

    def impl(typingctx, w, r, dst, factors, mins):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and simd.contiguous(dst, factors, mins)
                and dst.dtype == types.int16):
            return None
        sig = types.void(w, r, dst, factors, mins)

        def codegen(context, builder, signature, args):
            wa = context.make_array(signature.args[0])(context, builder, value=args[0])
            row_bytes = cgutils.unpack_tuple(builder, wa.shape)[1]
            first = context.cast(builder, args[1], signature.args[1], types.int64)
            q = builder.gep(wa.data, [builder.mul(first, row_bytes)])
            dst_ptr, factor_ptr, min_ptr = (simd.data_ptr(context, builder, signature.args[i], args[i])
                                            for i in (2, 3, 4))
            num_blocks = builder.udiv(row_bytes, ir.Constant(I64, block_bytes))
            zeros = ir.Constant(simd.vec(F32, runs_per_block), None)

            def store(base, offset, value):
                ptr = builder.bitcast(builder.gep(base, [offset]), value.type.as_pointer())
                builder.store(value, ptr, align=1)

            def step(b, accs):
                runs, factors, mins = block_fn(builder, q, builder.mul(b, ir.Constant(I64, block_bytes)))
                first_col = builder.mul(b, ir.Constant(I64, block_size))
                for j, run in enumerate(runs):
                    store(dst_ptr, builder.add(first_col, ir.Constant(I64, SUB * j)), run)
                first_run = builder.mul(b, ir.Constant(I64, runs_per_block))
                store(factor_ptr, first_run, factors)
                store(min_ptr, first_run, zeros if mins is None else mins)
                return accs

            simd.row_loop(builder, num_blocks, step, [])
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"{block_fn.__name__}_unpack_row_i16"
    return intrinsic(impl)


def _outer_intrinsic(num_rows, num_vectors):
    """An intrinsic f(wq int16 [K, C], factors f32 [K, J], mins f32 [K, J], k, xq int16 [P, 2 * 64],
    dx f32 [J, 64], sums f32 [J, 64], t, res f32 [num_rows, >= n]) -> None, n = num_vectors * LANES:
    res[i, :n] = sum over j of factors[k + i, j] * dx[j, t:t + n] * (wq[k + i, 32j:32j + 32] . xq tokens t:t + n)
    - mins[k + i, j] * sums[j, t:t + n], for i < num_rows. xq holds column pair p of token t at [p, 2t:2t + 2]."""
    i16x = simd.vec(I16, 2 * LANES)
    i32x = simd.vec(I32, LANES)
    f32x = simd.vec(F32, LANES)

    def impl(typingctx, wq, factors, mins, k, xq, dx, sums, t, res):
        arrays = (wq, factors, mins, xq, dx, sums, res)
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
            return None
        if wq.dtype != types.int16 or xq.dtype != types.int16:
            return None
        sig = types.void(wq, factors, mins, k, xq, dx, sums, t, res)

        def codegen(context, builder, signature, args):
            tys = signature.args
            wa, fa, ma, xa, da, sa, ra = (context.make_array(tys[i])(context, builder, value=args[i])
                                          for i in (0, 1, 2, 4, 5, 6, 8))
            num_cols = cgutils.unpack_tuple(builder, wa.shape)[1]
            num_subs = cgutils.unpack_tuple(builder, fa.shape)[1]
            pair_stride = cgutils.unpack_tuple(builder, xa.shape)[1]  # int16 per column pair (128)
            token_stride = cgutils.unpack_tuple(builder, da.shape)[1]  # floats per sub-block row (64)
            first = context.cast(builder, args[3], tys[3], types.int64)
            t = context.cast(builder, args[7], tys[7], types.int64)
            rows = [builder.add(first, ir.Constant(I64, i)) for i in range(num_rows)]
            w_rows = [builder.bitcast(builder.gep(wa.data, [builder.mul(row, num_cols)]), I32.as_pointer())
                      for row in rows]  # a row's column pairs as int32
            x0 = builder.gep(xa.data, [builder.mul(t, ir.Constant(I64, 2))])

            def sub_block(j, accs):
                dots = [[None] * num_vectors for _ in range(num_rows)]
                for p in range(SUB // 2):
                    pair = builder.add(builder.mul(j, ir.Constant(I64, SUB // 2)), ir.Constant(I64, p))
                    base = builder.gep(x0, [builder.mul(pair, pair_stride)])
                    xv = [simd.load_at(builder, base, ir.Constant(I64, 2 * LANES * v), i16x)
                          for v in range(num_vectors)]
                    for i, w_row in enumerate(w_rows):
                        word = builder.load(builder.gep(w_row, [pair]))
                        wv = builder.bitcast(builder.shuffle_vector(
                            builder.insert_element(ir.Constant(simd.vec(I32, 1), None), word, ir.Constant(I32, 0)),
                            ir.Constant(simd.vec(I32, 1), None), ir.Constant(simd.vec(I32, LANES), [0] * LANES)), i16x)
                        for v in range(num_vectors):
                            prod = simd.madd_i16(builder, wv, xv[v], INT_DOT_WIDTH)
                            dots[i][v] = prod if dots[i][v] is None else builder.add(dots[i][v], prod)
                at = builder.add(builder.mul(j, token_stride), t)
                dxv = [simd.load_at(builder, da.data, builder.add(at, ir.Constant(I64, LANES * v)), f32x)
                       for v in range(num_vectors)]
                sv = [simd.load_at(builder, sa.data, builder.add(at, ir.Constant(I64, LANES * v)), f32x)
                      for v in range(num_vectors)]
                out = []
                for i, row in enumerate(rows):
                    cell = builder.add(builder.mul(row, num_subs), j)
                    factor = simd.splat(builder, builder.load(builder.gep(fa.data, [cell])), LANES)
                    low = simd.splat(builder, builder.load(builder.gep(ma.data, [cell])), LANES)
                    for v in range(num_vectors):
                        acc = accs[i * num_vectors + v]
                        scale = builder.fmul(factor, dxv[v], flags=simd.FAST)
                        acc = simd.fma(builder, builder.sitofp(dots[i][v], f32x), scale, acc)
                        out.append(builder.fsub(acc, builder.fmul(low, sv[v], flags=simd.FAST), flags=simd.FAST))
                return out

            accs = simd.row_loop(builder, num_subs, sub_block, [ir.Constant(f32x, None)] * (num_rows * num_vectors))
            res_stride = cgutils.unpack_tuple(builder, ra.shape)[1]
            for i in range(num_rows):
                for v in range(num_vectors):
                    offset = builder.add(builder.mul(ir.Constant(I64, i), res_stride), ir.Constant(I64, LANES * v))
                    ptr = builder.bitcast(builder.gep(ra.data, [offset]), f32x.as_pointer())
                    builder.store(accs[i * num_vectors + v], ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"outer_i16_rows{num_rows}_x{num_vectors * LANES}"
    return intrinsic(impl)


ONE_ROWS = 8 if LANES == 16 else PASS_ROWS  # rows of a one-vector pass (AVX-512's 32 registers hold 8 rows' sums)
_outer_one = _outer_intrinsic(ONE_ROWS, 1)
_outer_two = _outer_intrinsic(PASS_ROWS, PASS_VECTORS)


@njit(nogil=True, fastmath=True, cache=True)
def dot_tile_i16(wq, factors, mins, num_rows, xq, dx, sums, t0, t1, out, r0):
    """out[t0:t1, r0:r0 + num_rows] = x[t0:t1] @ W[:num_rows].T for t1 - t0 <= 64 and W given as (wq int16 [K, C],
    factors, mins f32 [K, J]) (K a multiple of ONE_ROWS, rows past num_rows finite), x as the chunk's panels
    (xq int16 [P, 128], dx, sums f32 [J, 64]; token_panels_i16)."""
    span = PASS_VECTORS * LANES
    res = np.empty((ONE_ROWS, span), dtype=np.float32)  # [rows, tokens]
    for p0 in range(t0, t1, span):
        p1 = min(p0 + span, t1)
        step = ONE_ROWS if p1 - p0 <= LANES else PASS_ROWS
        for k in range(0, num_rows, step):
            if p1 - p0 <= LANES:
                _outer_one(wq, factors, mins, k, xq, dx, sums, p0 - t0, res)
            else:
                _outer_two(wq, factors, mins, k, xq, dx, sums, p0 - t0, res)
            for t in range(p0, p1):
                for i in range(min(step, num_rows - k)):
                    out[t, r0 + k + i] = res[i, t - p0]


@njit(nogil=True, fastmath=True, cache=True)
def tile_i16(wq, factors, mins, xq, dx, sums, item, out):
    """dot_tile_i16 of work item (e, r0, t0, t1, s, r1) with its chunks' panels (token_panels_i16): tokens
    t0:t1 in chunks of TOKENS_PER_ITEM (chunk s, then s + 1, ...), the item's rows unpacked once for all."""
    s = item[4]
    for c0 in range(item[2], item[3], TOKENS_PER_ITEM):
        dot_tile_i16(wq, factors, mins, item[5] - item[1], xq[s], dx[s], sums[s], c0,
                     min(c0 + TOKENS_PER_ITEM, item[3]), out, item[1])
        s += 1


@njit(nogil=True, cache=True)
def unpacked_rows(num_cols, num_rows):
    """Work buffers of one integer prefill item of num_rows rows: (wq int16 [K, C], factors, mins f32 [K, J]),
    the rows past num_rows zero (a pass multiplies 4 or 8 rows; their results are dropped, but must stay finite),
    the others for the item to fill (zeroing them all cost 4-9 % of Q4_K [512, 2048] items' time)."""
    wq = np.empty((ROWS_PER_ITEM, num_cols), dtype=np.int16)
    factors = np.empty((ROWS_PER_ITEM, num_cols // SUB), dtype=np.float32)
    mins = np.empty((ROWS_PER_ITEM, num_cols // SUB), dtype=np.float32)
    wq[num_rows:] = 0
    factors[num_rows:] = 0
    mins[num_rows:] = 0
    return wq, factors, mins


@njit(nogil=True, cache=True)
def token_panels_i16(x, items, act_quant, levels):
    """x f32 [N, C] -> (xq int16 [S, P, 128], dx f32 [S, J, 64], sums f32 [S, J, 64]): token chunk s of the work
    items [W, 6] rounded per (token, 32 columns) to xq * dx with |xq| <= levels (x_levels), its column pairs
    interleaved by token, and the float sums of x over each 32 columns; zero past the chunk's end token.
    Empty (S = 0) unless integer_prefill(act_quant) and some item has several tokens; decode items (token chunk
    tiles.NO_CHUNK) get none."""
    spans = chunk_spans(items, integer_prefill(act_quant))  # [S, 2]
    if spans.shape[0] < PARALLEL_MIN_PANELS:
        return _panels_i16_serial(x, spans, levels)
    return _panels_i16(x, spans, levels)


@njit(parallel=True, nogil=True, fastmath=True, cache=True)
def _panels_i16(x, spans, levels):
    num_chunks, num_cols = spans.shape[0], x.shape[1]
    num_subs = num_cols // SUB
    xq = aligned.zeros(num_chunks * num_cols * TOKENS_PER_ITEM, np.int16).reshape(
        (num_chunks, num_cols // 2, 2 * TOKENS_PER_ITEM))  # [S, P, 128]
    dx = aligned.zeros(num_chunks * num_subs * TOKENS_PER_ITEM, np.float32).reshape(
        (num_chunks, num_subs, TOKENS_PER_ITEM))  # [S, J, 64]
    sums = aligned.zeros(num_chunks * num_subs * TOKENS_PER_ITEM, np.float32).reshape(
        (num_chunks, num_subs, TOKENS_PER_ITEM))  # [S, J, 64]
    for s in prange(num_chunks):
        _fill_panel_i16(x, spans[s, 0], spans[s, 1], levels, xq[s], dx[s], sums[s])
    return xq, dx, sums


@njit(nogil=True, fastmath=True, cache=True)
def _fill_panel_i16(x, t0, t1, levels, xq, dx, sums):
    """One chunk's panels, a 32-column block at a time: each token's 32 values rounded as the decode rounding does
    (act_quant's block intrinsics: the same bits under every caller's fast-math flags, which LLVM passes to what it
    inlines) into a small buffer, then the block's 16 column pairs stored as rows of the tokens' int32 pairs (a token
    at a time, its 32 values went to 32 places of 16 rows of the panel: 1.6 ns a value at C = 2048)."""
    num_tokens = t1 - t0
    tmp = np.zeros(SUB * TOKENS_PER_ITEM, dtype=np.int16)  # [64 tokens x 32 values]
    tmp_pairs = tmp.view(np.int32)  # [64 tokens x 16 column pairs]
    xq_pairs = xq.view(np.int32)  # [P, 64]: column pair p of token t at [p, t]
    for j in range(x.shape[1] // SUB):
        for tt in range(num_tokens):
            row = x[t0 + tt]
            amax, total = _block_stats(row, j)
            sums[j, tt] = total
            if amax < TINY:  # all zero, or too small for levels / amax to stay finite: no integer part
                tmp_pairs[SUB // 2 * tt:SUB // 2 * (tt + 1)] = 0
                continue
            dx[j, tt] = amax / levels
            _round_block(row, j, levels / amax, tmp, SUB * tt, -1)
        for q in range(SUB // 2):
            p = SUB // 2 * j + q
            for tt in range(num_tokens):
                xq_pairs[p, tt] = tmp_pairs[SUB // 2 * tt + q]


_panels_i16_serial = serial_twin(_panels_i16)
