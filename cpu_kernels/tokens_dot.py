"""Decode dots of a few tokens against the same weight rows: the format's one-token block code (simd.rows_dot_intrinsic's
block_fn) run for every token on each block of a row as it is read, so the weight bytes are loaded and unpacked once
for all of them (the compiler merges the calls' identical weight code) while each token's products, conversions and
accumulation are the ones a one-token dot makes.

A prompt gives each of 512 experts ~5 of its 256 tokens (top-10): too few for a prefill tile (it computes 16 or 32
token lanes whatever the count), so they run as decode items, and one token at a time each unpacks the row again.

Shape legend: R rows, B bytes per row, N rows of x (tokens), Cx x values (or bytes) per row, A aux values per row.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from .simd import I64, data_ptr, hsum, row_loop

TOKENS_PER_PASS = 4  # tokens a pass over one row reads (then 2, then the one-token dot); one row a pass: more rows
# ran slower (bench/results/qwen3next.md, session 50)


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

            def blocks(fn, b, accs):
                o = builder.mul(b, ir.Constant(I64, block_bytes))
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
