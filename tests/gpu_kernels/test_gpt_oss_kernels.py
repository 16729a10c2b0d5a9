"""gpt-oss's GPU kernels (sliding-window paged attention, attention sinks, scaled / partial RoPE, the top-k-then-
softmax router, the clamped SwiGLU with expert biases, the down projection's bias) against the NumPy references
(tests/gpu_kernels/conftest.py ReferenceKernels) on fresh random data; the references against the CPU kernels and a
dense softmax without a GPU."""
import numpy as np
import pytest

from cpu_kernels import attention
from cpu_kernels.rope import rope_neox_freqs
from hybrid.rope_freqs import YarnScaling, rope_freqs

from .test_kv_kernels import make_cache

YARN = YarnScaling(32.0, 4096, 32.0, 1.0, None, False)


def attention_case(rng, num_tokens, start, hq=8, hkv=2, d=64, bt=16):
    cache, k, v = make_cache(rng, "f32", start + num_tokens, hkv, d, bt)
    q = rng.standard_normal((num_tokens, hq, d)).astype(np.float32)
    return cache, k, v, q


def cpu_windowed(q, cache, start, window, sinks):
    """The CPU kernel's result (out, lse) over the same paged cache, sinks applied."""
    out = np.empty_like(q)
    lse = np.empty(q.shape[:2], np.float32)
    attention.attention(q, cache.k_pool, cache.v_pool, cache.table, start, 0, start + q.shape[0], 0.125, out, lse,
                        attention.NO_SCALES, attention.NO_SCALES, window)
    attention.apply_sinks(out, lse, sinks)
    return out, lse


CASES = [(1, 0, 8), (1, 300, 128), (37, 0, 16), (9, 50, 32), (40, 200, 7)]


@pytest.mark.parametrize("num_tokens,start,window", CASES)
def test_reference_window_and_sinks_match_cpu_kernels(reference_kernels, num_tokens, start, window):
    rng = np.random.default_rng(num_tokens + start)
    cache, _, _, q = attention_case(rng, num_tokens, start)
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    out, lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    reference_kernels.paged_attention("f32", q, *cache.args(), start, 0, 0.125, out, lse=lse, window=window)
    reference_kernels.attn_sinks(out, lse, sinks)
    ref_out, ref_lse = cpu_windowed(q, cache, start, window, sinks)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,start,window", CASES + [(1, 2000, 128), (64, 1000, 128)])
def test_window_attention_and_sinks(runtime, kernels, reference_kernels, num_tokens, start, window):
    rng = np.random.default_rng(num_tokens + start + window)
    cache, _, _, q = attention_case(rng, num_tokens, start)
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    ref, ref_lse = np.empty_like(q), np.empty(q.shape[:2], np.float32)
    reference_kernels.paged_attention("f32", q, *cache.args(), start, 0, 0.125, ref, lse=ref_lse, window=window)
    reference_kernels.attn_sinks(ref, ref_lse, sinks)
    dev = cache.on(runtime)
    out, lse = runtime.empty(q.shape, np.float32), runtime.empty(q.shape[:2], np.float32)
    kernels.paged_attention("f32", runtime.to_device(q), *dev.args(), start, 0, 0.125, out, lse=lse, window=window)
    kernels.attn_sinks(out, lse, runtime.to_device(sinks))
    np.testing.assert_allclose(runtime.to_host(out), ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(runtime.to_host(lse), ref_lse, rtol=0, atol=2e-5)


def rope_args():
    inv_yarn, scale = rope_freqs(150000.0, 64, yarn=YARN)
    inv_partial, _ = rope_freqs(10000.0, 64, rotary_dim=32)
    return [(inv_yarn, scale), (inv_partial, 1.0)]


@pytest.mark.parametrize("case", [0, 1])
def test_reference_rope_matches_cpu_kernel(reference_kernels, case):
    inv_freq, scale = rope_args()[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal((9, 4, 64)).astype(np.float32)
    positions = np.arange(100, 109, dtype=np.int64)
    ref = np.empty_like(x)
    rope_neox_freqs(x, positions, inv_freq, scale, ref)
    reference_kernels.rope_neox(x, positions, inv_freq, scale)
    np.testing.assert_allclose(x, ref, rtol=0, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [0, 1])
def test_rope_scaled_and_partial(runtime, kernels, case):
    inv_freq, scale = rope_args()[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal((37, 4, 64)).astype(np.float32)
    positions = np.arange(3000, 3037, dtype=np.int64)
    ref = np.empty_like(x)
    rope_neox_freqs(x, positions, inv_freq, scale, ref)
    dev = runtime.to_device(x)
    kernels.rope_neox(dev, runtime.to_device(positions), runtime.to_device(inv_freq), scale)
    np.testing.assert_allclose(runtime.to_host(dev), ref, rtol=0, atol=1e-5)


def moe_case(rng, num_tokens=21, num_experts=12, k=4, width=40, hidden=24):
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    ids = rng.integers(0, num_experts, (num_tokens, k)).astype(np.int32)
    order = rng.permutation(num_tokens * k).astype(np.int32)  # pair rows in some other order
    gate, up = (rng.standard_normal((len(order), width)).astype(np.float32) * 5 for _ in range(2))  # past the clamp
    biases = [rng.standard_normal((num_experts, n)).astype(np.float32) for n in (width, width, hidden)]
    rows = rng.standard_normal((len(order), hidden)).astype(np.float32)
    return logits, ids, order, gate, up, biases, rows


@pytest.mark.gpu
def test_router_glu_and_pair_bias(runtime, kernels, reference_kernels):
    rng = np.random.default_rng(7)
    logits, ids, order, gate, up, (gate_bias, up_bias, down_bias), rows = moe_case(rng)
    k = ids.shape[1]
    dev = runtime.to_device
    ref_ids, ref_w = np.empty(ids.shape, np.int32), np.empty(ids.shape, np.float32)
    reference_kernels.route_topk_softmax(logits, k, ref_ids, ref_w)
    got_ids, got_w = runtime.empty(ids.shape, np.int32), runtime.empty(ids.shape, np.float32)
    kernels.route_topk_softmax(dev(logits), k, got_ids, got_w)
    np.testing.assert_array_equal(runtime.to_host(got_ids), ref_ids)
    np.testing.assert_allclose(runtime.to_host(got_w), ref_w, rtol=1e-6, atol=1e-7)
    ref = np.empty_like(gate)
    reference_kernels.clamped_swiglu(gate, up, order, ids, gate_bias, up_bias, 1.702, 7.0, ref)
    out = dev(gate)
    kernels.clamped_swiglu(out, dev(up), dev(order), dev(ids), dev(gate_bias), dev(up_bias), 1.702, 7.0, out)
    np.testing.assert_allclose(runtime.to_host(out), ref, rtol=1e-6, atol=1e-5)
    ref_rows = rows.copy()
    reference_kernels.add_pair_bias(ref_rows, order, ids, down_bias)
    got_rows = dev(rows)
    kernels.add_pair_bias(got_rows, dev(order), dev(ids), dev(down_bias))
    np.testing.assert_allclose(runtime.to_host(got_rows), ref_rows, rtol=0, atol=1e-6)
