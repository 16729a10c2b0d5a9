"""Decode activations rounded to int16 or int8 (the act_quant setting): the rounding, the setting, the int8 dots,
end-to-end fidelity."""
import logging

import gguf
import numpy as np
import pytest

import hybrid
from cpu_kernels import act_quant as aq
from cpu_kernels import aligned, q4_k, q5_k, q6_k, q8_0
from cpu_kernels.tiles import DECODE_MAX_TOKENS, work_items
from hybrid.batch import Batch, SeqChunk

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11, 3, 77, 500, 21, 9]
DECODE_TOL = 2e-3  # the end-to-end tolerance of quantized files (test_model_vs_transformers)
# int8 decode vs the default, relative to max|logits|. Rounding x to int8 moves each value by up to 1/254 of its
# 32-value block's max (~0.5 % rms noise on each matvec output, measured 0.4-0.9 % per call), which compounds
# over the layers to 1.5-3 % of the largest logit at a typical step (measured medians 1.5e-2 Q8_0, 1.9e-2
# Q4_K_M, 2.9e-2 Q6_K; int16 shows the same order, 1.8e-4 for Q6_K the largest): INT8_TOL bounds the median
# step. A router whose top-k flips on that noise changes one step's logits by far more (measured 0.38 on one
# step of the small Q8_0 model), so single steps get INT8_STEP_TOL.
INT8_TOL = 5e-2
INT8_STEP_TOL = 0.5
# These random models' top two logits are often near-ties (gaps of ~0.02 against a logit std of 1-3), which
# int8 noise may swap: measured greedy agreement 16/16 steps Q8_0 and Q4_K_M, 12/16 Q6_K.
INT8_GREEDY_AGREEMENT = 0.75
INT8_FORMATS = [q8_0, q4_k, q5_k, q6_k]  # the formats with int8 (VNNI) dots
needs_vnni = pytest.mark.skipif(not aq.vnni_width(), reason="int8 dots need AVX-512 VNNI or AVX-VNNI")


def decode_items(num_rows):
    """Work items of num_rows one-token groups of one expert (a decode step's shape)."""
    return work_items(np.zeros(num_rows, np.int64), np.arange(num_rows + 1, dtype=np.int64), 1, 16)


def test_quantize_rows_rounds_each_block_to_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 96)) * np.repeat([[1e-3, 1.0, 50.0]], 32, axis=1)).astype(np.float32)  # [N, C]
    x[1, 32:64] = 0.0  # an all-zero block
    xq, aux = aq.quantize_rows(x, decode_items(3), aq.ACT_QUANTS["int16"])
    scale = aux[:, 0::2]  # [N, C/32]
    assert np.abs(xq).max() == 32767 and scale[1, 1] == 0.0
    assert xq.ctypes.data % aligned.ALIGN == 0 and aux.ctypes.data % aligned.ALIGN == 0  # the decode dots' rows
    assert np.all(np.abs(xq * np.repeat(scale, 32, axis=1) - x) <= np.repeat(scale, 32, axis=1) * 0.5001)
    np.testing.assert_allclose(aux[:, 1::2], x.reshape(3, 3, 32).sum(axis=2), rtol=1e-5, atol=1e-6)


def test_quantize_rows_skips_float_and_prefill():
    x = np.ones((40, 64), np.float32)
    assert aq.quantize_rows(x[:2], decode_items(2), aq.ACT_QUANTS["float"])[0].shape == (0, 64)
    prefill = work_items(np.zeros(1, np.int64), np.array([0, 40]), 1, 16)  # one 40-token group
    assert aq.quantize_rows(x, prefill, aq.ACT_QUANTS["int16"])[0].shape == (0, 64)


def test_a_prompt_call_rounds_only_the_rows_its_decode_items_read():
    """A prompt's groups of a few tokens (PROMPT_ITEMS decode items) and a lone token read x as int16, its
    prefill-sized group reads the panels: only the first ones' rows are rounded, as a decode call rounds them."""
    sizes = [3, DECODE_MAX_TOKENS + 30, 1, 2]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [G+1]
    items = work_items(np.arange(len(sizes), dtype=np.int64), starts, len(sizes), 16, 0, True)  # [W, 6]
    rows = aq.decode_rows(np.empty((starts[-1], 64), np.float32), items, True)  # [N]
    want = np.ones(starts[-1], bool)
    want[starts[1]:starts[2]] = False
    np.testing.assert_array_equal(rows, want)
    x = np.random.default_rng(2).standard_normal((starts[-1], 64)).astype(np.float32)  # [N, C]
    xq, aux = aq.quantize_rows(x, items, aq.INT16)
    one_by_one = [aq.quantize_rows(x[n:n + 1], decode_items(1), aq.INT16) for n in np.flatnonzero(want)]
    np.testing.assert_array_equal(xq[want], np.concatenate([q for q, _ in one_by_one]))
    np.testing.assert_array_equal(aux[want], np.concatenate([a for _, a in one_by_one]))


