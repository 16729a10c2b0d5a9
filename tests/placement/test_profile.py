"""Profiles: save/load/merge round trip, refusal of another model's profile, and `show`'s numbers."""
import math

import numpy as np
import pytest

from placement.profile import ExpertProfile, ProfileError
from placement.report import summarize, write_heatmap


def test_save_load_round_trip(tmp_path, make_profile):
    profile = make_profile(seed=1)
    profile.sources = ["unit test"]
    path = tmp_path / "p.npz"
    profile.save(path)
    loaded = ExpertProfile.load(path)
    assert loaded.header() == profile.header()
    for name in ("prefill", "decode", "coactivation"):
        assert np.array_equal(getattr(loaded, name), getattr(profile, name))


def test_merge_adds_up(tmp_path, make_profile):
    a, b = make_profile(seed=1), make_profile(seed=2)
    a.sources, b.sources = ["a"], ["b"]
    merged = a + b
    assert np.array_equal(merged.decode, a.decode + b.decode)
    assert np.array_equal(merged.coactivation, a.coactivation + b.coactivation)
    assert (merged.tokens_prefill, merged.tokens_decode) == (400, 400)
    assert merged.sources == ["a", "b"]
    merged.save(tmp_path / "m.npz")
    assert ExpertProfile.load(tmp_path / "m.npz").header() == merged.header()


@pytest.mark.parametrize("layers, experts", [(4, 4), (3, 5)])
def test_merge_with_another_model_is_refused(make_profile, layers, experts):
    with pytest.raises(ProfileError, match=rf"\({layers} layers x {experts} experts\) does not fit profile "
                                           r"test-model \(3 layers x 4 experts\)"):
        make_profile().merge(make_profile(num_layers=layers, num_experts=experts))


