"""The sigmoid router with a choice bias and group-limited top-k (GLM-4.5, DeepSeek-V3) against a NumPy reference
and against transformers' Glm4MoeTopkRouter, at decode and prefill sizes."""
import numpy as np
import pytest

from cpu_kernels.routing import route_sigmoid_topk, route_sigmoid_topk_serial


def reference(logits, bias, k, num_groups, topk_groups, normalize, scale):
    """ids [T, K] (best choice first), weights [T, K]: HF Glm4MoeTopkRouter's steps in float64."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))  # [T, E]
    choice = scores + bias
    num_tokens, num_experts = logits.shape
    grouped = choice.reshape(num_tokens, num_groups, -1)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [T, G]: the two best
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_groups]
    mask = np.zeros((num_tokens, num_groups), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    choice = np.where(np.repeat(mask, num_experts // num_groups, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * scale


CASES = [(1, 16, 4, 4, 2, True, 2.5), (37, 24, 3, 8, 3, False, 1.5), (37, 128, 8, 1, 1, True, 2.5)]


@pytest.mark.parametrize("num_tokens,num_experts,k,num_groups,topk_groups,normalize,scale", CASES)
@pytest.mark.parametrize("kernel", [route_sigmoid_topk, route_sigmoid_topk_serial], ids=["parallel", "serial"])
def test_route_sigmoid_matches_reference(kernel, num_tokens, num_experts, k, num_groups, topk_groups, normalize,
                                         scale):
    rng = np.random.default_rng(num_tokens * num_experts + k)
    logits = (2.0 * rng.standard_normal((num_tokens, num_experts))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
    ids = np.empty((num_tokens, k), dtype=np.int64)
    weights = np.empty((num_tokens, k), dtype=np.float32)
    kernel(logits, bias, k, num_groups, topk_groups, normalize, scale, ids, weights)
    want_ids, want_weights = reference(logits, bias, k, num_groups, topk_groups, normalize, scale)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=0)


@pytest.mark.slow
def test_route_sigmoid_matches_transformers_router():
    import torch
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=48, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True)
    router = Glm4MoeTopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.1)
        h = torch.randn(21, 48)
        logits, want_weights, want_ids = router(h)
    logits = logits.numpy()
    ids = np.empty((21, 4), dtype=np.int64)
    weights = np.empty((21, 4), dtype=np.float32)
    route_sigmoid_topk(logits, router.e_score_correction_bias.numpy(), 4, 4, 2, True, 2.5, ids, weights)
    order = np.argsort(want_ids.numpy(), axis=-1)  # transformers' picks are unsorted
    mine = np.argsort(ids, axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(ids, mine, -1), np.take_along_axis(want_ids.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(weights, mine, -1),
                               np.take_along_axis(want_weights.numpy(), order, -1), rtol=2e-6)
