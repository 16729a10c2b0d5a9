"""The int16 decode dot of the 32-weight 4-bit table formats (MXFP4, IQ4_NL) four blocks a step, where the target
has AVX-512 VBMI: the levels are looked up as words, no byte lookup or widening.

The generic block code (runs.table_runs) pays per block and row for a pshufb lookup, a sign extension to int16,
a pmaddwd, a conversion and an FMA, plus the block's factor: the dot is compute-bound at about half the DRAM read
on one core. Here a step reads four blocks (4 x 17 or 4 x 18 bytes) of a row as two overlapping 64-byte loads
and one vpermi2b gathers their 64 index bytes, ordered so that word w holds block k = w // 8's index bytes m and
8 + m (m = w % 8). Its four nibbles (bits 0-3, 4-7, 8-11, 12-15) are then weights m, 16 + m, 8 + m and 24 + m of
block k: each is looked up as a word by one vpermw (the level table repeated in its 32 entries, so the index
needs no mask, only a shift), and each such vector of levels dots with eight x values of every block: x is
stored in that order once per token (quantize_rows_words, WORD_ORDER), so each dot loads its x whole. The four dots sum
in int32 (vpdpwssd where the target has AVX-512 VNNI), lane i of the sum belonging to block i // 4, so one
conversion and one FMA serve four blocks. A block's factor comes from the same loads: MXFP4's E8M0 byte as
dx * 2^(e - 128) through vscalefps (exact, subnormals included), IQ4_NL's f16 through vcvtph2ps.

The integer dots are exact; the float result differs from the generic block code's by the order of its
roundings only. A row's last (blocks % 4) blocks take the generic code (`tail`), their x in column order.

Shape legend: `q` a row's bytes, `o` a step's first byte offset, b its first block's number; xq int16 [C]
(WORD_ORDER), aux f32 [C/16] of (dx, sum) pairs, one per 32 columns; N rows of x.
"""
import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils

from . import simd
from .act_quant import quantize_rows
from .simd import F32, I8, I16, I32, I64
from .target import has_byte_permutes, int_dot_width, vnni_width

