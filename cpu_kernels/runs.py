"""Block code of the formats whose blocks are runs of 32 small integers times a float factor, minus a min.

A format of this family (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, TQ2_0) describes its block once,
as `Runs`: per run j of 32 weights, int16 values v_j, a float factor f_j and optionally a float min m_j, or
(Q2_K, whose mins change every 16 weights) a float min g_k per group k of 16 weights:

    weight = f_j * v_j - m_j - g_k

`run_blocks` builds from that description the four pieces quant_driver.instance takes: the float decode dot
(`block`), the int16 decode dot (`block_i16`: one pmaddwd of v_j with the int16 x per run, the int32 dots of
two runs summed before one conversion and FMA with f_j * dx_j; the mins from x's float sums per 32 values,
group mins from x's integer sums per 16 values, which the rows of a dot loop share), the float unpacking of
prefill (`weights`) and the int16 unpacking of the integer prefill (`runs_i16`).
Table formats (IQ4_NL, IQ4_XS, MXFP4) map their 4-bit indices through a 16-entry table with `lookup16`,
one pshufb per 16 to 64 indices (where the target has AVX-512, IQ4_XS's int16 decode dot looks them up as words
instead, and MXFP4's and IQ4_NL's take cpu_kernels.table_words, four blocks a step, with AVX-512 VBMI).

Shape legend: R runs per block (1 or 8); `q` uint8 raw bytes, `o` a block's byte offset (i64 value).
"""
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import njit

from . import simd
from .half import u32_as_f32
from .simd import F32, I8, I16, I32, I64
from .target import int_dot_width

RUN = 32  # weights per run
INT_DOT_WIDTH = int_dot_width()


class Runs(NamedTuple):
    """A block as R runs: values (R x <32 x i16>), factors <R x float>, mins <R x float> or None, and group mins
    <2R x float> (one per 16 weights; R = 8 only) or None. paired: the values come two runs at a time in 4-bit
    order (table_runs), [run 2p weights 0-15, run 2p + 1 weights 0-15] then the weights 16-31 of both."""
    values: list
    factors: object
    mins: object = None
    group_mins: object = None
    paired: bool = False


def _swap_halves(builder, values):
    """Per two <32 x i16> a, b: [a 0-15, b 0-15] and [a 16-31, b 16-31] (its own inverse)."""
    out = []
    for a, b in zip(values[::2], values[1::2]):
        out += [builder.shuffle_vector(a, b, simd.const_vec(I32, [*range(16), *range(32, 48)])),
                builder.shuffle_vector(a, b, simd.const_vec(I32, [*range(16, 32), *range(48, 64)]))]
    return out


def paired_values(builder, runs):
    """The runs' values in Runs.paired order."""
    return runs.values if runs.paired else _swap_halves(builder, runs.values)


def natural_values(builder, runs):
    """The runs' values in weight order, one <32 x i16> per run."""
    return _swap_halves(builder, runs.values) if runs.paired else runs.values


# -- byte-level pieces ---------------------------------------------------------------------------------------

def offset(builder, o, at):
    return builder.add(o, ir.Constant(I64, at))


def load_bytes(builder, q, o, at, n):
    """<n x i8> of the block's bytes at..at + n."""
    return simd.load_at(builder, q, offset(builder, o, at), simd.vec(I8, n))


def nibbles(builder, q, o, at, n):
    """<2n x i8> of the n bytes at `at`: their low nibbles, then their high nibbles (0..15 each)."""
    packed = load_bytes(builder, q, o, at, n)
    low = builder.and_(packed, simd.splat_const(I8, n, 15))
    high = builder.lshr(packed, simd.splat_const(I8, n, 4))
    return simd.concat(builder, low, high)


def nibble_runs(builder, q, o, at, count):
    """count runs of 16 bytes from `at` as <32 x i8> each (ggml's 4-bit layout: weight l < 16 in the low nibble
    of byte l, weight 16 + l in its high nibble), two runs per load."""
    runs = []
    for first in range(0, count, 2):
        pair = min(2, count - first)
        both = nibbles(builder, q, o, at + 16 * first, 16 * pair)
        for k in range(pair):
            runs.append(simd.lanes(builder, both, [16 * k + i for i in range(16)]
                                   + [16 * pair + 16 * k + i for i in range(16)]))
    return runs


