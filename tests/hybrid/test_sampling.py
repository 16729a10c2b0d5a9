"""The sampler's filters and determinism, on fresh random logits."""
import numpy as np
import pytest

from hybrid.sampling import Sampler, SamplingParams


@pytest.fixture
def logits():
    return np.random.default_rng(7).standard_normal(500).astype(np.float32) * 3


def draws(params, logits, n=400):
    sampler = Sampler(params)
    return [sampler(logits) for _ in range(n)]


def test_greedy_is_argmax(logits):
    assert draws(SamplingParams(temperature=0.0), logits, 3) == [int(np.argmax(logits))] * 3


def test_seed_makes_draws_repeatable(logits):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123)
    assert draws(params, logits) == draws(params, logits)
    other = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=124)
    assert draws(params, logits) != draws(other, logits)


def test_top_k_keeps_only_the_k_best(logits):
    best = set(np.argsort(-logits)[:5].tolist())
    picked = set(draws(SamplingParams(temperature=2.0, top_k=5, top_p=1.0, min_p=0.0, seed=1), logits))
    assert picked <= best and len(picked) > 1


def test_top_p_keeps_the_smallest_set_reaching_p(logits):
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    order = np.argsort(-probs)
    keep = int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1
    picked = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=2), logits))
    assert picked <= set(order[:keep].tolist())


def test_min_p_drops_tokens_below_a_share_of_the_best(logits):
    probs = np.exp(logits - logits.max())  # relative to the best token
    allowed = set(np.nonzero(probs >= 0.2)[0].tolist())
    picked = set(draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=3), logits))
    assert picked <= allowed and len(picked) > 1


def test_temperature_follows_the_softmax(logits):
    """Frequencies of a plain temperature draw match softmax(logits / T) (chi-square-free check on top tokens)."""
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, seed=4)
    counts = np.bincount(draws(params, logits, 4000), minlength=logits.size)
    probs = np.exp((logits - logits.max()) / 0.7)
    probs /= probs.sum()
    top = np.argsort(-probs)[:3]
    assert np.allclose(counts[top] / 4000, probs[top], atol=0.03)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("min_p", 1.5),
                                         ("max_tokens", 0), ("top_k", -2)])
def test_invalid_params_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