STEP = 4  # blocks a step
AVAILABLE = has_byte_permutes() and int_dot_width() == 32  # vpermi2b, vpermb, vpermw on 512 bits
_X_AT = (0, 16, 8, 24)  # the first weight (in its block) of the nibble at bits 4s..4s + 3 of a word
GROUP = 32 * STEP  # x values a step reads
# [128]: the column (in a step's 4 blocks) of the x value stored at each position: 32 s + w holds the x of word w's
# nibble s, weight _X_AT[s] + w % 8 of block w // 8
WORD_ORDER = np.array([32 * (w // 8) + _X_AT[s] + w % 8 for s in range(4) for w in range(32)], dtype=np.int64)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _gather_indices(block_bytes, qs_at):
    """vpermi2b's indices into (bytes 0-63 of the step, bytes span - 64 .. span - 1): byte p of the result is
    block k's index byte m (p even) or 8 + m (p odd), k = p // 16, m = p // 2 % 8."""
    second = STEP * block_bytes - 64
    out = []
    for p in range(64):
        k, m = p // 16, p // 2 % 8
        at = block_bytes * k + qs_at + m + 8 * (p % 2)
        out.append(at if at < 64 else 64 + at - second)
    return out


def _int_dots(builder, words, xs, table, vnni):
    """<16 x i32>: the four nibble dots of `words` (<32 x i16>) with their x (xs: 4 x <32 x i16>) summed."""
    i16x, i32x = simd.vec(I16, 32), simd.vec(I32, 16)
    levels = simd.const_vec(I16, [int(table[i % 16]) for i in range(32)])  # vpermw reads index bits 0-4
    dots = None
    for s, xv in enumerate(xs):
        index = words if s == 0 else builder.lshr(words, simd.splat_const(I16, 32, 4 * s))
        values = _call(builder, "llvm.x86.avx512.permvar.hi.512", i16x, [levels, index])
        if dots is None:
            dots = simd.madd_i16(builder, values, xv, 32)
        elif vnni:
            dots = _call(builder, "llvm.x86.avx512.vpdpwssd.512", i32x,
                         [dots, builder.bitcast(values, i32x), builder.bitcast(xv, i32x)])
        else:
            dots = builder.add(dots, simd.madd_i16(builder, values, xv, 32))
    return dots


def word_dot(name, block_bytes, qs_at, table, scales, tail, vnni=None):
    """simd.rows_dot_intrinsic's block_fn for int16 x, four blocks a step: the format's blocks of `block_bytes`
    bytes, 16 index bytes at `qs_at`, levels `table` (16 int8); scales(builder, head, dx) -> <16 x float> the
    factor times dx of block i // 4 in lane i, head <64 x i8> the step's first 64 bytes, dx <16 x float> x's
    scale of block i // 4; tail: the generic block_i16 for the row's last blocks. vnni: sum the dots through
    vpdpwssd (None: where the target has AVX-512 VNNI). x comes from quantize_rows_words."""
    vnni = vnni_width() == 64 if vnni is None else vnni
    indices = simd.const_vec(I8, _gather_indices(block_bytes, qs_at))
    second = STEP * block_bytes - 64
    i8x64, i16x = simd.vec(I8, 64), simd.vec(I16, 32)

    def block(builder, q, o, b, xq, aux, acc):
        head = simd.load_at(builder, q, o, i8x64)
        rest = simd.load_at(builder, q, builder.add(o, ir.Constant(I64, second)), i8x64)
        qs = _call(builder, "llvm.x86.avx512.vpermi2var.qi.512", i8x64, [head, indices, rest])
        xo = builder.mul(b, ir.Constant(I64, 32))
        xs = [simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, 32 * s)), i16x) for s in range(4)]
        dots = _int_dots(builder, builder.bitcast(qs, i16x), xs, table, vnni)
        pairs = simd.load_at(builder, aux, builder.mul(b, ir.Constant(I64, 2)), simd.vec(F32, 2 * STEP))
        dx = simd.lanes(builder, pairs, [2 * (i // 4) for i in range(16)])
        return simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), scales(builder, head, dx), acc)

    block.blocks_per_step = STEP
    block.tail = tail
    block.acc_type = simd.vec(F32, 16)
    block.__name__ = f"{name}_words{'_vnni' if vnni else ''}"
    return block


def e8m0_scales(builder, head, dx):
    """MXFP4: <16 x float> dx_i * 2^(e - 128), e the E8M0 byte 0 of block i // 4 (byte 17 k of the step)."""
    pick = simd.const_vec(I8, [17 * (p // 16) if p % 4 == 0 else 0 for p in range(64)])
    e = _call(builder, "llvm.x86.avx512.permvar.qi.512", simd.vec(I8, 64), [head, pick])
    e = builder.and_(builder.bitcast(e, simd.vec(I32, 16)), simd.splat_const(I32, 16, 255))
    f32x = simd.vec(F32, 16)
    power = builder.fsub(builder.sitofp(e, f32x), ir.Constant(f32x, [128.0] * 16), flags=simd.FAST)
    return _call(builder, "llvm.x86.avx512.mask.scalef.ps.512", f32x,  # dx * 2^power, rounded to nearest
                 [dx, power, ir.Constant(f32x, None), ir.Constant(I16, -1), ir.Constant(I32, 4)])


def half_scales(builder, head, dx):
    """IQ4_NL: <16 x float> dx_i * d, d the f16 at bytes 0-1 of block i // 4 (byte 18 k of the step)."""
    pick = simd.const_vec(I8, [18 * (p // 8) + p % 2 if p < 32 else 0 for p in range(64)])
    halves = _call(builder, "llvm.x86.avx512.permvar.qi.512", simd.vec(I8, 64), [head, pick])
    halves = simd.lanes(builder, builder.bitcast(halves, simd.vec(I16, 32)), range(16))
    d = builder.fpext(builder.bitcast(halves, simd.vec(ir.HalfType(), 16)), simd.vec(F32, 16))
    return builder.fmul(d, dx, flags=simd.FAST)


@njit(nogil=True, cache=True)
def quantize_rows_words(x, items, act_quant):
    """act_quant.quantize_rows with each whole step's 128 int16 values in WORD_ORDER (xq int16 [N, C]; the last
    C % 128 values and aux f32 [N, C/16] stay in column order)."""
    xq, aux = quantize_rows(x, items, act_quant)
    step = np.empty(GROUP, dtype=np.int16)
    for n in range(xq.shape[0]):
        for base in range(0, xq.shape[1] // GROUP * GROUP, GROUP):
            for i in range(GROUP):
                step[i] = xq[n, base + WORD_ORDER[i]]
            xq[n, base:base + GROUP] = step
    return xq, aux
