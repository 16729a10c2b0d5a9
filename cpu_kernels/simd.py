"""Quant-block dots with x as explicit LLVM vector code (Numba intrinsics).

Written as plain loops, a block dot nests a 32-step loop in the loop over blocks;
LLVM unrolls the inner loop and then vectorizes the block loop with gathers, ~10x
slower than memory speed. Here a block is loaded as <32 x ...> vectors, so every
block runs as a few wide instructions on any x86 level (SSE to AVX-512 legalize the
same IR): `dot_q4_block` for one block, and `rows_dot_intrinsic`, from which the
formats build whole-row loops over several rows at once with vector accumulators.

Shape legend: C columns; `q` uint8 raw bytes, `x` float32 [C]; offsets are in elements.
"""
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

_LANES = 32
_F32X = ir.VectorType(ir.FloatType(), _LANES)
_I32X = ir.VectorType(ir.IntType(32), _LANES)
FAST = _FAST = ("fast",)


def _lanes(first, count):
    """Shuffle mask selecting lanes first .. first + count - 1."""
    return ir.Constant(ir.VectorType(ir.IntType(32), count), list(range(first, first + count)))


def _load(context, builder, aryty, ary, offset, vecty):
    """Unaligned load of vecty from ary[offset:]."""
    data = context.make_array(aryty)(context, builder, value=ary).data
    ptr = builder.bitcast(builder.gep(data, [offset]), vecty.as_pointer())
    return builder.load(ptr, align=1, typ=vecty)


def _dot_x(context, builder, aryty, ary, offset, weights):
    """sum(weights <32 x float> * x[offset:offset + 32]) by a tree of shuffles and adds."""
    acc = builder.fmul(weights, _load(context, builder, aryty, ary, offset, _F32X), flags=_FAST)
    width = _LANES
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(acc, acc, _lanes(0, width))
        hi = builder.shuffle_vector(acc, acc, _lanes(width, width))
        acc = builder.fadd(lo, hi, flags=_FAST)
    return builder.extract_element(acc, ir.Constant(ir.IntType(32), 0))


