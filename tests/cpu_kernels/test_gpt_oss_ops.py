"""gpt-oss's attention and RoPE parts on the CPU: sliding-window paged attention with sinks against a dense NumPy
softmax with the sink logit in its denominator (as HF's eager_attention_forward), partial ranges merged before
the sinks apply; YaRN frequencies and the scaled rotation against transformers' GptOssRotaryEmbedding."""
import numpy as np
import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from cpu_kernels import activation, attention, routing
from cpu_kernels.rope import rope_neox_freqs, rope_neox_freqs_serial
from hybrid.rope_freqs import YarnScaling, rope_freqs

from tests.cpu_kernels.test_attention_kv import paged, random_case

# the parallel forms of the small ops compile in the slow set only: the tiny models' ops take their serial twins
PARALLEL = pytest.mark.slow


def dense_sink_attention(q, k, v, start, window, sinks, scale=0.125):
    """float64 attention of q [T, Hq, D] over k, v [S, Hkv, D], keys (start + t - window, start + t] (window 0:
    all earlier), with sinks [Hq] (or None) as an extra logit of each head's softmax."""
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros(q.shape)
    for t in range(num_tokens):
        hi = start + t + 1
        lo = 0 if window == 0 else max(0, hi - window)
        for h in range(num_heads):
            s = k[lo:hi, h // group].astype(np.float64) @ q[t, h] * scale
            logits = s if sinks is None else np.append(s, sinks[h])
            p = np.exp(logits - logits.max())
            p /= p.sum()
            out[t, h] = p[:hi - lo] @ v[lo:hi, h // group]
    return out


def run_attention(kernel, q, kp, vp, table, start, key_lo, key_hi, window, lse=attention.NO_LSE):
    out = np.empty_like(q)
    kernel(q, kp, vp, table, start, key_lo, key_hi, 0.125, out, lse, attention.NO_SCALES, attention.NO_SCALES, window)
    return out


@pytest.mark.parametrize("num_tokens,start,window", [(1, 0, 8), (1, 300, 128), (1, 700, 0), (37, 0, 16),
                                                     (9, 50, 32), (40, 100, 7)])
@pytest.mark.parametrize("kernel", ["attention", "attention_serial"])
def test_sliding_window_with_sinks_matches_dense(num_tokens, start, window, kernel):
    rng = np.random.default_rng(num_tokens + start + window)
    q, k, v, table, pool_blocks = random_case(rng, num_tokens, start)
    k[:start + num_tokens][: max(0, start - window - 1) if window else 0] = np.nan  # keys left of every window
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32) * 2
    lse = np.empty(q.shape[:2], np.float32)
    out = run_attention(getattr(attention, kernel), q, paged(k, table, pool_blocks), paged(v, table, pool_blocks),
                        table, start, 0, start + num_tokens, window, lse)
    attention.apply_sinks(out, lse, sinks)
    ref = dense_sink_attention(q, k, v, start, window, sinks)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("num_tokens,start,split,window", [(1, 700, 320, 500), (37, 200, 220, 64), (5, 0, 3, 4)])
def test_window_partial_ranges_merge_then_sinks(num_tokens, start, split, window):
    """A host part [0, split) and a device part [split, ...) of a windowed attention, merged by their lse, then the
    sinks: the whole (rows whose window misses a part get lse -inf there)."""
    rng = np.random.default_rng(split)
    q, k, v, table, pool_blocks = random_case(rng, num_tokens, start)
    kp, vp = paged(k, table, pool_blocks), paged(v, table, pool_blocks)
    parts = []
    for lo, hi in ((0, split), (split, start + num_tokens)):
        lse = np.empty(q.shape[:2], np.float32)
        parts.append((run_attention(attention.attention, q, kp, vp, table, start, lo, hi, window, lse), lse))
    (out_a, lse_a), (out_b, lse_b) = parts
    m = np.maximum(lse_a, lse_b)
    wa, wb = np.exp(lse_a - m)[..., None], np.exp(lse_b - m)[..., None]
    out = ((wa * out_a + wb * out_b) / (wa + wb)).astype(np.float32)
    lse = (m + np.log(wa[..., 0] + wb[..., 0])).astype(np.float32)
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    attention.apply_sinks(out, lse, sinks)
    ref = dense_sink_attention(q, k, v, start, window, sinks)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_sinks_leave_an_empty_range_zero():
    out = np.ones((2, 3, 4), np.float32)
    lse = np.full((2, 3), -np.inf, np.float32)
    lse[1] = 0.0
    attention.apply_sinks(out, lse, np.zeros(3, np.float32))
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_allclose(out[1], 0.5)


def gpt_oss_rope_config(head_dim, truncate=False):
    return GptOssConfig(head_dim=head_dim, num_attention_heads=4, hidden_size=256, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0})


