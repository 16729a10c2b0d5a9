"""Decode dots as accurate as float32 activations at near the int16 dots' cost: x as int16 hi + lo, or (Q4_K on
targets with VNNI) as three int8 digits.

The int16 decode dots (act_quant INT16) round x to int16 per 32-value block, an error of up to 1/65534 of the
block's largest value; float x (act_quant FLOAT) avoids it at about twice the int16 dots' time, since each weight is
widened to float and FMA'd alone. Here x is rounded twice: hi = rint(x / dx) with dx = max|x| / 32767 over the
block, then the remainder lo = rint((x - hi dx) / (dx / LO_LEVELS)), so x = dx (hi + lo / LO_LEVELS) within
dx / (2 LO_LEVELS), ~6e-8 of the block's largest value: float32's own rounding. The dot runs each weight's int16
products twice, on hi and on lo, from one load and unpacking of its bytes: the formats' int16 block code called
twice a block (the compiler merges the two calls' weight loads), or Q4_K's own (the two int32 dots joined before
one conversion).

Q4_K where the target has VNNI takes x as rint(x / unit) = 65536 a + 256 m + l, three int8 digits of the same
resolution (unit = max|x| / LEVELS_MAX over 32 values): three vpdpbusd of the quant bytes (64 products each, where
a pmaddwd makes 32) per 64 weights, against four pmaddwd for hi + lo. Q4_K [8192, 2048] from memory at one thread:
0.57 ms, hi + lo 0.69 ms, int16 0.55 ms, float x 1.2 ms (bench/results/qwen3next.md).

x layout for the hi + lo block code: xq int16 [2C] holds per format block b (block_size values) its hi values, then
its lo values, each in the order the format's int16 dot reads (Q4_K: act_quant.SPLIT_ORDER in each super-block);
aux f32 [2C/16] the (dx, sum of x) pairs of the hi block's 32-value sub-blocks, then (dx / LO_LEVELS, 0) for the lo
block's (the mins of Q4_K / Q5_K take the float sums once). The format's block code reads block 2b for hi and
2b + 1 for lo. For the digits: xq int8 [3C], aux f32 [C/16] (quantize_levels).

Shape legend: R output rows, C columns, B bytes per row, T tokens.
"""
import hashlib
import sys

import numpy as np
from gguf import GGMLQuantizationType
from llvmlite import ir
from numba import njit, prange

from . import q4_0, q4_k, q5_k, q6_k, q8_0, simd
from .act_quant import NIBBLE_ORDER, QBLOCK, SPLIT_ORDER
from .kquant import INT_DOT_WIDTH, QK_K, SUB, _int_block_start, sub_block_pairs
from .quant_driver import source_digest
from .simd import I64
from .target import vnni_width
from .twins import renamed_copy

