"""Paged attention: through a shuffled block table, over encoded caches (f16, bf16, int8), over part of
the keys with a log-sum-exp, and the merge of two parts, against dense NumPy softmax attention."""
import numpy as np
import pytest

from cpu_kernels import attention
from hybrid import kv_store

BT = 16  # positions per block in these tests
# lse, k_scale, v_scale, window as hybrid.backends.cpu.paged_attention passes them: every argument given, so the
# tests run the engine's compiled instances (an omitted array default is keyed by its id(), compiled anew each run)
NO_EXTRAS = (attention.NO_LSE, attention.NO_SCALES, attention.NO_SCALES, 0)


def paged(x, table, num_blocks):
    """x [S, ...] (S = len(table) * BT) -> pool [num_blocks, BT, ...] holding block b at table[b], NaN elsewhere."""
    pool = np.full((num_blocks, BT) + x.shape[1:], np.nan if x.dtype.kind == "f" else 0, dtype=x.dtype)
    pool[table] = x.reshape(len(table), BT, *x.shape[1:])
    return pool


def dense_attention(q, k, v, start, key_lo=0, key_hi=None):
    """float64 softmax attention of q [T, Hq, D] over k, v [S, Hkv, D]: (out [T, Hq, D], lse [T, Hq])."""
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape)
    lse = np.full((num_tokens, num_heads), -np.inf)
    for t in range(num_tokens):
        hi = start + t + 1 if key_hi is None else min(start + t + 1, key_hi)
        if hi <= key_lo:
            continue
        for h in range(num_heads):
            s = k[key_lo:hi, h // group].astype(np.float64) @ q[t, h] * 0.125
            lse[t, h] = s.max() + np.log(np.exp(s - s.max()).sum())
            out[t, h] = np.exp(s - lse[t, h]) @ v[key_lo:hi, h // group]
    return out, lse


def random_case(rng, num_tokens, start, hq=8, hkv=2, d=64):
    num_blocks = -(-(start + num_tokens) // BT)
    q = rng.standard_normal((num_tokens, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((num_blocks * BT, hkv, d)).astype(np.float32) for _ in range(2))
    k[start + num_tokens:] = v[start + num_tokens:] = np.nan  # positions past the valid ones must not be read
    table = rng.permutation(num_blocks + 3)[:num_blocks].astype(np.int32)  # shuffled, with unused blocks
    return q, k, v, table, num_blocks + 3


@pytest.mark.parametrize("num_tokens,start", [(1, 0), (1, 300), (37, 0), (9, 50), (64, 700)])
@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
def test_paged_f32_matches_dense(num_tokens, start, kernel):
    rng = np.random.default_rng(num_tokens + start)
    q, k, v, table, pool_blocks = random_case(rng, num_tokens, start)
    ours = np.empty_like(q)
    getattr(attention, kernel)(q, paged(k, table, pool_blocks), paged(v, table, pool_blocks), table, start, 0,
                               start + num_tokens, 0.125, ours, *NO_EXTRAS)
    ref, _ = dense_attention(q, k, v, start)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("dtype", ["f16", "bf16", "int8"])
@pytest.mark.parametrize("num_tokens,start", [(1, 300), (37, 0), (9, 50)])
@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
def test_encoded_cache_matches_decoded(dtype, num_tokens, start, kernel):
    rng = np.random.default_rng(num_tokens + start)
    q, k, v, table, pool_blocks = random_case(rng, num_tokens, start)
    k, v = np.nan_to_num(k), np.nan_to_num(v)  # encodings of NaN rows are not the point here
    (k_data, k_scale), (v_data, v_scale) = kv_store.encode(k, dtype), kv_store.encode(v, dtype)
    scales = ((paged(k_scale, table, pool_blocks), paged(v_scale, table, pool_blocks)) if dtype == "int8" else
              (attention.NO_SCALES, attention.NO_SCALES))
    ours = np.empty_like(q)
    getattr(attention, kernel)(q, paged(k_data, table, pool_blocks), paged(v_data, table, pool_blocks), table,
                               start, 0, start + num_tokens, 0.125, ours, attention.NO_LSE, *scales, 0)
    ref, _ = dense_attention(q, kv_store.decode(k_data, k_scale), kv_store.decode(v_data, v_scale), start)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("num_tokens,start,split", [(1, 700, 320), (37, 200, 64), (5, 0, 3), (1, 30, 31)])
def test_partial_ranges_and_merge(num_tokens, start, split):
    """Keys [0, split) and [split, ...) as two partial results with their lse, merged by log-sum-exp (as the
    GPU backend merges a RAM part's result with the VRAM part's), equal the whole."""
    rng = np.random.default_rng(split)
    q, k, v, table, pool_blocks = random_case(rng, num_tokens, start)
    kp, vp = paged(k, table, pool_blocks), paged(v, table, pool_blocks)
    parts = []
    for lo, hi in ((0, split), (split, start + num_tokens)):
        out, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
        attention.attention(q, kp, vp, table, start, lo, hi, 0.125, out, lse, *NO_EXTRAS[1:])
        ref_out, ref_lse = dense_attention(q, k, v, start, lo, hi)
        np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-5 * np.abs(ref_out).max() + 1e-30)
        finite = np.isfinite(ref_lse)
        assert (np.isneginf(lse) == ~finite).all()  # an empty range: lse -inf, out 0
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
        parts.append((out, lse))
    (out_a, lse_a), (out_b, lse_b) = parts
    best = np.maximum(lse_a, lse_b)
    w_a, w_b = np.exp(lse_a - best)[..., None], np.exp(lse_b - best)[..., None]  # an empty side weighs 0
    merged = (w_a * out_a + w_b * out_b) / (w_a + w_b)
    whole, _ = dense_attention(q, k, v, start)
    np.testing.assert_allclose(merged, whole, rtol=0, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("dtype,tol", [("f16", 1e-3), ("bf16", 8e-3), ("int8", 8e-3)])
def test_encodings_round_trip_within_their_precision(dtype, tol):
    x = np.random.default_rng(0).standard_normal((3, 40, 2, 64)).astype(np.float32)
    data, scale = kv_store.encode(x, dtype)
    assert data.dtype == kv_store.STORAGE[dtype]
    err = np.abs(kv_store.decode(data, scale) - x).max(axis=-1) / np.abs(x).max(axis=-1)
    assert err.max() <= tol  # per row, relative to the row's largest value