def crumb_runs(builder, q, o, at, count):
    """The 2-bit quants of ggml's K-quant layout (Q2_K, Q3_K, TQ2_0): 32 bytes from `at` + 32h hold runs 4h..4h + 3,
    run 4h + s in bits 2s..2s + 1 of each byte; count runs (a multiple of 4) as <32 x i8> in 0..3."""
    runs = []
    for h in range(count // 4):
        packed = load_bytes(builder, q, o, at + 32 * h, 32)
        for s in range(4):
            runs.append(builder.and_(builder.lshr(packed, simd.splat_const(I8, 32, 2 * s)),
                                     simd.splat_const(I8, 32, 3)))
    return runs


def fifth_bits(builder, q, o, at):
    """<32 x i8> of bit j of the little-endian u32 at `at`, as bit 4 of lane j (Q5_0 / Q5_1's high bits): the
    word read as a lane mask (one kmov and one masked move on AVX-512)."""
    mask = builder.bitcast(simd.load_at(builder, q, offset(builder, o, at), I32), simd.vec(ir.IntType(1), RUN))
    return builder.select(mask, simd.splat_const(I8, RUN, 16), ir.Constant(simd.vec(I8, RUN), None))


def widen(builder, values):
    """<32 x i8> -> <32 x i16>, sign-extended."""
    return builder.sext(values, simd.vec(I16, values.type.count))


def pshufb_width():
    """The widest pshufb of the compile target, in bytes: 64 (AVX-512BW), 32 (AVX2) or 16 (SSSE3): the byte
    width of its widest pmaddwd (the same features decide both)."""
    return 2 * INT_DOT_WIDTH


_PSHUFB = {64: "llvm.x86.avx512.pshuf.b.512", 32: "llvm.x86.avx2.pshuf.b", 16: "llvm.x86.ssse3.pshuf.b.128"}


def lookup16(builder, table, indices):
    """<n x i8> of table[indices] for a 16-entry int8 table and indices <n x i8> in 0..15: pshufb instructions
    of the target's width, the table in every 16-byte lane (LLVM has no variable shuffle of its own)."""
    from numba.core import cgutils

    width = pshufb_width()
    n = indices.type.count
    fnty = ir.FunctionType(simd.vec(I8, width), [simd.vec(I8, width)] * 2)
    fn = cgutils.get_or_insert_function(builder.module, fnty, _PSHUFB[width])
    lut = simd.const_vec(I8, [int(v) for v in table] * (width // 16))
    parts = [builder.call(fn, [lut, simd.lanes(builder, indices, [min(i, n - 1) for i in range(k, k + width)])])
             for k in range(0, n, width)]  # indices padded to whole instructions
    while len(parts) > 1:
        parts = [simd.concat(builder, parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    return parts[0] if parts[0].type.count == n else simd.lanes(builder, parts[0], range(n))


def table_runs(builder, q, o, at, count, table, paired=False):
    """nibble_runs mapped through `table` (16 int8 values) as <32 x i16>: two runs per pshufb; paired (an even
    count): in Runs.paired order, the halves of each pshufb as they come."""
    runs = []
    for first in range(0, count, 2):
        pair = min(2, count - first)
        both = lookup16(builder, table, nibbles(builder, q, o, at + 16 * first, 16 * pair))
        if paired:
            runs += [widen(builder, simd.lanes(builder, both, range(32 * k, 32 * k + 32))) for k in range(2)]
            continue
        for k in range(pair):
            runs.append(widen(builder, simd.lanes(builder, both, [16 * k + i for i in range(16)]
                                                  + [16 * pair + 16 * k + i for i in range(16)])))
    return runs


def e8m0_half(builder, e):
    """The float 2^(e - 128) of an E8M0 byte e (i8; ggml_e8m0_to_fp32_half), exact (subnormal for e < 2)."""
    e32 = builder.zext(e, I32)
    tiny = builder.shl(ir.Constant(I32, 0x00200000), e32)
    normal = builder.shl(builder.sub(e32, ir.Constant(I32, 1)), ir.Constant(I32, 23))
    return builder.bitcast(builder.select(builder.icmp_unsigned("<", e32, ir.Constant(I32, 2)), tiny, normal), F32)


@njit(inline="always", nogil=True, cache=True)
def e8m0_half_scalar(e):
    """The float32 2^(e - 128) of an E8M0 byte e, exactly as gguf's e8m0_to_fp32_half."""
    e = np.uint32(e)
    if e < 2:
        return u32_as_f32(np.uint32(0x00200000) << e)
    return u32_as_f32((e - np.uint32(1)) << np.uint32(23))


@njit(inline="always", nogil=True, cache=True)
def read_u32(row, at):
    """The little-endian u32 at byte `at` of row, as an int64."""
    return (np.int64(row[at]) | (np.int64(row[at + 1]) << 8) | (np.int64(row[at + 2]) << 16)
            | (np.int64(row[at + 3]) << 24))


def splat_int(builder, value, n):
    """A scalar integer broadcast to <n x int>."""
    v = builder.insert_element(ir.Constant(simd.vec(value.type, 1), None), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(simd.vec(I32, n), [0] * n))


def group_sums(builder, xvs):
    """<16 x i32> of the sums of the 16-value groups of 8 runs xvs (<32 x i16> each), in order: one pmaddwd
    with ones per run, then three rounds of pairwise sums. x alone: the rows of a dot loop share them."""
    ones = simd.splat_const(I16, RUN, 1)
    parts = [simd.madd_i16(builder, xv, ones, INT_DOT_WIDTH) for xv in xvs]  # <16 x i32>: 8 pair sums a group
    while len(parts) > 1:
        parts = [builder.add(builder.shuffle_vector(a, b, simd.const_vec(I32, range(0, 32, 2))),
                             builder.shuffle_vector(a, b, simd.const_vec(I32, range(1, 32, 2))))
                 for a, b in zip(parts[::2], parts[1::2])]
    return parts[0]


# -- the kernels' block code ---------------------------------------------------------------------------------

def run_blocks(name, describe, block_size):
    """(block, block_i16, weights, runs_i16) of a format whose describe(builder, q, o) gives the block at byte o
    of row q as Runs (see the module docstring); block_size / 32 runs per block. The int16 dot of a block of
    8 runs takes two runs per conversion (pairing two 32-weight blocks instead measured slower: their shuffles
    cost more than the conversions they save)."""
    num_runs = block_size // RUN
    f32x = simd.vec(F32, RUN)

    def run_weights(builder, runs):
        out = []
        for j, values in enumerate(natural_values(builder, runs)):
            w = builder.fmul(builder.sitofp(values, f32x), simd.lanes(builder, runs.factors, [j] * RUN),
                             flags=simd.FAST)
            if runs.mins is not None:
                w = builder.fsub(w, simd.lanes(builder, runs.mins, [j] * RUN), flags=simd.FAST)
            if runs.group_mins is not None:
                w = builder.fsub(w, simd.lanes(builder, runs.group_mins, [2 * j] * 16 + [2 * j + 1] * 16),
                                 flags=simd.FAST)
            out.append((RUN * j, w))
        return out

    def weights(builder, q, o):
        return run_weights(builder, describe(builder, q, o))

    def block(builder, q, o, b, xs, aux, acc):
        xo = builder.mul(b, ir.Constant(I64, block_size))
        for at, w in run_weights(builder, describe(builder, q, o)):
            xv = simd.load_at(builder, xs, builder.add(xo, ir.Constant(I64, at)), f32x)
            acc = simd.fma(builder, w, xv, acc)
        return acc

    def int_dot(builder, runs, num, b, xq, aux, acc):
        """acc <16 x float> += the `num` runs of Runs from block b's first run on . x, for int16 xq [C] and
        (dx, sum) pairs aux [C/16]: per two runs (lanes 0-7 the first, 8-15 the second) two pmaddwd, summed
        in int32, one conversion and one FMA with f_j * dx_j."""
        first = builder.mul(b, ir.Constant(I64, num_runs))  # run index
        pairs = simd.load_at(builder, aux, builder.mul(first, ir.Constant(I64, 2)), simd.vec(F32, 2 * num))
        dx = simd.lanes(builder, pairs, range(0, 2 * num, 2))  # [num]
        scales = builder.fmul(runs.factors, dx, flags=simd.FAST)
        if runs.mins is not None:
            terms = builder.fmul(runs.mins, simd.lanes(builder, pairs, range(1, 2 * num, 2)), flags=simd.FAST)
            acc = builder.fsub(acc, builder.shuffle_vector(terms, ir.Constant(terms.type, None), simd.const_vec(
                I32, list(range(num)) + [num] * (16 - num))), flags=simd.FAST)
        xo = builder.mul(first, ir.Constant(I64, RUN))
        i16x = simd.vec(I16, RUN)
        xvs = [simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, RUN * j)), i16x) for j in range(num)]
        if num % 2:
            for j, values in enumerate(natural_values(builder, runs)):
                dots = simd.madd_i16(builder, values, xvs[j], INT_DOT_WIDTH)  # <16 x i32>
                acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)), simd.lanes(builder, scales, [j] * 16),
                               acc)
        else:
            values = paired_values(builder, runs)
            for p in range(num // 2):
                halves = _swap_halves(builder, xvs[2 * p:2 * p + 2])
                dots = builder.add(*(simd.madd_i16(builder, v, xv, INT_DOT_WIDTH)
                                     for v, xv in zip(values[2 * p:2 * p + 2], halves)))
                acc = simd.fma(builder, builder.sitofp(dots, simd.vec(F32, 16)),
                               simd.lanes(builder, scales, [2 * p] * 8 + [2 * p + 1] * 8), acc)
        if runs.group_mins is not None:
            sums = builder.fmul(builder.sitofp(group_sums(builder, xvs), simd.vec(F32, 16)),
                                simd.lanes(builder, dx, [k // 2 for k in range(16)]), flags=simd.FAST)
            acc = builder.fsub(acc, builder.fmul(runs.group_mins, sums, flags=simd.FAST), flags=simd.FAST)
        return acc

    def block_i16(builder, q, o, b, xq, aux, acc):
        return int_dot(builder, describe(builder, q, o), num_runs, b, xq, aux, acc)

    def runs_i16(builder, q, o):
        runs = describe(builder, q, o)
        return natural_values(builder, runs), runs.factors, runs.mins

    block.acc_type, block_i16.acc_type = f32x, simd.vec(F32, 16)
    for fn in (block, block_i16, weights, runs_i16):
        fn.__name__ = f"{name}_{fn.__name__}"
    return block, block_i16, weights, runs_i16
