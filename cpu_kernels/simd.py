"""Dot products of one 32-weight quant block with x, as explicit LLVM vector code (Numba intrinsics).

Written as plain loops, a block dot nests a 32-step loop in the loop over blocks;
LLVM unrolls the inner loop and then vectorizes the block loop with gathers, ~10x
slower than memory speed. These intrinsics load a block as one <32 x ...> vector,
so the block loop stays scalar and every block runs as a few wide instructions on
any x86 level (SSE to AVX-512 legalize the same IR).

Shape legend: C columns; `q` uint8 raw bytes, `x` float32 [C]; offsets are in elements.
"""
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic

_LANES = 32
_F32X = ir.VectorType(ir.FloatType(), _LANES)
_I32X = ir.VectorType(ir.IntType(32), _LANES)
_FAST = ("fast",)


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
def dot_i8_block(typingctx, q, qo, x, xo):
    """sum(int8(q[qo + j]) * x[xo + j] for j < 32) as float32 (a Q8_0 block without its scale)."""
    sig = types.float32(q, qo, x, xo)

    def codegen(context, builder, signature, args):
        qary, qoff, xary, xoff = args
        quants = _load(context, builder, signature.args[0], qary, qoff, ir.VectorType(ir.IntType(8), _LANES))
        weights = builder.sitofp(quants, _F32X)
        return _dot_x(context, builder, signature.args[2], xary, xoff, weights)

    return sig, codegen


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


def row_args(context, builder, signature, args):
    """(data pointers, number of bytes of the row) of intrinsic args (row uint8 [B], then float32 arrays)."""
    from numba.core import cgutils

    ptrs = [data_ptr(context, builder, ty, a) for ty, a in zip(signature.args, args)]
    row = context.make_array(signature.args[0])(context, builder, value=args[0])
    return ptrs, cgutils.unpack_tuple(builder, row.shape)[0]


def contiguous(*arys):
    """True if every argument is a C-contiguous 1-d array (what the row intrinsics read directly)."""
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arys)


PREFETCH_BYTES = 1024  # how far ahead of the weight bytes being read to prefetch


def prefetch(builder, byte_base, offset):
    """Hint the cache line at byte `offset` of an i8 pointer into L1 (never faults, even past the end).

    The dot loops consume weights far slower than a plain sum does, so without it too few
    cache misses are in flight to reach the DRAM bandwidth (measured: 5.5 GB/s instead of 15).
    """
    i8p = I8.as_pointer()
    fn = builder.module.globals.get("llvm.prefetch.p0")
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), name="llvm.prefetch.p0")
    ptr = builder.bitcast(builder.gep(byte_base, [offset]), i8p)
    builder.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