def test_unreadable_files_are_refused(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_text("not a profile")
    with pytest.raises(ProfileError, match="bad.npz: not a Strata expert profile"):
        ExpertProfile.load(bad)
    other = tmp_path / "other.npz"
    np.savez(other, header=np.array('{"format": "something-else"}'), prefill=np.zeros((1, 1)),
             decode=np.zeros((1, 1)), coactivation=np.zeros((1, 1, 1)))
    with pytest.raises(ProfileError, match="format 'something-else'"):
        ExpertProfile.load(other)


def test_show_numbers_on_a_hand_built_profile(tmp_path):
    profile = ExpertProfile.empty("hand", 2, 10, 1)
    profile.decode[0] = [91, 1, 1, 1, 1, 1, 1, 1, 1, 1]  # one hot expert
    profile.decode[1] = 10  # uniform
    profile.tokens_decode = 100
    s = summarize(profile, "decode")
    assert s["routings"] == 200
    # top 10 % = 1 expert: 91 % and 10 %; top 25 % = 3 experts: 93 % and 30 %; top 50 %: 95 % and 50 %
    assert s["skew"] == pytest.approx({0.10: (0.91 + 0.10) / 2, 0.25: (0.93 + 0.30) / 2, 0.50: (0.95 + 0.50) / 2})
    expected0 = -(0.91 * math.log2(0.91) + 9 * 0.01 * math.log2(0.01))
    assert s["entropy_bits"] == pytest.approx([expected0, math.log2(10)])
    pytest.importorskip("matplotlib")
    assert write_heatmap(profile, tmp_path / "h.png", "decode")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_show_without_matplotlib_skips_the_png(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert not write_heatmap(ExpertProfile.empty("m", 1, 2, 1), tmp_path / "h.png")
    assert not (tmp_path / "h.png").exists()
    assert "matplotlib is not installed" in caplog.text


def _routings(rng, shares, tokens, k):
    """int64 [L, E] routing counts of `tokens` tokens, each picking k distinct experts by `shares` [L, E]."""
    counts = np.zeros(shares.shape, np.int64)
    for layer, p in enumerate(shares):
        for _ in range(tokens):
            counts[layer, rng.choice(len(p), size=k, replace=False, p=p)] += 1
    return counts


@pytest.mark.parametrize("seed", range(3))
def test_decode_estimate_leans_on_the_prompt_prior_while_decode_agrees(seed):
    rng = np.random.default_rng(seed)
    L, E, K = 3, 16, 2
    shares = rng.dirichlet(np.full(E, 0.5), size=L)  # [L, E]
    prefill, decode = _routings(rng, shares, 2000, K), _routings(rng, shares, 20, K)
    profile = ExpertProfile("m", K, prefill, decode, np.zeros((L, E, E), np.int64), 2000, 20)
    estimate, strength = profile.decode_estimate()
    assert strength > 40 * K  # worth more than the 20 decode tokens themselves
    truth = shares * K
    assert np.abs(estimate - truth).sum() < np.abs(profile.probabilities("decode") - truth).sum()
    assert np.allclose(estimate.sum(axis=1), K)


def test_decode_estimate_follows_many_decode_tokens_that_disagree():
    rng = np.random.default_rng(7)
    L, E, K = 2, 16, 2
    prompt_shares, decode_shares = rng.dirichlet(np.full(E, 0.5), size=L), rng.dirichlet(np.full(E, 0.5), size=L)
    prefill, decode = _routings(rng, prompt_shares, 2000, K), _routings(rng, decode_shares, 2000, K)
    profile = ExpertProfile("m", K, prefill, decode, np.zeros((L, E, E), np.int64), 2000, 2000)
    estimate, strength = profile.decode_estimate()
    assert strength < 200
    assert np.abs(estimate - decode_shares * K).max() < 0.1


def test_decode_estimate_without_one_phase():
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 50, size=(2, 8))
    empty = np.zeros_like(counts)
    only_prompt = ExpertProfile("m", 2, counts, empty, np.zeros((2, 8, 8), np.int64), 100, 0)
    only_decode = ExpertProfile("m", 2, empty, counts, np.zeros((2, 8, 8), np.int64), 0, 100)
    assert np.array_equal(only_prompt.decode_estimate()[0], only_prompt.probabilities("prefill"))
    assert np.array_equal(only_decode.decode_estimate()[0], only_decode.probabilities("decode"))


def _in_parts(profile, num_parts, seed=0):
    """profile with its counts split at random into num_parts parts that add up to them."""
    rng = np.random.default_rng(seed)
    totals = (profile.prefill, profile.decode, np.array([profile.tokens_prefill, profile.tokens_decode]))
    return profile.with_parts(*(_split(rng, total, num_parts) for total in totals))


def _split(rng, total, num_parts):
    """int64 [num_parts, *total.shape] adding up to total, each cell split at random."""
    flat = np.asarray(total).ravel()
    parts = np.stack([rng.multinomial(n, np.ones(num_parts) / num_parts) for n in flat], axis=1)
    return parts.reshape(num_parts, *np.shape(total))


def test_parts_round_trip_and_fold_into_at_most_max_parts(tmp_path, make_profile):
    from placement.profile import MAX_PARTS

    profile = make_profile(seed=3)
    split = _in_parts(profile, MAX_PARTS + 5)
    assert len(split.part_prefill) == MAX_PARTS
    assert np.array_equal(split.part_prefill.sum(axis=0), profile.prefill)
    split.save(tmp_path / "p.npz")
    loaded = ExpertProfile.load(tmp_path / "p.npz")
    for name in ("part_prefill", "part_decode", "part_tokens"):
        assert np.array_equal(getattr(loaded, name), getattr(split, name))
    assert [len(a) for a in profile.parts()] == [1, 1, 1]  # without kept parts: one part, the totals
    assert np.array_equal(profile.parts()[0][0], profile.prefill)


def test_merge_keeps_each_sides_parts(make_profile):
    a, b = _in_parts(make_profile(seed=1), 3), make_profile(seed=2)
    merged = a + b
    assert len(merged.part_prefill) == 4  # a's three parts and b as one
    assert np.array_equal(merged.part_decode[3], b.decode)
    assert merged.part_tokens.sum(axis=0).tolist() == [merged.tokens_prefill, merged.tokens_decode]


def test_parts_that_do_not_add_up_are_refused(make_profile):
    profile = make_profile()
    prefill, decode, tokens = profile.parts()
    with pytest.raises(ProfileError, match="its parts do not add up to its counts"):
        profile.with_parts(prefill, decode + 1, tokens)
