"""Activations quantized once per call for the integer decode dots.

act_quant (the engine's STRATA_ACT_QUANT setting) picks how a decode matvec multiplies: "int16" (the default where the
target has AVX2 or AVX-512BW) rounds x to int16 per 32-value block with a float scale
(relative error ~1e-5 of the block's largest value) and dots it with the integer quants
through pmaddwd; "float" widens the quants to float32 and FMAs them with x; "int8" (opt-in)
rounds x to int8 per 32-value block (error up to 1/254 of the block's largest value, as
llama.cpp's q8_0 / q8_K activations) and dots it through vpdpbusd (AVX-512 VNNI / AVX-VNNI):
Q8_0, Q4_K and Q6_K have int8 dots, the other formats take their int16 dot, and a target
without VNNI takes int16 with a warning. Targets without AVX2 (ISA floor avx) always
take the float path: their integer vectors are 128 bits. Prompt chunks round x to int16 their
own way under int16 and int8 (prefill_i16), and multiply in float under float.

Shape legend: N rows of x, C columns, C/32 blocks per row.
"""
import functools
import logging

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from . import aligned
from .simd import F32, FAST, I32, data_ptr, hsum, lanes, load_at, splat, vec
from .target import int_dot_width, vnni_width

log = logging.getLogger(__name__)

QBLOCK = 32  # values per int16 / int8 block of x (one Q8_0 / Q4_0 block, one K-quant sub-block)
I16_MAX = np.float32(32767)
I8_MAX = np.float32(127)
FLOAT, INT16, INT8 = 0, 1, 2
ACT_QUANTS = {"float": FLOAT, "int16": INT16, "int8": INT8}  # name: the code kernels take
# Sub-block order of a 256-value super-block in int8 x for Q4_K / Q5_K, whose 64-byte quant loads hold
# sub-blocks (0, 2), (1, 3), (4, 6), (5, 7) (low and high nibbles of two 32-byte runs).
NIBBLE_ORDER = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.int64)


def _split_order():
    """[256]: the natural index (in a super-block) of the x value int16 x stores at each position for Q4_K.
    Q4_K's int16 dot reads 64 quant bytes as 32 int16 lanes and takes four vectors out of them with shifts and
    masks alone (low and high nibbles of the even and odd bytes); x is stored to match. Positions
    128h + 32v + i: v = 0, 1 the low nibbles (sub-block 4h, lanes 16-31 sub-block 4h + 2) of even and odd
    bytes, v = 2, 3 the high nibbles (sub-blocks 4h + 1 and 4h + 3)."""
    order = np.empty(256, dtype=np.int64)
    for h in range(2):
        for v in range(4):
            for i in range(32):
                sub_block = 4 * h + v // 2 + (2 if i >= 16 else 0)
                order[128 * h + 32 * v + i] = 32 * sub_block + 2 * (i % 16) + v % 2
    return order


SPLIT_ORDER = _split_order()


def _split_runs():
    """[8, 2]: where, in a super-block of int16 x in SPLIT_ORDER, the 16 even (column 0) and the 16 odd
    (column 1) values of each sub-block start; each run is contiguous."""
    runs = np.empty((8, 2), dtype=np.int64)
    for sub_block in range(8):
        for parity in range(2):
            start = int(np.flatnonzero(SPLIT_ORDER == QBLOCK * sub_block + parity)[0])
            assert np.array_equal(SPLIT_ORDER[start:start + 16], QBLOCK * sub_block + parity + 2 * np.arange(16))
            runs[sub_block, parity] = start
    return runs


SPLIT_RUNS = _split_runs()


def _vector_call(builder, name, v):
    """The float-vector LLVM intrinsic `name` (llvm.fabs, llvm.rint) applied to v."""
    full = f"{name}.v{v.type.count}f32"
    fn = builder.module.globals.get(full) or ir.Function(builder.module, ir.FunctionType(v.type, [v.type]), full)
    return builder.call(fn, [v])


def _block_vector(context, builder, sig, args):
    """<32 x float> of block j of the contiguous f32 row args[0] (args[1] = j)."""
    base = data_ptr(context, builder, sig.args[0], args[0])
    return load_at(builder, base, builder.mul(args[1], ir.Constant(args[1].type, QBLOCK)), vec(F32, QBLOCK))