def test_split_order_is_the_nibble_split_of_each_super_block():
    """Q4_K's int16 x: position 128h + 32v + i holds, for v = 0 / 1 (low nibbles of even / odd quant bytes) and
    v = 2 / 3 (high nibbles), the value that byte's nibble multiplies; aux stays in column order."""
    assert sorted(aq.SPLIT_ORDER) == list(range(256))
    quant_byte = np.arange(256) % 32 + 32 * (np.arange(256) // 64)  # weight -> its quant byte (of 128)
    high = (np.arange(256) // 32) % 2 == 1  # odd sub-blocks are high nibbles
    for h in range(2):
        for v in range(4):
            weights = aq.SPLIT_ORDER[128 * h + 32 * v:128 * h + 32 * v + 32]
            assert (high[weights] == (v >= 2)).all() and (quant_byte[weights] % 2 == v % 2).all()
            assert list(quant_byte[weights][:16] // 2) == list(range(32 * h, 32 * h + 16))  # lane i: word i
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    xq, aux = aq.quantize_rows(x, decode_items(2), aq.INT16)
    split, split_aux = aq.quantize_rows_split(x, decode_items(2), aq.INT16)
    np.testing.assert_array_equal(split_aux, aux)
    for base in (0, 256):
        np.testing.assert_array_equal(split[:, base:base + 256], xq[:, base + aq.SPLIT_ORDER])


def test_quantize_rows_i8_rounds_each_block_to_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 512)) * rng.uniform(1e-3, 50.0, (3, 16)).repeat(32, axis=1)).astype(np.float32)
    x[1, 32:64] = 0.0  # an all-zero block
    for nibble_order in (False, True):
        xq, aux = aq.quantize_rows_i8(x, decode_items(3), aq.INT8, nibble_order)
        assert xq.dtype == np.int8 and np.abs(xq.astype(np.int64)).max() == 127
        if nibble_order:  # each super-block's sub-blocks stored as 0, 2, 1, 3, 4, 6, 5, 7
            xq = xq.reshape(3, 2, 8, 32)[:, :, np.argsort(aq.NIBBLE_ORDER)].reshape(3, 512)
        step = np.repeat(aux[:, 0::2], 32, axis=1)  # [N, C]
        assert step[1, 32] == 0.0 and np.all(xq[1, 32:64] == 0)
        assert np.all(np.abs(xq * step - x) <= step * 0.5001)
        np.testing.assert_allclose(aux[:, 1::2], x.reshape(3, 16, 32).sum(axis=2), rtol=1e-5, atol=1e-5)


def test_each_mode_quantizes_only_its_own_rows():
    x = np.ones((2, 64), np.float32)
    assert aq.quantize_rows(x, decode_items(2), aq.INT8)[0].shape == (0, 64)
    assert aq.quantize_rows_i8(x, decode_items(2), aq.INT16, False)[0].shape == (0, 64)
    tokens = DECODE_MAX_TOKENS + 1  # a group this long takes prefill tiles (shorter ones: one-token items)
    prefill = work_items(np.zeros(1, np.int64), np.array([0, tokens]), 1, 16)
    assert aq.quantize_rows_i8(np.ones((tokens, 64), np.float32), prefill, aq.INT8, False)[0].shape == (0, 64)


