"""The fused small ops of a decode step (ops.cu add_rmsnorm, qk_norm_rope) against the launches they replace (add_into
then rmsnorm; rmsnorm over the heads then rope_neox) and the NumPy references, on random data at decode (1 token)
and prefill (64, 512 tokens) sizes."""
import numpy as np
import pytest

from cpu_kernels.rope import inv_freq_f32

pytestmark = pytest.mark.gpu

TOKENS = [1, 64, 512]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("hidden", [2048, 2880, 96])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_add_rmsnorm(runtime, kernels, reference_kernels, num_tokens, hidden):
    rng = np.random.default_rng(num_tokens + hidden)
    x = (3 * rng.standard_normal((num_tokens, hidden))).astype(np.float32)
    y = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    dev_x, dev_y, dev_w = runtime.to_device(x), runtime.to_device(y), runtime.to_device(w)
    out = runtime.empty(x.shape, np.float32)
    kernels.add_rmsnorm(dev_x, dev_y, dev_w, 1e-6, out)
    two_x, two_out = runtime.to_device(x), runtime.empty(x.shape, np.float32)
    kernels.add_into(two_x, dev_y)
    kernels.rmsnorm(two_x, dev_w, 1e-6, two_out)
    np.testing.assert_array_equal(runtime.to_host(dev_x), runtime.to_host(two_x))
    assert rel_err(runtime.to_host(out), runtime.to_host(two_out)) < 1e-6
    ref_x, ref = x.copy(), np.empty_like(x)
    reference_kernels.add_rmsnorm(ref_x, y, w, 1e-6, ref)
    np.testing.assert_array_equal(runtime.to_host(dev_x), ref_x)
    assert rel_err(runtime.to_host(out), ref) < 1e-5


# (q heads, kv heads, head dim, rotated dims): Qwen3-30B-A3B, partial rotary (GLM-4.5's half), a 256-wide head
SHAPES = [(32, 4, 128, 128), (12, 2, 128, 64), (4, 1, 256, 256), (8, 8, 64, 64)]


@pytest.mark.parametrize("num_q,num_kv,head_dim,rotated", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_qk_norm_rope(runtime, kernels, reference_kernels, num_tokens, num_q, num_kv, head_dim, rotated):
    """q and k side by side (one token's qk view) and q alone (a prompt's), against the unfused launches."""
    rng = np.random.default_rng(num_tokens * head_dim + num_q)
    x = (3 * rng.standard_normal((num_tokens, num_q + num_kv, head_dim))).astype(np.float32)
    wq, wk = (rng.standard_normal(head_dim).astype(np.float32) for _ in range(2))
    positions = np.sort(rng.choice(8192, num_tokens, replace=False)).astype(np.int64)
    inv_freq = inv_freq_f32(1e6, head_dim)[:rotated // 2]
    dev_pos, dev_freq, dev_wq, dev_wk = map(runtime.to_device, (positions, inv_freq, wq, wk))
    for heads_of_q in (num_q, num_q + num_kv):  # q and k as one view; all heads with wq (a separate q array)
        fused = runtime.to_device(x)
        kernels.qk_norm_rope(fused, dev_wq, dev_wk, heads_of_q, 1e-6, dev_pos, dev_freq, 0.9)
        two = runtime.to_device(x)
        parts = [(two[:, :heads_of_q], dev_wq), (two[:, heads_of_q:], dev_wk)]
        for part, weight in parts:
            if part.shape[1]:
                rows = runtime.xp.ascontiguousarray(part).reshape(-1, head_dim)
                kernels.rmsnorm(rows, weight, 1e-6, rows)
                part[...] = rows.reshape(part.shape)
        kernels.rope_neox(two, dev_pos, dev_freq, 0.9)
        got = runtime.to_host(fused)
        assert np.abs(got - runtime.to_host(two)).max() < 1e-6 * np.abs(got).max()
        ref = x.copy()
        reference_kernels.qk_norm_rope(ref, wq, wk, heads_of_q, 1e-6, positions, inv_freq, 0.9)
        assert np.abs(got - ref).max() < 2e-5 * np.abs(ref).max()
        if rotated < head_dim:
            assert rel_err(got[..., rotated:], ref[..., rotated:]) < 1e-5  # the dims past the rotated ones: normed