@pytest.mark.parametrize("head_dim,truncate", [(64, False), (48, True)])
def test_yarn_frequencies_match_hf(head_dim, truncate):
    rotary = hf.GptOssRotaryEmbedding(gpt_oss_rope_config(head_dim, truncate))
    inv_freq, scale = rope_freqs(150000.0, head_dim, yarn=YarnScaling(32.0, 4096, 32.0, 1.0, None, truncate))
    # a pow an ulp off (torch's vectorized powf, test_ops) becomes 2 after the ramp's blend
    np.testing.assert_array_max_ulp(inv_freq, rotary.inv_freq.numpy(), maxulp=2)
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("num_tokens,start", [(1, 40000), (37, 0), (37, 3000)])
@pytest.mark.parametrize("kernel", [pytest.param(rope_neox_freqs, marks=PARALLEL), rope_neox_freqs_serial])
def test_yarn_rope_matches_hf(num_tokens, start, kernel):
    """The rotation with HF's own YaRN frequencies (ours are within 2 ulp of them, above: at position 40000 that
    ulp alone moves an angle by ~1e-3) and attention factor."""
    rng = np.random.default_rng(3)
    head_dim = 64
    rotary = hf.GptOssRotaryEmbedding(gpt_oss_rope_config(head_dim))
    x = rng.standard_normal((num_tokens, 4, head_dim)).astype(np.float32)
    positions = np.arange(start, start + num_tokens, dtype=np.int64)
    cos, sin = rotary(torch.from_numpy(x), torch.from_numpy(positions)[None])
    xt = torch.from_numpy(x)[None]  # [1, T, nH, D]
    expected, _ = hf.apply_rotary_pos_emb(xt, xt, cos, sin, unsqueeze_dim=2)
    out = np.empty_like(x)
    kernel(x, positions, rotary.inv_freq.numpy(), rotary.attention_scaling, out)
    np.testing.assert_allclose(out, expected[0].numpy(), rtol=0, atol=4e-6)
    kernel(x, positions, rotary.inv_freq.numpy(), rotary.attention_scaling, x)  # in place
    np.testing.assert_array_equal(x, out)


def test_partial_rotation_leaves_the_rest():
    """R < D: dims past R are copied (GLM's partial rotary uses the same kernel)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32)
    positions = np.arange(5, dtype=np.int64) + 11
    inv_freq, _ = rope_freqs(10000.0, 64, rotary_dim=32)
    out = np.empty_like(x)
    rope_neox_freqs_serial(x, positions, inv_freq, 1.0, out)
    np.testing.assert_array_equal(out[..., 32:], x[..., 32:])
    angles = positions[:, None].astype(np.float32) * inv_freq  # [T, 16]
    c, s = np.cos(angles.astype(np.float64))[:, None], np.sin(angles.astype(np.float64))[:, None]
    x1, x2 = x[..., :16], x[..., 16:32]
    np.testing.assert_allclose(out[..., :32], np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1), atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 37])
@pytest.mark.parametrize("serial", [pytest.param(False, marks=PARALLEL), True])
def test_topk_softmax_router_matches_hf(num_tokens, serial):
    """HF GptOssTopKRouter: topk of the (biased) logits, softmax over the k."""
    rng = np.random.default_rng(num_tokens)
    logits = rng.standard_normal((num_tokens, 32)).astype(np.float32)
    logits[0, 5] = logits[0, 9]  # a tie goes to the lower id
    k = 4
    ids, weights = np.empty((num_tokens, k), np.int64), np.empty((num_tokens, k), np.float32)
    (routing.route_topk_softmax_serial if serial else routing.route_topk_softmax)(logits, k, ids, weights)
    top, top_ids = torch.topk(torch.from_numpy(logits), k, dim=-1)
    np.testing.assert_array_equal(ids, top_ids.numpy())
    np.testing.assert_allclose(weights, torch.softmax(top, dim=1).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_pairs", [3, 150])
@pytest.mark.parametrize("serial", [pytest.param(False, marks=PARALLEL), True])
def test_clamped_swiglu_and_pair_bias_match_hf(num_pairs, serial):
    """HF GptOssExperts._apply_gate on gate/up rows plus each pair's expert biases, then the down bias per row."""
    rng = np.random.default_rng(num_pairs)
    width, hidden, num_experts = 40, 24, 8
    gate, up = (rng.standard_normal((num_pairs, width)).astype(np.float32) * 6 for _ in range(2))  # past the clamp
    gate_bias, up_bias = (rng.standard_normal((num_experts, width)).astype(np.float32) for _ in range(2))
    down_bias = rng.standard_normal((num_experts, hidden)).astype(np.float32)
    pair_expert = rng.integers(0, num_experts, num_pairs).astype(np.int64)
    glu = activation.clamped_swiglu_serial if serial else activation.clamped_swiglu
    out = np.empty_like(gate)
    glu(gate, up, pair_expert, gate_bias, up_bias, 1.702, 7.0, out)
    experts = hf.GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=width))
    gate_up = torch.empty(num_pairs, 2 * width)
    gate_up[:, ::2] = torch.from_numpy(gate + gate_bias[pair_expert])
    gate_up[:, 1::2] = torch.from_numpy(up + up_bias[pair_expert])
    np.testing.assert_allclose(out, experts._apply_gate(gate_up).numpy(), rtol=2e-6, atol=2e-6)
    rows = rng.standard_normal((num_pairs, hidden)).astype(np.float32)
    expected = rows + down_bias[pair_expert]
    (activation.add_pair_bias_serial if serial else activation.add_pair_bias)(rows, pair_expert, down_bias)
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-6)