def representable(rng, shape):
    """Random x f32 [T, C] that int8 rounding keeps exactly: integers in -127..127 (each block's first 127) times
    a power of two per block, so the int8 dots must match a float64 reference to float32 accumulation error."""
    num_tokens, cols = shape
    q = rng.integers(-127, 128, size=(num_tokens, cols // 32, 32))
    q[:, :, 0] = 127
    scale = 2.0 ** rng.integers(-12, 2, size=(num_tokens, cols // 32, 1))
    return (q * scale).reshape(shape).astype(np.float32)


@needs_vnni
@pytest.mark.parametrize("fmt", INT8_FORMATS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("num_experts", [1, 64])  # one decode matvec; a decode step of 64 one-token groups
def test_int8_dots_match_numpy(fmt, num_experts):
    """The int8 dots against a float64 reference on x that int8 represents exactly: nothing but float32
    accumulation error (C * eps * |x| @ |W|.T) is allowed, so any wrong quant, sub-block order or offset fails.
    C = 2 super-blocks + 1 block for Q8_0 (the odd-block tail)."""
    rng = np.random.default_rng(1)
    cols = 544 if fmt is q8_0 else 512
    raw = fmt.random_blocks(rng, (num_experts, 37, cols), 0.02)  # [E, R, B]
    raw.setflags(write=False)
    x = representable(rng, (num_experts, cols))  # [N, C]: token n on expert n
    out = np.full((num_experts, 37), np.nan, np.float32)
    fmt.moe_matmul(raw, x, np.arange(num_experts), np.arange(num_experts + 1), out, act_quant="int8")
    w = gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)  # [E, R, C]
    ref = np.einsum("erc,ec->er", w, x.astype(np.float64))
    bound = cols * np.finfo(np.float32).eps * np.einsum("erc,ec->er", np.abs(w), np.abs(x.astype(np.float64)))
    assert np.all(np.abs(out - ref) <= bound), np.max(np.abs(out - ref) - bound)


def test_int8_without_vnni_falls_back_to_int16(monkeypatch, caplog):
    monkeypatch.setattr(aq, "vnni_width", lambda: 0)
    monkeypatch.setattr(aq, "int_dot_width", lambda: 32)
    aq._warn_no_vnni.cache_clear()
    with caplog.at_level(logging.WARNING, logger=aq.__name__):
        assert aq.act_quant_code("int8") == aq.INT16
    assert "no AVX-512 VNNI or AVX-VNNI" in caplog.text
    aq._warn_no_vnni.cache_clear()


def test_setting_names_and_default():
    int16 = aq.ACT_QUANTS["int16"] if aq.int_dot_width() >= 16 else aq.ACT_QUANTS["float"]
    assert aq.act_quant_code(None) == int16
    assert aq.act_quant_code("float") == aq.ACT_QUANTS["float"]
    with pytest.raises(ValueError, match="act_quant='int4'"):
        aq.act_quant_code("int4")


def decode_logits(llm, ids):
    """Logits [T, V] of ids read one token at a time (every matvec on the decode path)."""
    kv = llm.model.new_sequence(len(ids) + 1)
    return np.concatenate([llm.model.forward(Batch([SeqChunk(kv, kv.length, np.array([t]), "last")])) for t in ids])


@pytest.mark.parametrize("size,target", [("small", "Q8_0"), ("kquant", "Q4_K_M"),
                                         pytest.param("kquant", "Q6_K", marks=pytest.mark.slow)])
def test_int16_decode_matches_transformers(gguf_models, reference_logits, size, target):
    """Decode logits with int16 activations stay within the quantized-file tolerance of transformers, and
    within a quarter of it of the float path's (measured: 7e-5 Q8_0, 1.1e-4 Q4_K_M, 1.8e-4 Q6_K). Op by op: the
    compiled layers give the same logits bit for bit (tests/hybrid/test_compiled_decode.py), and their instances
    for float x would be compiled for this test alone."""
    path, ref_dir = gguf_models(size, target)
    ref = reference_logits(ref_dir, PROMPT_IDS)
    logits = {}
    for mode in ("float", "int16"):
        llm = hybrid.LLM(path, device="cpu", act_quant=mode, compiled_decode=False)
        logits[mode] = decode_logits(llm, PROMPT_IDS)
    scale = np.abs(ref).max()
    assert np.abs(logits["int16"] - ref).max() / scale <= DECODE_TOL
    assert np.abs(logits["int16"] - logits["float"]).max() / scale <= DECODE_TOL / 4


# Q4_K_M (the K-quant decode int8 is meant for) runs the compiled layers; the other two run op by op, whose int8
# matvec instances test_int8_dots_match_numpy compiles anyway (a compiled layer per format and mode costs ~45 s
# cold on a 2-core CI machine; compiled and op-by-op layers agree bit for bit in tests/hybrid/test_compiled_decode.py).
@needs_vnni
@pytest.mark.parametrize("size,target,compiled", [("small", "Q8_0", False), ("kquant", "Q4_K_M", True),
                                                  ("kquant", "Q6_K", False)])
def test_int8_decode_tracks_default(gguf_models, size, target, compiled):
    """act_quant int8 (opt-in) against the default (int16): the median step's decode logits within INT8_TOL
    of max|logits|, every step within INT8_STEP_TOL, and the same greedy token at most steps."""
    path, _ = gguf_models(size, target)
    logits = {}
    for mode in ("int16", "int8"):
        llm = hybrid.LLM(path, device="cpu", act_quant=mode, compiled_decode=compiled)
        logits[mode] = decode_logits(llm, PROMPT_IDS)
    step_errors = np.abs(logits["int8"] - logits["int16"]).max(axis=1) / np.abs(logits["int16"]).max()  # [T]
    assert np.median(step_errors) <= INT8_TOL and step_errors.max() <= INT8_STEP_TOL, step_errors
    agree = np.mean(logits["int8"].argmax(axis=1) == logits["int16"].argmax(axis=1))
    assert agree >= INT8_GREEDY_AGREEMENT, logits["int8"].argmax(axis=1) == logits["int16"].argmax(axis=1)
