"""Decode dots of a few tokens against the same weight rows: the format's one-token block code
(simd.rows_dot_intrinsic's block_fn) run for every token on each block of a row as it is read, so the weight bytes
are loaded and unpacked once for all of them (the compiler merges the calls' identical weight code) while each
token's products, conversions and accumulation are the ones a one-token dot makes.

A prompt's expert groups of at most tiles.DECODE_MAX_TOKENS tokens are too small for a prefill tile (it computes 16
or 32 token lanes whatever the count), so they run as decode items; one token at a time, each unpacks the rows again.
A uniformly routed 256-token prompt over 512 experts (top-10) gives most experts ~5 tokens.

One row a pass (quant_driver.tokens_dot_i16 passes 4, then 2 tokens), the bytes of the rows a few on prefetched: two
rows a pass ran Q4_K ~5 % faster and Q6_K slower, four slower for both (bench/results/qwen3next.md, session 50).

Shape legend: R rows, B bytes per row, N rows of x (tokens), Cx x values (or bytes) per row, A aux values per row.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .simd import CACHE_LINE, I64, ROWS_IN_FLIGHT, data_ptr, hsum, load_prefetch_rows, prefetch, row_loop


def tokens_dot_intrinsic(block_fn, block_bytes, num_rows, num_tokens):
    """An intrinsic f(w uint8 [R, B], r, x [N, Cx], aux f32 [N, A], t, out f32 [N, R]) -> None:
    out[t + i, r + k] = W[r + k] . x[t + i] for i < num_tokens, k < num_rows, with the block code of
    simd.rows_dot_intrinsic (block_fn(builder, q, o, b, xs, aux, acc): xs and aux the token's rows); the caller keeps
    the rows and tokens in range."""
    def impl(typingctx, w, r, x, aux, t, out):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, x, aux, out)):
            return None
        if aux.dtype != types.float32 or out.dtype != types.float32:
            return None
        sig = types.void(w, r, x, aux, t, out)

        def codegen(context, builder, signature, args):
            w_ty, _, x_ty, aux_ty, _, out_ty = signature.args
            wa = context.make_array(w_ty)(context, builder, value=args[0])
            row_bytes = cgutils.unpack_tuple(builder, wa.shape)[1]
            x_cols, aux_cols, out_cols = (
                cgutils.unpack_tuple(builder, context.make_array(ty)(context, builder, value=v).shape)[1]
                for ty, v in ((x_ty, args[2]), (aux_ty, args[3]), (out_ty, args[5])))
            first = context.cast(builder, args[1], signature.args[1], types.int64)
            token = context.cast(builder, args[4], signature.args[4], types.int64)
            row_ids = [builder.add(first, ir.Constant(I64, k)) for k in range(num_rows)]
            token_ids = [builder.add(token, ir.Constant(I64, i)) for i in range(num_tokens)]
            rows = [builder.gep(wa.data, [builder.mul(row, row_bytes)]) for row in row_ids]
            xs_base, aux_base = data_ptr(context, builder, x_ty, args[2]), data_ptr(context, builder, aux_ty, args[3])
            xs = [builder.gep(xs_base, [builder.mul(t, x_cols)]) for t in token_ids]
            auxs = [builder.gep(aux_base, [builder.mul(t, aux_cols)]) for t in token_ids]
            num_blocks = builder.udiv(row_bytes, ir.Constant(I64, block_bytes))
            # the rows' bytes a few rows on are prefetched as they are read (a prompt's experts come from memory,
            # one row after another): PREFETCH_ROWS x ROWS_IN_FLIGHT rows on, as simd.rows_dot_intrinsic does for
            # neighbouring rows, clamped to W's last row
            last_row = builder.sub(cgutils.unpack_tuple(builder, wa.shape)[0], ir.Constant(I64, 1))
            ahead = builder.mul(load_prefetch_rows(builder), ir.Constant(I64, ROWS_IN_FLIGHT))
            later = []
            for row in row_ids:
                row = builder.add(row, ahead)
                row = builder.select(builder.icmp_signed(">", row, last_row), last_row, row)
                later.append(builder.gep(wa.data, [builder.mul(row, row_bytes)]))
            step_bytes = block_bytes * getattr(block_fn, "blocks_per_step", 1)
            lines = [ir.Constant(I64, k) for k in range(0, step_bytes, CACHE_LINE)]

            def blocks(fn, b, accs):
                o = builder.mul(b, ir.Constant(I64, block_bytes))
                if fn is block_fn:
                    for q in later:
                        for line in lines:
                            prefetch(builder, builder.gep(q, [builder.add(o, line)]))
                return [fn(builder, q, o, b, xs[i], auxs[i], accs[k * num_tokens + i])
                        for k, q in enumerate(rows) for i in range(num_tokens)]

            per_step = ir.Constant(I64, getattr(block_fn, "blocks_per_step", 1))
            num_steps = builder.udiv(num_blocks, per_step)
            accs = row_loop(builder, num_steps, lambda i, accs: blocks(block_fn, builder.mul(i, per_step), accs),
                            [ir.Constant(block_fn.acc_type, None)] * (num_rows * num_tokens))
            if hasattr(block_fn, "tail"):  # the last num_blocks % blocks_per_step blocks, one at a time
                done = builder.mul(num_steps, per_step)
                accs = row_loop(builder, builder.sub(num_blocks, done),
                                lambda i, accs: blocks(block_fn.tail, builder.add(done, i), accs), accs)
            outp = data_ptr(context, builder, out_ty, args[5])
            for k, row in enumerate(row_ids):
                for i, t in enumerate(token_ids):
                    acc = accs[k * num_tokens + i]
                    total = block_fn.finish(builder, acc) if hasattr(block_fn, "finish") else hsum(builder, acc)
                    builder.store(total, builder.gep(outp, [builder.add(builder.mul(t, out_cols), row)]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"{block_fn.__name__}_rows{num_rows}_tokens{num_tokens}"
    return intrinsic(impl)