@intrinsic
def _block_stats(typingctx, row, j):
    """(max |x|, sum of x) over block j of the contiguous f32 row: one <32 x float> load and two reduction trees
    (the plain loop's 32-step reductions did not vectorize)."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32):
        return None
    sig = types.UniTuple(types.float32, 2)(row, j)

    def codegen(context, builder, signature, args):
        v = _block_vector(context, builder, signature, args)
        m, width = _vector_call(builder, "llvm.fabs", v), QBLOCK
        while width > 1:
            width //= 2
            a, b = lanes(builder, m, range(width)), lanes(builder, m, range(width, 2 * width))
            m = builder.select(builder.fcmp_ordered(">", a, b), a, b)
        amax = builder.extract_element(m, ir.Constant(I32, 0))
        return context.make_tuple(builder, signature.return_type, [amax, hsum(builder, v)])

    return sig, codegen


@intrinsic
def _round_block(typingctx, row, j, scale, out, dst, parity_dst):
    """Round block j of the contiguous f32 row times `scale` to out's integers (int16 / int8, half to even,
    as np.rint). parity_dst < 0: the 32 values go to out[dst:dst + 32]; else the even-indexed 16 to out[dst:]
    and the odd-indexed 16 to out[parity_dst:] (Q4_K's SPLIT_ORDER)."""
    ok = (isinstance(row, types.Array) and row.ndim == 1 and row.layout == "C" and row.dtype == types.float32
          and isinstance(out, types.Array) and out.ndim == 1 and out.layout == "C"
          and out.dtype in (types.int16, types.int8))
    if not ok:
        return None
    sig = types.void(row, j, types.float32, out, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        v = builder.fmul(_block_vector(context, builder, signature, args), splat(builder, args[2], QBLOCK), flags=FAST)
        elem = ir.IntType(out.dtype.bitwidth)
        q = builder.fptosi(_vector_call(builder, "llvm.rint", v), vec(elem, QBLOCK))
        base = data_ptr(context, builder, signature.args[3], args[3])
        dst, parity_dst = args[4], args[5]
        with builder.if_else(builder.icmp_signed("<", parity_dst, ir.Constant(parity_dst.type, 0))) as (whole, split):
            with whole:
                builder.store(q, builder.bitcast(builder.gep(base, [dst]), vec(elem, QBLOCK).as_pointer()), align=1)
            with split:
                for start, first in ((dst, 0), (parity_dst, 1)):
                    half = lanes(builder, q, range(first, QBLOCK, 2))
                    builder.store(half, builder.bitcast(builder.gep(base, [start]), half.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


DEFAULT_ACT_QUANT = "int16"  # where the target has AVX2, else float (_supported)


def act_quant_code(act_quant):
    """The kernels' code for an act_quant name (None: DEFAULT_ACT_QUANT)."""
    if act_quant is None:
        act_quant = DEFAULT_ACT_QUANT
    if act_quant not in ACT_QUANTS:
        raise ValueError(f"act_quant={act_quant!r}: expected one of {', '.join(ACT_QUANTS)}")
    return _supported(act_quant)


def _supported(name):
    """The code of `name`, or of what the target runs instead (int8 -> int16 without VNNI, float without AVX2)."""
    if name == "int8" and not vnni_width():
        _warn_no_vnni()
        name = "int16"
    return ACT_QUANTS[name] if int_dot_width() >= 16 else FLOAT


@functools.cache
def _warn_no_vnni():
    log.warning("act_quant int8: the target CPU has no AVX-512 VNNI or AVX-VNNI; decode uses int16 activations")


@njit(inline="always", nogil=True, cache=True)
def without_int8(act_quant):
    """The code a format without int8 dots runs: int16 for int8."""
    return INT16 if act_quant == INT8 else act_quant


@njit(nogil=True, cache=True)
def decode_rows(x, items, wanted):
    """bool [N]: the rows of x that the decode dots read, if `wanted` and a work item [W, 6] has a single token or is
    a decode item (token chunk tiles.NO_CHUNK, -1: a prompt's several-token decode items dot int16 x too): its
    tokens' rows; else [0] (prefill rounds x its own way: prefill_i16). A prompt's rows in prefill items are not
    rounded here (most of a 256-token MoE call's)."""
    rows = np.zeros(0, dtype=np.bool_)
    for i in range(items.shape[0] if wanted else 0):
        if items[i, 3] - items[i, 2] == 1 or items[i, 4] < 0:
            if rows.shape[0] == 0:
                rows = np.zeros(x.shape[0], dtype=np.bool_)
            rows[items[i, 2]:items[i, 3]] = True
    return rows


@njit(nogil=True, cache=True)
def quantize_rows(x, items, act_quant):
    """x f32 [N, C] -> (xq int16 [N, C], aux f32 [N, C/16]); aux holds (scale, sum of x) per 32-value block,
    x ~= xq * scale, for the rows decode_rows names (the others undefined). Empty ([0, C], [0, C/16]) unless
    act_quant is INT16 and a work item [W, 6] has a single token or is a decode item."""
    return _quantize(x, decode_rows(x, items, act_quant == INT16))


@njit(nogil=True, cache=True)
def quantize_rows_split(x, items, act_quant):
    """quantize_rows with each 256-value super-block's int16 values in SPLIT_ORDER (aux stays in column order)."""
    return _quantize_split(x, decode_rows(x, items, act_quant == INT16))


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_split(x, rows):
    """quantize_rows_split of x's rows where rows [N] (or [0]: none) is true, rounded straight into SPLIT_ORDER:
    each sub-block's even and odd values are two contiguous runs there (SPLIT_RUNS), stored from one rounded
    vector."""
    xq, aux, inv = _quantized_arrays(x, rows.shape[0], np.int16)
    for n in range(rows.shape[0]):
        if not rows[n]:
            continue
        row = np.ascontiguousarray(x[n])
        _block_scales(row, I16_MAX, inv, aux[n])
        for j in range(x.shape[1] // QBLOCK):
            base, sub_block = j // 8 * 256, j % 8
            _round_block(row, j, inv[j], xq[n], base + SPLIT_RUNS[sub_block, 0], base + SPLIT_RUNS[sub_block, 1])
    return xq, aux


@njit(nogil=True, cache=True)
def quantize_rows_i8(x, items, act_quant, nibble_order):
    """x f32 [N, C] -> (xq int8 [N, C], aux f32 [N, C/16]) as quantize_rows, rounded to -127..127; empty unless
    act_quant is INT8 and a work item has a single token. nibble_order: each 256-value super-block's
    sub-blocks stored in NIBBLE_ORDER (aux stays in column order)."""
    return _quantize_i8(x, decode_rows(x, items, act_quant == INT8), nibble_order)


@njit(inline="always", nogil=True, cache=True)
def _quantized_arrays(x, num_rows, dtype):
    """The (xq [N, C] of dtype, aux f32 [N, C/16], inv f32 [C/32]) that quantizing rows of x's first num_rows
    fills."""
    num_blocks = x.shape[1] // QBLOCK
    return (aligned.empty(num_rows * x.shape[1], dtype).reshape((num_rows, x.shape[1])),
            aligned.empty(num_rows * 2 * num_blocks, np.float32).reshape((num_rows, 2 * num_blocks)),
            np.empty(num_blocks, dtype=np.float32))


@njit(nogil=True, fastmath=True, cache=True)
def _block_scales(row, levels, inv, aux):
    """inv [C/32] = levels / max|row over each block| (0 for all-zero blocks); aux [C/16] = (scale, sum) pairs."""
    for j in range(row.shape[0] // QBLOCK):
        amax, total = _block_stats(row, j)
        inv[j] = levels / amax if amax > 0 else np.float32(0)
        aux[2 * j] = amax / levels
        aux[2 * j + 1] = total


@njit(nogil=True, fastmath=True, cache=True)
def _quantize(x, rows):
    """quantize_rows of x's rows where rows [N] (or [0]: none) is true: block maxima and sums first, then the
    rounding, each block as one vector (_block_stats, _round_block)."""
    xq, aux, inv = _quantized_arrays(x, rows.shape[0], np.int16)
    for n in range(rows.shape[0]):
        if not rows[n]:
            continue
        row = np.ascontiguousarray(x[n])
        _block_scales(row, I16_MAX, inv, aux[n])
        for j in range(x.shape[1] // QBLOCK):
            _round_block(row, j, inv[j], xq[n], QBLOCK * j, -1)
    return xq, aux


@njit(nogil=True, fastmath=True, cache=True)
def _quantize_i8(x, rows, nibble_order):
    """quantize_rows_i8 of x's rows where rows [N] (or [0]: none) is true."""
    num_blocks = x.shape[1] // QBLOCK
    xq, aux, inv = _quantized_arrays(x, rows.shape[0], np.int8)
    slot = np.arange(num_blocks)  # [C/32]: where block j goes in xq
    if nibble_order:
        for j in range(num_blocks):
            slot[j] = j - j % 8 + np.argmax(NIBBLE_ORDER == j % 8)
    for n in range(rows.shape[0]):
        if not rows[n]:
            continue
        row = np.ascontiguousarray(x[n])
        _block_scales(row, I8_MAX, inv, aux[n])
        for j in range(num_blocks):
            _round_block(row, j, inv[j], xq[n], slot[j] * QBLOCK, -1)
    return xq, aux
