"""Integer prefill (prefill_i16): token panels against a NumPy reference, sums that must not overflow, odd x,
whole-group items (their rows unpacked once for all token chunks) against chunk by chunk."""
import gguf
import numba
import numpy as np
import pytest

from cpu_kernels import aligned, prefill, prefill_i16, q4_k, q5_k, q6_k, q8_0
from cpu_kernels.act_quant import FLOAT, INT16
from cpu_kernels.tiles import (NO_CHUNK, PROMPT_ITEM_MAX_TOKENS, TOKENS_PER_ITEM, WHOLE_MIN_ROW_BYTES,
                               WHOLE_PANEL_BYTES, prefill_span, work_items)

needs_int = pytest.mark.skipif(not prefill_i16.integer_prefill(INT16), reason="integer prefill needs AVX2")


def _items(group_sizes, num_rows=16):
    row_starts = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)
    return work_items(np.arange(len(group_sizes), dtype=np.int64), row_starts, len(group_sizes), num_rows)


@needs_int
@pytest.mark.parametrize("group_sizes", [[70, 3], [64, 64, 70, 5, 40]], ids=["serial", "parallel"])
def test_token_panels_match_numpy(group_sizes):
    x = np.random.default_rng(0).standard_normal((sum(group_sizes), 96)).astype(np.float32)  # [N, C]
    x[1, 32:64] = 0.0  # an all-zero block
    items = _items(group_sizes)
    levels = np.float32(32767)
    xq, dx, sums = prefill_i16.token_panels_i16(x, items, INT16, levels)
    num_chunks = items[:, 4].max() + 1
    assert xq.shape == (num_chunks, 48, 128) and dx.shape == sums.shape == (num_chunks, 3, 64)
    panels = prefill.token_panels(x, items)  # the float prefill's, [S, C, 64]
    assert all(a.ctypes.data % aligned.ALIGN == 0 for a in (xq, dx, sums, panels))  # whole-vector loads in one line
    if len(group_sizes) > 2:
        assert num_chunks >= prefill_i16.PARALLEL_MIN_PANELS
    for s in range(num_chunks):
        t0, t1 = items[items[:, 4] == s][0, 2:4]
        blocks = x[t0:t1].reshape(t1 - t0, 3, 32)  # [t, J, 32]
        amax = np.abs(blocks).max(axis=2)  # [t, J]
        np.testing.assert_allclose(dx[s, :, :t1 - t0], (amax / levels).T, rtol=1e-6)
        np.testing.assert_allclose(sums[s, :, :t1 - t0], blocks.sum(axis=2).T, rtol=1e-5, atol=1e-5)
        got = xq[s].reshape(48, 64, 2)[:, :t1 - t0].transpose(1, 0, 2).reshape(t1 - t0, 96)  # back to [t, C]
        assert np.abs(got).max() <= levels
        scale = np.repeat(np.where(amax > 0, levels / np.maximum(amax, np.float32(1e-30)), 0), 32, axis=1)  # float32
        np.testing.assert_array_equal(got, np.rint(x[t0:t1] * scale))
        assert not xq[s].reshape(48, 64, 2)[:, t1 - t0:].any() and not dx[s, :, t1 - t0:].any()


def test_token_panels_are_empty_for_float_and_decode():
    x = np.ones((5, 64), dtype=np.float32)
    assert prefill_i16.token_panels_i16(x, _items([5]), FLOAT, np.float32(32767))[0].shape[0] == 0
    assert prefill_i16.token_panels_i16(x, _items([1, 1, 1, 1, 1]), INT16, np.float32(32767))[0].shape[0] == 0


def test_x_levels_keep_int32_sums_exact():
    assert prefill_i16.x_levels(32 * 128) == 16383  # Q6_K
    assert prefill_i16.x_levels(31 * 63) == 32767  # Q5_K, the largest of the others
    for weight_max in (8, 128, 15 * 63, 31 * 63, 32 * 128):
        assert 32 * weight_max * int(prefill_i16.x_levels(weight_max)) < 2**31