LO_LEVELS = 256.0  # lo's steps per hi step: |lo| <= 128, so a Q4_K pair's hi dots times 256 plus its lo dots fit int32
LEVEL_COUNT = 3  # int8 digits of x in the three-level (VNNI) form
LEVELS_MAX = 126.0 * 65536  # |x| / unit at most: the balanced top digit stays within 127
ROWS_PER_ITEM = 128  # rows a parallel iteration of the matvec
NATURAL = np.arange(256, dtype=np.int64)  # x order of the formats that read x as stored
LEVELS_ORDER = np.array([QBLOCK * NIBBLE_ORDER[p // QBLOCK] + p % QBLOCK for p in range(QK_K)])  # Q4_K's digits


def q4_k_block_hi_lo(builder, q, o, b, xq, aux, acc):
    """Q4_K's block b (at byte o of row q) . x for hi + lo int16 x: kquant.split_block_i16 with each pmaddwd of the
    unpacked quants done twice, on hi and on lo x, the two int32 dots joined as hi * LO_LEVELS + lo (|lo| <= 128:
    no overflow for 4-bit quants) before the one conversion and FMA per two sub-blocks."""
    i16x = simd.vec(simd.I16, SUB)  # 64 quant bytes as words, or 32 x values
    twice = builder.mul(b, ir.Constant(b.type, 2))
    factors, acc, xo = _int_block_start(builder, q, o, twice, aux, acc)
    factors = builder.fmul(factors, simd.splat_const(simd.F32, 8, 1.0 / LO_LEVELS), flags=simd.FAST)
    words = builder.bitcast(q, simd.I16.as_pointer())
    levels = simd.splat_const(simd.I32, 16, int(LO_LEVELS).bit_length() - 1)

    def mask(value):
        return simd.splat_const(simd.I16, SUB, value)

    def x_at(offset):
        return simd.load_at(builder, xq, builder.add(xo, ir.Constant(I64, offset)), i16x)

    for h in range(2):
        byte = builder.add(o, ir.Constant(I64, q4_k._QS + 2 * SUB * h))
        packed = simd.load_at(builder, words, builder.udiv(byte, ir.Constant(I64, 2)), i16x)  # bytes as words
        parts = [builder.and_(packed, mask(15)), builder.and_(builder.lshr(packed, mask(8)), mask(15)),
                 builder.and_(builder.lshr(packed, mask(4)), mask(15)), builder.lshr(packed, mask(12))]
        for pair in range(2):  # low nibbles: sub-blocks 4h, 4h + 2; high nibbles: 4h + 1, 4h + 3
            joined = None
            for base in (0, QK_K):  # hi x, then lo x (QK_K values on)
                if joined is not None:  # hi's dot shifted, then lo's added on: one chain of vpdpwssd
                    joined = builder.shl(joined, levels)
                for odd in range(2):
                    at = base + 4 * SUB * h + SUB * (2 * pair + odd)
                    dot = simd.madd_i16(builder, parts[2 * pair + odd], x_at(at), INT_DOT_WIDTH)
                    joined = dot if joined is None else builder.add(joined, dot)
            j = 4 * h + pair
            factor = simd.lanes(builder, factors, [j] * 8 + [j + 2] * 8)
            acc = simd.fma(builder, builder.sitofp(joined, simd.vec(simd.F32, 16)), factor, acc)
    return acc


q4_k_block_hi_lo.acc_type = simd.vec(simd.F32, 16)


_Q4_K_PAIRS = sub_block_pairs(q4_k._QS)


def q4_k_block_levels(builder, q, o, b, xq, aux, acc):
    """Q4_K's block b (at byte o of row q) . x for x as three int8 digits (quantize_levels): per pair of
    sub-blocks (64 nibbles as bytes, shared by the three digits) a chain of vpdpbusd (u8 quants x s8 digit), each
    digit's sums shifted up 8 bits before the next's are added (|sum| < 2^29: no overflow), then one conversion
    and FMA with d * scale_j * unit_j; the mins from the float sums of x (kquant._int_block_start)."""
    factors, acc, _ = _int_block_start(builder, q, o, b, aux, acc)
    base = builder.mul(b, ir.Constant(I64, LEVEL_COUNT * QK_K))
    eight = simd.splat_const(simd.I32, 16, 8)
    for i, (j0, j1, nibbles) in enumerate(_Q4_K_PAIRS(builder, q, o)):
        joined = ir.Constant(simd.vec(simd.I32, 16), None)
        for level in range(LEVEL_COUNT):  # most significant digit first
            if level:
                joined = builder.shl(joined, eight)
            at = builder.add(base, ir.Constant(I64, level * QK_K + 2 * SUB * i))
            joined = simd.dot_u8i8(builder, joined, nibbles, simd.load_at(builder, xq, at, simd.vec(simd.I8, 2 * SUB)))
        factor = simd.lanes(builder, factors, [j0] * 8 + [j1] * 8)
        acc = simd.fma(builder, builder.sitofp(joined, simd.vec(simd.F32, 16)), factor, acc)
    return acc


q4_k_block_levels.acc_type = simd.vec(simd.F32, 16)


def _split_blocks(block_i16):
    """block_fn(builder, q, o, b, xq, aux, acc) of the format's block code over block b's hi (block 2b of xq / aux)
    and lo (2b + 1)."""
    def block_hi_lo(builder, q, o, b, xq, aux, acc):
        twice = builder.mul(b, ir.Constant(b.type, 2))
        acc = block_i16(builder, q, o, twice, xq, aux, acc)
        return block_i16(builder, q, o, builder.add(twice, ir.Constant(b.type, 1)), xq, aux, acc)

    block_hi_lo.acc_type = block_i16.acc_type
    return block_hi_lo


@njit(nogil=True, cache=True)
def quantize_hi_lo(x, block_size, order, xq, aux):
    """x f32 [C] -> xq int16 [2C], aux f32 [2C/16] in the layout above; order [block_size]: the natural index (in a
    block) of the value each position of a block's xq holds."""
    per_block = block_size // QBLOCK
    for b in range(x.shape[0] // block_size):
        base = b * block_size
        for j in range(per_block):
            lo_j = base + j * QBLOCK
            amax, total = 0.0, 0.0
            for i in range(lo_j, lo_j + QBLOCK):
                amax = max(amax, abs(np.float64(x[i])))
                total += np.float64(x[i])
            dx = np.float32(amax / 32767.0)
            a = 2 * (base // 16) + 2 * j  # (dx, sum) pair of sub-block j in the hi block
            aux[a], aux[a + 1] = dx, total
            aux[a + per_block * 2], aux[a + per_block * 2 + 1] = dx / np.float32(LO_LEVELS), 0.0
        for p in range(block_size):
            v = np.float64(x[base + order[p]])
            dx = np.float64(aux[2 * (base // 16) + 2 * (order[p] // QBLOCK)])
            hi = np.rint(v / dx) if dx > 0 else 0.0
            xq[2 * base + p] = np.int16(hi)
            xq[2 * base + block_size + p] = np.int16(np.rint((v - hi * dx) / dx * LO_LEVELS) if dx > 0 else 0.0)



@njit(nogil=True, cache=True)
def quantize_levels(x, order, xq, aux):
    """x f32 [C] -> xq int8 [3C], aux f32 [C/16]: per 256-value block b, bytes 768b.. hold the block's most
    significant digits, then the middle ones, then the least, each 256 in `order` (the natural index in the
    block of each position's value); aux the (unit, sum of x) pairs of its 32-value sub-blocks. A value is
    rint(x / unit) = 65536 a + 256 m + l with digits a, m, l in -128..127 (balanced), unit = max|x| / LEVELS_MAX
    over its sub-block."""
    for b in range(x.shape[0] // QK_K):
        base = b * QK_K
        for j in range(QK_K // QBLOCK):
            amax, total = 0.0, 0.0
            for i in range(base + j * QBLOCK, base + (j + 1) * QBLOCK):
                amax = max(amax, abs(np.float64(x[i])))
                total += np.float64(x[i])
            aux[2 * (base // QBLOCK) + 2 * j] = np.float32(amax / LEVELS_MAX)
            aux[2 * (base // QBLOCK) + 2 * j + 1] = total
        for p in range(QK_K):
            unit = np.float64(aux[2 * (base // QBLOCK) + 2 * (order[p] // QBLOCK)])
            value = np.int64(np.rint(np.float64(x[base + order[p]]) / unit)) if unit > 0 else np.int64(0)
            low = ((value + 128) & 255) - 128
            value = (value - low) >> 8
            mid = ((value + 128) & 255) - 128
            o = LEVEL_COUNT * base + p
            xq[o], xq[o + QK_K], xq[o + 2 * QK_K] = np.int8((value - mid) >> 8), np.int8(mid), np.int8(low)

def rows_template(w, r0, r1, xq, aux, out):
    """out [R] rows r0:r1 = W[r0:r1] @ x, x as quantize_hi_lo leaves it."""
    groups, step, stride = simd.row_streams(r0, r1)
    for i in range(groups):
        _DOT_ROWS(w, r0 + i * step, stride, xq, aux, out)  # noqa: F821 (instance globals)
    for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
        _DOT_ROW(w, rr, xq, aux, out)  # noqa: F821


def matvec_template(w, xq, aux, out):
    """out [R] = W [R, B] @ x, rows split over the threads."""
    num_rows = w.shape[0]
    for item in prange((num_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM):
        _ROWS(w, item * ROWS_PER_ITEM, min(num_rows, (item + 1) * ROWS_PER_ITEM), xq, aux, out)  # noqa: F821


def matvec_serial_template(w, xq, aux, out):
    """out [R] = W [R, B] @ x on the calling thread."""
    _ROWS(w, 0, w.shape[0], xq, aux, out)  # noqa: F821


class SplitDot:
    """One format's exact dots: matvec(w, xq, aux, out) and matvec_serial, x from quantize(x): hi + lo int16 x, or
    three int8 digits (levels: Q4_K where the target has VNNI)."""

    def __init__(self, name, module, order, block=None, levels=False):
        self.block_size, self.order = module.BLOCK_SIZE, np.ascontiguousarray(order[:module.BLOCK_SIZE])
        self.levels = levels
        block = block or _split_blocks(module._block_i16)
        digest = hashlib.sha1((source_digest(module) + _own_digest()).encode()).hexdigest()[:8]
        names = dict(_DOT_ROWS=simd.rows_dot_intrinsic(block, module.BLOCK_BYTES, simd.ROWS_IN_FLIGHT),
                     _DOT_ROW=simd.rows_dot_intrinsic(block, module.BLOCK_BYTES, 1))
        suffix = f"{name}_{digest}"
        names["_ROWS"] = njit(nogil=True, fastmath=True, cache=True)(renamed_copy(rows_template, suffix, **names))
        self.matvec = njit(parallel=True, nogil=True, cache=True)(renamed_copy(matvec_template, suffix, **names))
        self.matvec_serial = njit(nogil=True, cache=True)(renamed_copy(matvec_serial_template, suffix, **names))

    def quantize(self, x):
        """x f32 [C] -> (xq int16 [2C], aux f32 [2C/16]), or with levels (xq int8 [3C], aux f32 [C/16])."""
        if self.levels:
            xq, aux = np.empty(LEVEL_COUNT * x.shape[0], np.int8), np.empty(x.shape[0] // 16, np.float32)
            quantize_levels(x, self.order, xq, aux)
            return xq, aux
        xq, aux = np.empty(2 * x.shape[0], np.int16), np.empty(x.shape[0] // 8, np.float32)
        quantize_hi_lo(x, self.block_size, self.order, xq, aux)
        return xq, aux

    def matmul(self, raw, x, out, serial):
        """out [T, R] = x [T, C] @ W.T for raw uint8 [R, B], a token at a time; serial: on the calling thread."""
        for t in range(x.shape[0]):
            xq, aux = self.quantize(x[t])
            (self.matvec_serial if serial else self.matvec)(raw, xq, aux, out[t])


def _own_digest():
    with open(sys.modules[__name__].__file__, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


T = GGMLQuantizationType
_FORMATS = {T.Q4_K: (q4_k, LEVELS_ORDER, q4_k_block_levels, True) if vnni_width() else
            (q4_k, SPLIT_ORDER, q4_k_block_hi_lo, False),
            T.Q5_K: (q5_k, NATURAL, None, False), T.Q6_K: (q6_k, NATURAL, None, False),
            T.Q8_0: (q8_0, NATURAL, None, False), T.Q4_0: (q4_0, NATURAL, None, False)}
_DOTS = {}


def split_dot(qtype):
    """The SplitDot of a format, or None for formats without one (their exact dots take float x)."""
    if qtype not in _FORMATS:
        return None
    found = _DOTS.get(qtype)
    if found is None:
        module, order, block, levels = _FORMATS[qtype]
        found = _DOTS[qtype] = SplitDot(T(qtype).name.lower(), module, order, block, levels)
    return found