@intrinsic
def dot_q4_block(typingctx, q, qo, x, xo):
    """sum((q[qo + j] & 15) - 8) * x[xo + j] + ((q[qo + j] >> 4) - 8) * x[xo + 16 + j] for j < 16) (a Q4_0 block, no scale)."""
    sig = types.float32(q, qo, x, xo)

    def codegen(context, builder, signature, args):
        qary, qoff, xary, xoff = args
        i8x16 = ir.VectorType(ir.IntType(8), _LANES // 2)
        packed = _load(context, builder, signature.args[0], qary, qoff, i8x16)
        lo = builder.and_(packed, ir.Constant(i8x16, 15))
        hi = builder.lshr(packed, ir.Constant(i8x16, 4))
        both = builder.shuffle_vector(lo, hi, _lanes(0, _LANES))  # low nibbles, then high nibbles
        centered = builder.sub(builder.zext(both, _I32X), ir.Constant(_I32X, 8))
        return _dot_x(context, builder, signature.args[2], xary, xoff, builder.sitofp(centered, _F32X))

    return sig, codegen


# Whole-row dots: one intrinsic loops over a row's blocks in LLVM IR with vector accumulators,
# so the only horizontal reduction is at the end of the row. The format modules build their
# row dots from these pieces.

F32 = ir.FloatType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


def vec(elem, n):
    return ir.VectorType(elem, n)


def const_vec(elem, values):
    return ir.Constant(vec(elem, len(values)), list(values))


def splat_const(elem, n, value):
    return ir.Constant(vec(elem, n), [value] * n)


def data_ptr(context, builder, aryty, ary):
    """The first element's address of a contiguous array argument."""
    return context.make_array(aryty)(context, builder, value=ary).data


def load_at(builder, base, offset, ty):
    """Unaligned load of ty from the element pointer `base` advanced by `offset` elements."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1, typ=ty)


def half_to_f32(builder, bits):
    """An i16 IEEE half -> float, exact, integer ops only (no F16C needed, no float32 subnormals made)."""
    h = builder.zext(bits, I32)
    mag = builder.and_(h, ir.Constant(I32, 0x7FFF))
    normal = builder.add(builder.shl(mag, ir.Constant(I32, 13)), ir.Constant(I32, 112 << 23))
    tiny = builder.bitcast(builder.fmul(builder.uitofp(mag, F32), ir.Constant(F32, 2.0**-24)), I32)
    out = builder.select(builder.icmp_unsigned("<", mag, ir.Constant(I32, 0x400)), tiny, normal)
    out = builder.or_(out, builder.shl(builder.and_(h, ir.Constant(I32, 0x8000)), ir.Constant(I32, 16)))
    return builder.bitcast(out, F32)


def load_half(builder, byte_base, offset):
    """The little-endian half at byte `offset` of an i8 pointer, as float."""
    return half_to_f32(builder, load_at(builder, byte_base, offset, I16))


def splat(builder, value, n):
    """A scalar float broadcast to <n x float>."""
    v = builder.insert_element(ir.Constant(vec(F32, 1), [0.0]), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(vec(I32, n), [0] * n))


def lanes(builder, v, indices):
    """<len(indices) x T> of v's lanes `indices`."""
    return builder.shuffle_vector(v, v, const_vec(I32, indices))


def hsum(builder, v):
    """The sum of a float vector's lanes, as a tree of halvings."""
    width = v.type.count
    while width > 1:
        width //= 2
        v = builder.fadd(lanes(builder, v, range(width)), lanes(builder, v, range(width, 2 * width)), flags=_FAST)
    return builder.extract_element(v, ir.Constant(I32, 0))


def fma(builder, a, b, acc):
    """acc + a * b with fast-math flags (LLVM fuses them where the target has FMA)."""
    return builder.fadd(acc, builder.fmul(a, b, flags=_FAST), flags=_FAST)


def row_loop(builder, count, body, init):
    """Run body(index i64, accs) -> accs for index in range(count) with accumulator values `init`; returns the last accs."""
    from numba.core import cgutils

    slots = [cgutils.alloca_once_value(builder, value) for value in init]
    with cgutils.for_range(builder, count) as loop:
        accs = body(loop.index, [builder.load(s) for s in slots])
        for slot, value in zip(slots, accs):
            builder.store(value, slot)
    return [builder.load(s) for s in slots]


def contiguous(*arys):
    """True if every argument is a C-contiguous 1-d array (what the row intrinsics read directly)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arys)


ROWS_IN_FLIGHT = 4  # rows one dot loop reads side by side: each is a sequential stream the L2 prefetcher follows


def rows_dot_intrinsic(block_fn, block_bytes, num_rows):
    """An intrinsic f(w uint8 [R, B], r, x f32 [C], aux f32 [A], out f32 [R]) -> None writing
    out[r:r + num_rows] = W[r:r + num_rows] @ x. The caller keeps r + num_rows <= R.

    block_fn(builder, q, o, b, xs, aux, acc) -> acc adds block b (at byte o of row pointer q) to
    the row's vector accumulator; xs and aux are float pointers (aux: per-format side data, such
    as sub-block sums of x; formats without it ignore it). Reading num_rows rows per loop keeps
    that many memory streams going at once: one row at a time, a dot loop consumes its stream too
    slowly for the prefetchers and reaches less than half the DRAM bandwidth (Q8_0, one core:
    5.5 GB/s one row at a time, 12 GB/s four rows at a time, 15 GB/s from L2; software prefetch
    added nothing over four streams).
    """
    from numba.core import cgutils

    def impl(typingctx, w, r, x, aux, out):
        if not (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C" and contiguous(x, aux, out)):
            return None
        sig = types.void(w, r, x, aux, out)

        def codegen(context, builder, signature, args):
            w_ty, _, x_ty, aux_ty, out_ty = signature.args
            wa = context.make_array(w_ty)(context, builder, value=args[0])
            row_bytes = cgutils.unpack_tuple(builder, wa.shape)[1]
            first = context.cast(builder, args[1], signature.args[1], types.int64)
            xs = data_ptr(context, builder, x_ty, args[2])
            aux_ptr = data_ptr(context, builder, aux_ty, args[3])
            outp = data_ptr(context, builder, out_ty, args[4])
            rows = [builder.gep(wa.data, [builder.mul(builder.add(first, ir.Constant(I64, k)), row_bytes)])
                    for k in range(num_rows)]
            num_blocks = builder.udiv(row_bytes, ir.Constant(I64, block_bytes))
            acc_ty = block_fn.acc_type

            def step(b, accs):
                o = builder.mul(b, ir.Constant(I64, block_bytes))
                return [block_fn(builder, q, o, b, xs, aux_ptr, acc) for q, acc in zip(rows, accs)]

            accs = row_loop(builder, num_blocks, step, [ir.Constant(acc_ty, None)] * num_rows)
            for k, acc in enumerate(accs):
                total = block_fn.finish(builder, acc) if hasattr(block_fn, "finish") else hsum(builder, acc)
                builder.store(total, builder.gep(outp, [builder.add(first, ir.Constant(I64, k))]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"{block_fn.__name__}_rows{num_rows}"
    return intrinsic(impl)
