"""Non-matmul CPU kernels against NumPy / torch references and the transformers Qwen3-MoE code."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from cpu_kernels.activation import swiglu
from cpu_kernels.attention import attention
from cpu_kernels.moe_combine import gather_rows, scatter_add_weighted
from cpu_kernels.rmsnorm import rmsnorm, rmsnorm_heads
from cpu_kernels.rope import inv_freq_f32, rope_neox
from cpu_kernels.routing import group_by_expert, route_softmax_topk


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def hf_config(**overrides):
    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=24,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_rmsnorm_matches_hf(num_tokens):
    rng = np.random.default_rng(0)
    hidden, eps = 200, 1e-6
    x, weight = randn(rng, num_tokens, hidden, scale=3.0), randn(rng, hidden)
    norm = hf.Qwen3MoeRMSNorm(hidden, eps)
    norm.weight.data = torch.from_numpy(weight)
    expected = norm(torch.from_numpy(x)).detach().numpy()
    out = np.empty_like(x)
    rmsnorm(x, weight, eps, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    rmsnorm(x, weight, eps, x)  # in place
    np.testing.assert_array_equal(x, out)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_rmsnorm_heads_matches_hf(num_tokens):
    rng = np.random.default_rng(1)
    num_heads, head_dim, eps = 4, 128, 1e-6
    x, weight = randn(rng, num_tokens, num_heads, head_dim), randn(rng, head_dim)
    norm = hf.Qwen3MoeRMSNorm(head_dim, eps)
    norm.weight.data = torch.from_numpy(weight)
    expected = norm(torch.from_numpy(x)).detach().numpy()
    out = np.empty_like(x)
    rmsnorm_heads(x, weight, eps, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def rope_reference(x, positions, theta):
    """float64 NeoX rope from the float32 angles HF forms."""
    half = x.shape[-1] // 2
    exponents = (np.arange(0, 2 * half, 2, dtype=np.float32) / np.float32(2 * half)).astype(np.float64)
    inv_freq = np.float32(1.0) / (np.float64(theta) ** exponents).astype(np.float32)  # [D/2]
    angles = positions.astype(np.float32)[:, None] * inv_freq  # [T, D/2], float32 as HF
    c, s = np.cos(angles.astype(np.float64))[:, None], np.sin(angles.astype(np.float64))[:, None]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_freq_within_an_ulp_of_hf(head_dim):
    """Ours rounds pow correctly; torch's vectorized powf is sometimes 1 ulp off (D=128, theta=1e6: index 37)."""
    for theta in (10000.0, 1e6, 5e6):
        config = hf_config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta})
        expected = hf.Qwen3MoeRotaryEmbedding(config).inv_freq.numpy()
        np.testing.assert_array_max_ulp(inv_freq_f32(theta, head_dim), expected, maxulp=1)


