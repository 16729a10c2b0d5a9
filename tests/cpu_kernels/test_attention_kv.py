"""Attention over encoded KV caches (f16, bf16, int8) equals attention over the decoded float32 values."""
import numpy as np
import pytest

from cpu_kernels import attention
from hybrid import kv_store


@pytest.mark.parametrize("dtype", ["f16", "bf16", "int8"])
@pytest.mark.parametrize("num_tokens,start", [(1, 300), (37, 0), (9, 50)])
@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
def test_encoded_cache_matches_decoded(dtype, num_tokens, start, kernel):
    rng = np.random.default_rng(num_tokens + start)
    hq, hkv, d = 8, 2, 64
    cache_len = start + num_tokens + 5  # positions past the valid ones must not be read
    q = rng.standard_normal((num_tokens, hq, d)).astype(np.float32)
    k = rng.standard_normal((cache_len, hkv, d)).astype(np.float32)
    v = rng.standard_normal((cache_len, hkv, d)).astype(np.float32)
    (k_data, k_scale), (v_data, v_scale) = kv_store.encode(k, dtype), kv_store.encode(v, dtype)
    scales = (k_scale, v_scale) if dtype == "int8" else ()
    ours = np.empty_like(q)
    getattr(attention, kernel)(q, k_data, v_data, start, 0.125, ours, *scales)
    ref = np.empty_like(q)
    attention.attention(q, kv_store.decode(k_data, k_scale), kv_store.decode(v_data, v_scale), start, 0.125, ref)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("dtype,tol", [("f16", 1e-3), ("bf16", 8e-3), ("int8", 8e-3)])
def test_encodings_round_trip_within_their_precision(dtype, tol):
    x = np.random.default_rng(0).standard_normal((3, 40, 2, 64)).astype(np.float32)
    data, scale = kv_store.encode(x, dtype)
    assert data.dtype == kv_store.STORAGE[dtype]
    err = np.abs(kv_store.decode(data, scale) - x).max(axis=-1) / np.abs(x).max(axis=-1)
    assert err.max() <= tol  # per row, relative to the row's largest value
