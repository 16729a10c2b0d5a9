"""Hand-built profiles and model sizes for the placement tests (fixtures make_sizes, make_profile)."""
import numpy as np
import pytest

from placement.budget import MIB, ModelSizes
from placement.profile import ExpertProfile


def sizes(num_layers=3, num_experts=4, top_k=2, expert_mib=10, dense_mib=5):
    return ModelSizes(num_layers, num_experts, top_k, (expert_mib * MIB,) * num_layers, (dense_mib * MIB,) * num_layers,
                      embed_bytes=20 * MIB, head_bytes=20 * MIB, kv_heads=2, head_dim=64, hidden_size=256,
                      moe_intermediate_size=128, vocab_size=1000)


def random_profile(num_layers=3, num_experts=4, top_k=2, num_tokens=200, seed=0, model_id="test-model"):
    """Zipf-like routing, a different expert order and skew per layer."""
    rng = np.random.default_rng(seed)
    profile = ExpertProfile.empty(model_id, num_layers, num_experts, top_k)
    for layer in range(num_layers):
        weights = 1.0 / np.arange(1, num_experts + 1) ** rng.uniform(0.3, 2.0)
        weights = weights[rng.permutation(num_experts)]
        for _ in range(num_tokens):
            ids = rng.choice(num_experts, size=top_k, replace=False, p=weights / weights.sum())
            profile.decode[layer, ids] += 1
            profile.prefill[layer, ids] += 2
            profile.coactivation[layer, ids[0], ids[1]] += 1
            profile.coactivation[layer, ids[1], ids[0]] += 1
    profile.tokens_decode, profile.tokens_prefill = num_tokens, num_tokens
    return profile


@pytest.fixture
def make_sizes():
    return sizes


@pytest.fixture
def make_profile():
    return random_profile
