"""The word-lookup int16 decode dot of MXFP4 and IQ4_NL (cpu_kernels.table_words, AVX-512 VBMI targets) against
NumPy float64 references, with and without vpdpwssd, and the formats' public kernels on rows long enough for it
(the format tests' rows of 3 blocks run the generic tail only)."""
import importlib

import gguf
import numpy as np
import pytest
from numba import njit

from cpu_kernels import simd, table_words
from cpu_kernels.act_quant import ACT_QUANTS, quantize_rows
from cpu_kernels.tiles import work_items

pytestmark = pytest.mark.skipif(not table_words.AVAILABLE, reason="the target has no AVX-512 VBMI")

R = 37  # odd rows: 4-row streams and single rows
C = 9 * 32  # two 4-block steps and one tail block
SCALES = {"mxfp4": table_words.e8m0_scales, "iq4_nl": table_words.half_scales}
QS_AT = {"mxfp4": 1, "iq4_nl": 2}


def rows_dot(fmt, vnni):
    """A decode dot loop (as quant_driver's rows_dot_i16) around a word dot built with or without vpdpwssd."""
    name = fmt.__name__.rsplit(".", 1)[1]
    block = table_words.word_dot(name, fmt.BLOCK_BYTES, QS_AT[name], fmt.KVALUES, SCALES[name],
                                 fmt._block_i16.tail, vnni)
    dot4 = simd.rows_dot_intrinsic(block, fmt.BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
    dot1 = simd.rows_dot_intrinsic(block, fmt.BLOCK_BYTES, 1)

    @njit(nogil=True, fastmath=True)
    def dot(w, r0, r1, xq, aux, out):
        groups, step, stride = simd.row_streams(r0, r1)
        for i in range(groups):
            dot4(w, r0 + i * step, stride, xq, aux, out)
        for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
            dot1(w, rr, xq, aux, out)

    return dot


def int16_x(x, words=True):
    """x f32 [1, C] -> (xq int16 [C], aux f32 [C/16]) as the word dot (words) or the generic block code reads it."""
    items = work_items(np.zeros(1, np.int64), np.array([0, 1]), 1, R)
    xq, aux = (table_words.quantize_rows_words if words else quantize_rows)(x, items, ACT_QUANTS["int16"])
    return xq[0], aux[0]


def test_word_order_keeps_every_value():
    x = np.random.default_rng(5).standard_normal((1, C)).astype(np.float32)
    (words, aux), (plain, plain_aux) = int16_x(x), int16_x(x, words=False)
    assert sorted(table_words.WORD_ORDER) == list(range(table_words.GROUP))
    steps = C // table_words.GROUP * table_words.GROUP
    for base in range(0, steps, table_words.GROUP):
        assert np.array_equal(words[base:base + table_words.GROUP], plain[base + table_words.WORD_ORDER])
    assert np.array_equal(words[steps:], plain[steps:]) and np.array_equal(aux, plain_aux)


def check(out, raw, fmt, x, act_rounding_bound):
    w = gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)  # [R, C]
    ref = w @ x[0].astype(np.float64)
    bound = C * np.finfo(np.float32).eps * (np.abs(w) @ np.abs(x[0]))
    bound += act_rounding_bound(x, np.abs(w), "int16")[0]
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) - bound)


@pytest.fixture(scope="module", params=["mxfp4", pytest.param("iq4_nl", marks=pytest.mark.slow)])
def fmt(request):
    return importlib.import_module(f"cpu_kernels.{request.param}")


@pytest.mark.parametrize("vnni", [True, False])
def test_word_dot_matches_reference(fmt, vnni, act_rounding_bound):
    raw = fmt.random_blocks(np.random.default_rng(0), (R, C), 0.02)  # [R, B]
    x = np.random.default_rng(1).standard_normal((1, C)).astype(np.float32)  # [1, C]
    out = np.full(R, np.nan, dtype=np.float32)
    rows_dot(fmt, vnni)(raw, 0, R, *int16_x(x), out)
    check(out, raw, fmt, x, act_rounding_bound)


def test_e8m0_factors_match_the_generic_block():
    """MXFP4's factor through vscalefps equals the generic block's (dx times e8m0_half, subnormals included) bit
    for bit: x one-hot, each row's blocks on one exponent byte 0..250, so each row's dot is one product."""
    from cpu_kernels import mxfp4

    rng = np.random.default_rng(2)
    cols = 4 * 32  # one step: the word dot alone
    raw = mxfp4.random_blocks(rng, (251, cols), 0.02).reshape(251, 4, 17)
    raw[:, :, 0] = np.arange(251)[:, None]
    raw = raw.reshape(251, -1)
    word = rows_dot(mxfp4, True)
    tail = simd.rows_dot_intrinsic(mxfp4._block_i16.tail, 17, 1)

    @njit(nogil=True, fastmath=True)
    def generic(w, xq, aux, out):
        for r in range(w.shape[0]):
            tail(w, r, xq, aux, out)

    for column in (0, 17, 40, 127):
        x = np.zeros((1, cols), np.float32)
        x[0, column] = rng.uniform(0.5, 2.0)
        got, want = np.empty(251, np.float32), np.empty(251, np.float32)
        word(raw, 0, 251, *int16_x(x), got)
        generic(raw, *int16_x(x, words=False), want)
        assert np.array_equal(got, want), column


@pytest.mark.slow
def test_public_kernels_on_long_rows(fmt, act_rounding_bound, prefill_rounding_bound):
    """matvec and a moe_matmul decode group through the format's own compiled dot (the word dot on this target,
    x rounded by its prepare), and a 33-token prefill of the same rows (prefill_i16, unchanged by the word dot)."""
    raw = fmt.random_blocks(np.random.default_rng(3), (2, R, C), 0.02)  # [E, R, B]
    x = np.random.default_rng(4).standard_normal((33, C)).astype(np.float32)  # [T, C]
    out = np.empty(R, dtype=np.float32)
    fmt.matvec(raw[1], x[0], out, act_quant="int16")
    check(out, raw[1], fmt, x[:1], act_rounding_bound)
    out = np.full((1, R), np.nan, dtype=np.float32)
    fmt.moe_matmul(raw, x[:1], np.array([1]), np.array([0, 1]), out, act_quant="int16")
    check(out[0], raw[1], fmt, x[:1], act_rounding_bound)
    out = np.empty((33, R), dtype=np.float32)
    fmt.matmul(raw[1], x, out, act_quant="int16")
    w = gguf.quants.dequantize(raw[1], fmt.QTYPE).astype(np.float64)  # [R, C]
    bound = C * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)
    bound += prefill_rounding_bound(fmt, x, np.abs(w), "int16")
    assert np.all(np.abs(out - x.astype(np.float64) @ w.T) <= bound)