@pytest.mark.parametrize("num_tokens,start,head_dim", [(1, 40000, 128), (37, 0, 128), (37, 3000, 64)])
def test_rope_matches_hf(num_tokens, start, head_dim):
    rng = np.random.default_rng(2)
    theta, num_heads = 1e6, 4
    config = hf_config(head_dim=head_dim, rope_parameters={"rope_type": "default", "rope_theta": theta})
    x = randn(rng, num_tokens, num_heads, head_dim)
    positions = np.arange(start, start + num_tokens, dtype=np.int64)
    cos, sin = hf.Qwen3MoeRotaryEmbedding(config)(torch.from_numpy(x), torch.from_numpy(positions)[None])
    xt = torch.from_numpy(x)[None]  # [1, T, nH, D]
    expected, _ = hf.apply_rotary_pos_emb(xt, xt, cos, sin, unsqueeze_dim=2)
    out = np.empty_like(x)
    rope_neox(x, positions, theta, out)
    np.testing.assert_allclose(out, expected[0].numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(out, rope_reference(x, positions, theta), rtol=0, atol=1e-6)
    rope_neox(x, positions, theta, x)  # in place
    np.testing.assert_array_equal(x, out)


def attention_reference(q, k_cache, v_cache, start_pos, scale):
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // k_cache.shape[1]
    out = np.empty(q.shape, dtype=np.float64)
    for t in range(num_tokens):
        num_keys = start_pos + t + 1
        for h in range(num_q_heads):
            keys = k_cache[:num_keys, h // group].astype(np.float64)
            scores = keys @ q[t, h].astype(np.float64) * scale
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ v_cache[:num_keys, h // group].astype(np.float64)
    return out


@pytest.mark.parametrize("num_tokens,start_pos,cache_len,num_q_heads,num_kv_heads,head_dim", [
    (1, 0, 1, 4, 2, 128),
    (1, 1500, 1531, 8, 1, 128),  # decode: keys split and merged
    (5, 700, 709, 8, 2, 64),  # a few tokens, still split
    (37, 0, 45, 8, 1, 64),
    (37, 19, 61, 4, 2, 16),
])
def test_attention_matches_reference(num_tokens, start_pos, cache_len, num_q_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(3)
    q = randn(rng, num_tokens, num_q_heads, head_dim, scale=2.0)
    k_cache = randn(rng, cache_len, num_kv_heads, head_dim, scale=2.0)
    v_cache = randn(rng, cache_len, num_kv_heads, head_dim)
    k_cache[start_pos + num_tokens:] = np.nan  # past the valid entries: must never be read
    v_cache[start_pos + num_tokens:] = np.nan
    scale = head_dim ** -0.5
    out = np.empty_like(q)
    one_block = np.zeros(1, dtype=np.int32)  # the whole cache as one pool block (paging: test_attention_kv.py)
    attention(q, k_cache[None], v_cache[None], one_block, start_pos, 0, start_pos + num_tokens, scale, out)
    expected = attention_reference(q, k_cache, v_cache, start_pos, scale)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_tokens,normalize", [(1, True), (37, True), (37, False)])
def test_routing_matches_hf_router(num_tokens, normalize):
    rng = np.random.default_rng(4)
    config = hf_config(num_experts=128, num_experts_per_tok=8, norm_topk_prob=normalize)
    router = hf.Qwen3MoeTopKRouter(config)
    router.weight.data = torch.from_numpy(randn(rng, 128, config.hidden_size))
    hidden = torch.from_numpy(randn(rng, num_tokens, config.hidden_size))
    logits, expected_weights, expected_ids = (a.detach().numpy() for a in router(hidden))
    ids = np.empty((num_tokens, 8), dtype=np.int64)
    weights = np.empty((num_tokens, 8), dtype=np.float32)
    route_softmax_topk(np.ascontiguousarray(logits), 8, normalize, ids, weights)
    np.testing.assert_array_equal(ids, expected_ids)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_routing_ties_go_to_the_lower_id():
    logits = np.array([[0.5, 2.0, 1.0, 2.0, 1.0, -3.0, 2.0]], dtype=np.float32)
    ids = np.empty((1, 4), dtype=np.int64)
    weights = np.empty((1, 4), dtype=np.float32)
    route_softmax_topk(logits, 4, False, ids, weights)
    np.testing.assert_array_equal(ids, [[1, 3, 6, 2]])
    probs = np.exp(logits[0] - 2.0) / np.exp(logits[0] - 2.0).sum()
    np.testing.assert_allclose(weights[0], probs[[1, 3, 6, 2]], rtol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_group_by_expert_is_a_stable_counting_sort(num_tokens):
    rng = np.random.default_rng(5)
    num_experts, k = 16, 4
    used = np.array([1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # 0, 5, 15 stay empty
    ids = np.stack([rng.choice(used, k, replace=False) for _ in range(num_tokens)]).astype(np.int64)
    order, expert_ids, row_starts = group_by_expert(ids, num_experts)
    flat = ids.reshape(-1)
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
    present, counts = np.unique(flat, return_counts=True)
    np.testing.assert_array_equal(expert_ids, present)
    np.testing.assert_array_equal(row_starts, np.concatenate([[0], np.cumsum(counts)]))


@pytest.mark.parametrize("num_rows", [1, 37])
def test_swiglu_matches_torch(num_rows):
    rng = np.random.default_rng(6)
    gate, up = randn(rng, num_rows, 96, scale=4.0), randn(rng, num_rows, 96)
    gate[0, :4] = [-200.0, -90.0, 90.0, 200.0]  # exp overflow territory
    expected = (torch.nn.functional.silu(torch.from_numpy(gate)) * torch.from_numpy(up)).numpy()
    out = np.empty_like(gate)
    swiglu(gate, up, out)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def routed(rng, num_tokens, num_experts, k):
    ids = np.stack([rng.permutation(num_experts)[:k] for _ in range(num_tokens)]).astype(np.int64)
    weights = rng.random((num_tokens, k)).astype(np.float32) + 0.1
    return ids, weights


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_gather_rows(num_tokens):
    rng = np.random.default_rng(7)
    k = 4
    x = randn(rng, num_tokens, 48)
    ids, _ = routed(rng, num_tokens, 12, k)
    order, _, _ = group_by_expert(ids, 12)
    out = np.empty((order.size, 48), dtype=np.float32)
    gather_rows(x, order, k, out)
    np.testing.assert_array_equal(out, x[order // k])


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_scatter_add_weighted_on_a_subset_of_pairs(num_tokens):
    rng = np.random.default_rng(8)
    k, hidden = 4, 48
    ids, weights = routed(rng, num_tokens, 12, k)
    order, _, row_starts = group_by_expert(ids, 12)
    order = order[row_starts[1]:]  # the first expert's rows live elsewhere (e.g. on a GPU)
    expert_out = randn(rng, order.size, hidden)
    base = randn(rng, num_tokens, hidden)
    expected = base.astype(np.float64)
    for i, p in enumerate(order):
        expected[p // k] += weights.reshape(-1)[p] * expert_out[i].astype(np.float64)
    out = base.copy()
    scatter_add_weighted(expert_out, order, weights.reshape(-1), k, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    again = base.copy()
    scatter_add_weighted(expert_out, order, weights.reshape(-1), k, again)
    np.testing.assert_array_equal(again, out)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_moe_block_matches_hf(num_tokens):
    """Router, grouping, gather, SwiGLU and scatter with NumPy matmuls reproduce HF's sparse MoE block."""
    rng = np.random.default_rng(9)
    config = hf_config(norm_topk_prob=True)
    num_experts, k, hidden, inter = 32, 4, config.hidden_size, config.moe_intermediate_size
    block = hf.Qwen3MoeSparseMoeBlock(config)
    block.gate.weight.data = torch.from_numpy(randn(rng, num_experts, hidden))
    gate_up = randn(rng, num_experts, 2 * inter, hidden, scale=0.2)
    down = randn(rng, num_experts, hidden, inter, scale=0.2)
    block.experts.gate_up_proj.data = torch.from_numpy(gate_up)
    block.experts.down_proj.data = torch.from_numpy(down)
    x = randn(rng, num_tokens, hidden)
    expected = block(torch.from_numpy(x)[None])[0].detach().numpy()

    logits = x @ block.gate.weight.data.numpy().T  # [T, E]
    ids = np.empty((num_tokens, k), dtype=np.int64)
    weights = np.empty((num_tokens, k), dtype=np.float32)
    route_softmax_topk(logits, k, True, ids, weights)
    order, expert_ids, row_starts = group_by_expert(ids, num_experts)
    rows = np.empty((order.size, hidden), dtype=np.float32)
    gather_rows(x, order, k, rows)
    act = np.empty((order.size, inter), dtype=np.float32)
    expert_out = np.empty((order.size, hidden), dtype=np.float32)
    for g, e in enumerate(expert_ids):
        lo, hi = row_starts[g], row_starts[g + 1]
        h = rows[lo:hi] @ gate_up[e].T  # [n, 2F]
        swiglu(np.ascontiguousarray(h[:, :inter]), np.ascontiguousarray(h[:, inter:]), act[lo:hi])
        expert_out[lo:hi] = act[lo:hi] @ down[e].T
    out = np.zeros_like(x)
    scatter_add_weighted(expert_out, order, weights.reshape(-1), k, out)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
