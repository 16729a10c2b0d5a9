"""Integer prefill (prefill_i16): token panels against a NumPy reference, sums that must not overflow, odd x."""
import gguf
import numpy as np
import pytest

from cpu_kernels import prefill_i16, q5_k, q6_k, q8_0
from cpu_kernels.act_quant import FLOAT, INT16
from cpu_kernels.tiles import work_items

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
