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