def _q6_k_extreme(num_rows, cols, d):
    """Q6_K rows whose every weight is d * (-128) * (-32), the largest |q * scale|."""
    block = np.zeros(q6_k.BLOCK_BYTES, dtype=np.uint8)  # quant bits 0: q = -32
    block[192:208] = 0x80  # int8 scales -128
    block[208:210] = np.array([d], dtype=np.float16).view(np.uint8)
    return np.tile(block, (num_rows, cols // 256))


def _q5_k_extreme(num_rows, cols, d):
    """Q5_K rows whose every weight is d * 63 * 31 (6-bit scales 63, mins 0, quants 31)."""
    block = np.zeros(q5_k.BLOCK_BYTES, dtype=np.uint8)
    block[0:2] = np.array([d], dtype=np.float16).view(np.uint8)
    block[4:8] = 0xFF  # scales 0-3: 63, top bits of scales 4-7: 3
    block[12:16] = 0x0F  # low bits of scales 4-7: 15; mins 0
    block[16:176] = 0xFF  # high bits and low nibbles: q = 31
    return np.tile(block, (num_rows, cols // 256))


@needs_int
@pytest.mark.parametrize("fmt, make", [(q6_k, _q6_k_extreme), (q5_k, _q5_k_extreme)], ids=["q6_k", "q5_k"])
def test_largest_products_do_not_overflow(fmt, make):
    raw = make(16, 512, 0.001)
    w = gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)
    assert np.all(w == w[0, 0]) and w[0, 0] > 0
    x = np.full((40, 512), 3.0, dtype=np.float32)  # every x rounds to +levels
    x[::2, :32] = -3.0
    out = np.empty((40, 16), dtype=np.float32)
    fmt.matmul(raw, x, out, act_quant="int16")
    ref = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(out, ref, rtol=1e-6)


@needs_int
def test_zero_and_tiny_blocks_of_x():
    raw = q8_0.random_blocks(np.random.default_rng(1), (16, 128), 0.02)
    x = np.random.default_rng(2).standard_normal((20, 128)).astype(np.float32)
    x[3] = 0.0
    x[5, 32:64] = 1e-35  # subnormal: levels / amax would overflow
    out = np.empty((20, 16), dtype=np.float32)
    q8_0.matmul(raw, x, out, act_quant="int16")
    ref = x.astype(np.float64) @ gguf.quants.dequantize(raw, q8_0.QTYPE).astype(np.float64).T
    assert np.all(np.isfinite(out)) and not out[3].any()
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max())


WHOLE_GROUPS = [150, 3, 70, 20, 64]  # [G] tokens: several chunks, decode, a partial second chunk, one, exactly one


def test_prefill_span():
    assert prefill_span(np.array([0, 100, 700]), 1) == 704  # one thread: every group whole
    assert prefill_span(np.array([0, 100, 700]), 2) == 128  # 700 // 8 = 87, to a whole chunk
    assert prefill_span(np.array([0, 2560]), 16) == TOKENS_PER_ITEM
    # at most the tokens whose panels (2.25 bytes a token and column) fit WHOLE_PANEL_BYTES, at least a chunk
    for cols in (2048, 4096, 1 << 16):
        span = prefill_span(np.array([0, 100, 700]), 1, cols)
        assert span == max(TOKENS_PER_ITEM, WHOLE_PANEL_BYTES * 4 // (9 * cols) // TOKENS_PER_ITEM * TOKENS_PER_ITEM)
        assert span == TOKENS_PER_ITEM or 9 * cols * span <= 4 * WHOLE_PANEL_BYTES


def test_whole_group_items_number_their_chunks_as_chunk_by_chunk():
    row_starts = np.concatenate([[0], np.cumsum(WHOLE_GROUPS)]).astype(np.int64)
    experts = np.arange(len(WHOLE_GROUPS), dtype=np.int64)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        whole = work_items(experts, row_starts, len(experts), 40, WHOLE_MIN_ROW_BYTES, True, True)  # [W, 6]
        short = work_items(experts, row_starts, len(experts), 40, WHOLE_MIN_ROW_BYTES - 1, True, True)
        wide = work_items(experts, row_starts, len(experts), 40, WHOLE_MIN_ROW_BYTES, True, True, 4096)  # 128 a span
    finally:
        numba.set_num_threads(threads)
    chunked = work_items(experts, row_starts, len(experts), 40, WHOLE_MIN_ROW_BYTES, True)
    np.testing.assert_array_equal(short, chunked)  # short rows keep chunk-sized items
    tiles = whole[whole[:, 4] != NO_CHUNK]
    sizes = np.asarray(WHOLE_GROUPS)[tiles[:, 0]]
    np.testing.assert_array_equal(tiles[:, 3] - tiles[:, 2], sizes)  # a group's tokens in one item a row range
    assert len(tiles) == 3 * sum(s > PROMPT_ITEM_MAX_TOKENS for s in WHOLE_GROUPS)  # 40 rows: 3 row ranges
    spans = prefill.chunk_spans(whole, True)  # [S, 2]
    np.testing.assert_array_equal(spans, prefill.chunk_spans(chunked, True))
    np.testing.assert_array_equal(spans, prefill.chunk_spans(wide, True))
    assert (wide[:, 3] - wide[:, 2]).max() == 128  # the 150-token group in two items
    assert np.all(spans[:, 1] - spans[:, 0] <= TOKENS_PER_ITEM)
    x = np.random.default_rng(3).standard_normal((row_starts[-1], 64)).astype(np.float32)
    for got, want in zip(prefill_i16.token_panels_i16(x, whole, INT16, np.float32(32767)),
                         prefill_i16.token_panels_i16(x, chunked, INT16, np.float32(32767))):
        np.testing.assert_array_equal(got, want)


@needs_int
@pytest.mark.parametrize("fmt, cols", [(q8_0, 1024), (q4_k, 2048)], ids=["q8_0", "q4_k"])
def test_whole_group_items_match_numpy_and_chunk_by_chunk(fmt, cols):
    """One thread runs the groups of more than 8 tokens as whole-group items (rows of >= 1 KiB); two threads
    (here: 232 rows / 8 = 29 tokens a span) chunk by chunk: the same products, bit for bit."""
    rng = np.random.default_rng(4)
    raw = fmt.random_blocks(rng, (len(WHOLE_GROUPS), 40, cols), 0.02)  # [E, R, B]: 40 rows, a partial row range
    assert raw.shape[-1] >= WHOLE_MIN_ROW_BYTES
    row_starts = np.concatenate([[0], np.cumsum(WHOLE_GROUPS)]).astype(np.int64)
    experts = np.array([3, 0, 4, 1, 2], dtype=np.int64)
    x = rng.standard_normal((row_starts[-1], cols)).astype(np.float32)  # [N, C]
    w = gguf.quants.dequantize(raw.reshape(-1, raw.shape[-1]), fmt.QTYPE).reshape(len(WHOLE_GROUPS), 40, cols)
    ref = np.concatenate([x[a:b].astype(np.float64) @ w[e].astype(np.float64).T
                          for e, a, b in zip(experts, row_starts[:-1], row_starts[1:])])
    outs = {}
    threads = numba.get_num_threads()
    try:
        for n in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(n)
            outs[n] = np.empty((row_starts[-1], 40), dtype=np.float32)
            fmt.moe_matmul(raw, x, experts, row_starts, outs[n], act_quant="int16")
    finally:
        numba.set_num_threads(threads)
    np.testing.assert_allclose(outs[1], ref, atol=2e-4 * np.abs(ref).max())
    for out in outs.values():
        np.testing.assert_array_equal(out, outs[1])
