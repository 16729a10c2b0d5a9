"""The planner: budgets respected, 1 and 2 GPUs, deterministic, optimal on small cases."""
import itertools

import numpy as np
import pytest

from placement.budget import BudgetError
from placement.placement import Placement
from placement.planner import Budgets, CostModel, Speeds, plan

# 3 layers x (5 dense + 4 x 10 expert) MiB; embed + head 40 MiB, scratch 69.5 MiB, 1 slot x 1000 tokens of
# f16 KV 0.5 MiB per layer: 126 MiB before experts
ONE_GPU_MIB = 126 + 60  # six 10 MiB expert slots


def budgets(gpu_mib=(ONE_GPU_MIB,), split="auto", slots=1):
    return Budgets(gpu_mib, slots, 1000, "f16", reserve_mib=0, layer_split=split)


def brute_force(cost, layers, num_slots):
    """Least step time over every resident set of `layers` with at most num_slots experts."""
    L, E = cost.q.shape
    cells = [(layer, e) for layer in layers for e in range(E)]
    best = np.inf
    for bits in itertools.product([False, True], repeat=len(cells)):
        if sum(bits) > num_slots:
            continue
        mask = np.zeros((L, E), dtype=bool)
        for (layer, e), on in zip(cells, bits):
            mask[layer, e] = on
        best = min(best, cost.step_seconds(mask))
    return best


def prefix_brute_force(cost, layers, num_slots):
    """Least step time over every allocation of slot counts to layers (each layer's most used first),
    a layer free to use fewer than its count."""
    L, E = cost.q.shape
    best = np.inf
    for counts in itertools.product(range(E + 1), repeat=len(layers)):
        if sum(counts) > num_slots:
            continue
        mask = np.zeros((L, E), dtype=bool)
        for layer, n in zip(layers, counts):
            mask[layer, cost._curves[layer][0][:n]] = True
        best = min(best, cost.step_seconds(mask))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_slots", [0, 1, 3, 6, 9, 12])
def test_reaches_brute_force_optimum_of_every_resident_set(make_profile, make_sizes, seed, num_slots):
    cost = CostModel(make_profile(seed=seed).probabilities("decode"), make_sizes(), 4, Speeds(), 1000, "f16")
    mask = cost.plan_layers(range(3), num_slots)
    assert mask.sum() <= num_slots
    assert cost.step_seconds(mask) <= brute_force(cost, range(3), num_slots) * (1 + 1e-12)


@pytest.mark.parametrize("gpu_over_cpu", [0.5, 1.5, 4.0])
@pytest.mark.parametrize("seed", range(4))
def test_reaches_brute_force_optimum_of_every_allocation_when_gpu_is_slow(make_profile, make_sizes, seed,
                                                                           gpu_over_cpu):
    """Near equal speeds the GPU part can be the longer one; the plan is still the best allocation."""
    cost = CostModel(make_profile(seed=seed).probabilities("decode"), make_sizes(), 4,
                     Speeds(40, 40 * gpu_over_cpu), 1000, "f16")
    for num_slots in range(13):
        mask = cost.plan_layers(range(3), num_slots)
        assert mask.sum() <= num_slots
        assert cost.step_seconds(mask) <= prefix_brute_force(cost, range(3), num_slots) * (1 + 1e-12)


def test_one_gpu_budget_and_predictions(make_profile, make_sizes):
    placement = plan(make_profile(), make_sizes(), budgets())
    (gpu,) = placement.gpus
    assert gpu.budget["expert_slots"] == 6 and len(gpu.resident) <= 6
    assert (gpu.first_layer, gpu.last_layer) == (0, 3)
    p, base = placement.predicted, placement.baselines
    for other in base.values():
        assert p["decode_tok_s"] >= other["decode_tok_s"] * (1 - 1e-12)
    assert 0 < p["hit_rate"] <= 1


def test_kv_window_leaves_room_for_more_experts(make_profile, make_sizes):
    """With --kv-resident the KV budget is the window (+ a chunk) per slot: 4 slots x 100000 tokens do
    not fit, 4 slots with a 1000-token window do, with that KV in the budget."""
    from placement.budget import gpu_budget

    sizes = make_sizes()
    with pytest.raises(BudgetError, match="KV"):
        plan(make_profile(), sizes, Budgets((ONE_GPU_MIB + 400,), 4, 100_000, "f16", reserve_mib=0))
    placement = plan(make_profile(), sizes, Budgets((ONE_GPU_MIB + 400,), 4, 100_000, "f16", reserve_mib=0,
                                                    kv_resident=1000))
    window_tokens = (16 + 8 + 1) * 64  # the window's 16 blocks, a 512-token chunk's 8, one more
    want = gpu_budget(sizes, 0, 1, 1, range(3), 4, window_tokens, "f16", 0).kv
    assert placement.gpus[0].budget["kv_mib"] * 2**20 == pytest.approx(want)


def test_two_gpus_split_layers_and_keep_experts_with_their_layer(make_profile, make_sizes):
    sizes = make_sizes(num_layers=4, num_experts=4)
    profile = make_profile(num_layers=4, num_experts=4)
    placement = plan(profile, sizes, budgets(gpu_mib=(150, 150)))
    assert [(g.first_layer, g.last_layer) for g in placement.gpus][0][0] == 0
    assert placement.gpus[0].last_layer == placement.gpus[1].first_layer
    assert placement.gpus[1].last_layer == 4
    for g in placement.gpus:
        assert len(g.resident) <= g.budget["expert_slots"]
        assert all(g.first_layer <= layer < g.last_layer for layer, _ in g.resident)
        used = g.budget["dense_mib"] + g.budget["kv_mib"] + g.budget["scratch_mib"] + len(g.resident) * 10
        assert used <= g.budget["total_mib"]
    union = placement.resident_mask(4, 4)
    assert (union == placement.resident_mask(4, 4, gpu=0) | placement.resident_mask(4, 4, gpu=1)).all()
    assert list(placement.layer_gpus()) == [0] * placement.gpus[0].last_layer + [1] * (4 - placement.gpus[0].last_layer)


def test_two_gpus_auto_split_is_the_best_fixed_split(make_profile, make_sizes):
    sizes, profile = make_sizes(num_layers=4), make_profile(num_layers=4, seed=3)
    auto = plan(profile, sizes, budgets(gpu_mib=(130, 170)))
    fixed = [plan(profile, sizes, budgets(gpu_mib=(130, 170), split=(k,))) for k in (1, 2, 3)]
    assert auto.predicted["step_ms"] <= min(p.predicted["step_ms"] for p in fixed) * (1 + 1e-9)
    assert [(g.first_layer, g.last_layer) for g in fixed[0].gpus] == [(0, 1), (1, 4)]


def test_deterministic_with_ties(make_sizes):
    from placement.profile import ExpertProfile

    profile = ExpertProfile.empty("m", 3, 4, 2)
    profile.decode[:] = 5  # every expert equally used: ties everywhere
    profile.tokens_decode = 10
    first = plan(profile, make_sizes(), budgets())
    for _ in range(3):
        again = plan(profile, make_sizes(), budgets())
        assert again.to_json() == first.to_json()
    assert first.gpus[0].resident == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_budget_too_small_names_the_numbers(make_profile, make_sizes):
    with pytest.raises(BudgetError, match=r"GPU 0: 100 MiB cannot hold layers 0-2: dense weights 55 MiB \+ KV 1 MiB "
                                          r"\(1 slots x 1000 tokens, f16\) \+ scratch 70 MiB \+ reserve 0 MiB "
                                          r"= 126 MiB"):
        plan(make_profile(), make_sizes(), budgets(gpu_mib=(100,)))


def test_profile_of_another_model_is_refused(make_profile, make_sizes):
    with pytest.raises(ValueError, match=r"3 layers x 5 experts\) does not fit the model \(3 layers x 4 experts\)"):
        plan(make_profile(num_experts=5), make_sizes(), budgets())


def test_bad_layer_split(make_profile, make_sizes):
    with pytest.raises(ValueError, match="--layer-split 3: need 1 increasing layer indices in 1..2"):
        plan(make_profile(), make_sizes(), budgets(gpu_mib=(200, 200), split=(3,)))


def test_placement_round_trip(tmp_path, make_profile, make_sizes):
    placement = plan(make_profile(), make_sizes(), budgets())
    path = tmp_path / "placement.json"
    placement.save(path)
    loaded = Placement.load(path)
    assert loaded.to_json() == placement.to_json()
    assert (loaded.resident_mask(3, 4) == placement.resident_mask(3, 4)).all()
    with pytest.raises(ValueError, match="does not fit a model of 3 layers x 8 experts"):
        loaded.resident_mask(3, 8)


def test_slots_the_objective_leaves_empty_get_the_most_used_experts(make_profile, make_sizes):
    profile, sizes = make_profile(seed=2), make_sizes()
    slow_gpu = Speeds(cpu_gbps=40, gpu_gbps=60)  # the GPU part binds before every expert is resident
    cost = CostModel(profile.probabilities("decode"), sizes, 1, slow_gpu, 1000, "f16")
    assert cost.plan_layers(range(3), 12).sum() < 12
    placement = plan(profile, sizes, budgets(gpu_mib=(126 + 120,)), slow_gpu)
    assert len(placement.gpus[0].resident) == 12


@pytest.mark.parametrize("seed", range(5))
def test_slot_allocation_is_optimal_for_curves_that_are_not_convex(make_profile, make_sizes, seed):
    """The dynamic programme (taken when a layer's cost curve is not convex) reaches the least sum of
    the layers' curves over every allocation of slot counts."""
    rng = np.random.default_rng(seed)
    cost = CostModel(make_profile(seed=seed).probabilities("decode"), make_sizes(), 1, Speeds(), 1000, "f16")
    for layer in range(3):  # non-increasing, with flat stretches and sudden drops: not convex
        order, _, best_m = cost._curves[layer]
        curve = np.minimum.accumulate(rng.choice([1.0, 2.0, 5.0], size=5) * rng.uniform(0.5, 1.0, size=5)[::-1])
        cost._curves[layer] = (order, curve, best_m)
    for num_slots in range(13):
        counts = cost._best_counts(range(3), num_slots)
        assert counts.sum() <= num_slots and (counts <= 4).all()
        total = sum(cost._curves[layer][1][n] for layer, n in enumerate(counts))
        want = min(sum(cost._curves[layer][1][n] for layer, n in enumerate(c))
                   for c in itertools.product(range(5), repeat=3) if sum(c) <= num_slots)
        assert total == pytest.approx(want, rel=1e-12)


def test_a_rare_miss_still_costs_a_cpu_expert(make_sizes):
    """Batch 1, a fast GPU: the expected CPU part of a skewed layer falls under its GPU part long before
    every expert is resident, yet each resident expert still lowers the predicted step (a step that
    misses waits for a whole CPU expert), so the plan fills every slot by use."""
    from placement.profile import ExpertProfile

    profile = ExpertProfile.empty("m", 3, 4, 2)
    profile.decode[:] = [[600, 300, 90, 10]] * 3
    profile.tokens_decode = 500
    cost = CostModel(profile.probabilities("decode"), make_sizes(), 1, Speeds(cpu_gbps=40, gpu_gbps=3000), 1000,
                     "f16")
    steps = [cost.step_seconds(cost.plan_layers(range(3), n)) for n in range(13)]
    assert all(b < a for a, b in zip(steps, steps[1:]))
    assert cost.plan_layers(range(3), 9).sum(axis=1).tolist() == [3, 3, 3]


def parts_profile(num_experts, part_routings):
    """A 2-layer, top-2 profile kept in parts, both layers alike. part_routings: per part (prompt tokens,
    decode tokens), each a list of expert pairs, one per token."""
    from placement.profile import ExpertProfile

    P, E = len(part_routings), num_experts
    prefill, decode, tokens = np.zeros((P, 2, E), np.int64), np.zeros((P, 2, E), np.int64), np.zeros((P, 2), int)
    for i, phases in enumerate(part_routings):
        for counts, pairs in zip((prefill[i], decode[i]), phases):
            for pair in pairs:
                counts[:, list(pair)] += 1
        tokens[i] = [len(phases[0]), len(phases[1])]
    profile = ExpertProfile("m", 2, prefill.sum(axis=0), decode.sum(axis=0), np.zeros((2, E, E), np.int64),
                            int(tokens[:, 0].sum()), int(tokens[:, 1].sum()))
    return profile.with_parts(prefill, decode, tokens)


PROMPT = [(0, 1), (2, 3)] * 50  # prompts use experts 0-3 of both layers


def layer_sets(mask):
    return [set(np.flatnonzero(row).tolist()) for row in mask]


def test_plan_kept_where_held_out_parts_show_its_gain(make_sizes):
    """Every prompt's decode tokens use experts 4-7, its prompt tokens 0-3: the counts' top-k holds 0-3,
    the plan 4-7, and each fold of the profile's parts confirms the plan's choice. A prompt without decode
    tokens is never held out."""
    from placement.planner import cross_check, plan_slots, top_mask

    profile = parts_profile(8, [(PROMPT, [(4, 5), (6, 7)] * 5)] * 6 + [(PROMPT, [])])
    sizes = make_sizes(num_layers=2, num_experts=8)
    check = cross_check(profile, sizes, [(range(2), 8)], batch=1)
    assert check["folds"] == 6 and check["keep"] and check["gain_ms"] > 0 and check["hit_points"] == 100
    placement = plan_slots(profile, sizes, 8, batch=1)
    assert layer_sets(placement.resident_mask(2, 8)) == [{4, 5, 6, 7}] * 2
    assert layer_sets(top_mask(profile.counts("all"), [(range(2), 8)])) == [{0, 1, 2, 3}] * 2
    assert placement.settings["check"] == check


def test_plan_falls_back_to_the_global_top_k_where_held_out_parts_refute_it(make_sizes):
    """Each prompt's decode tokens use expert 0 and one expert of its own (4 + i), once 1 and 2: the plan of
    the whole profile takes the experts of its own, which no other prompt uses; on every fold the counts'
    top-k (0-3) catches more of the held-out decode routings, so the cache holds the global top-k."""
    from placement.planner import CostModel, Speeds, cross_check, plan_slots, top_mask

    profile = parts_profile(16, [(PROMPT, [(0, 4 + i)] * 10 + [(1, 2)]) for i in range(6)])
    sizes = make_sizes(num_layers=2, num_experts=16)
    unchecked = CostModel(profile.decode_estimate()[0], sizes, 1, Speeds(), 4096, "f16").plan_layers(range(2), 8)
    top = top_mask(profile.counts("all"), [(range(2), 8)])
    assert layer_sets(top) == [{0, 1, 2, 3}] * 2 and not np.array_equal(unchecked, top)
    check = cross_check(profile, sizes, [(range(2), 8)], batch=1)
    assert check["folds"] == 6 and not check["keep"] and check["gain_ms"] < 0 and check["hit_points"] < 0
    placement = plan_slots(profile, sizes, 8, batch=1)
    assert np.array_equal(placement.resident_mask(2, 16), top)
    assert placement.settings["check"] == check


def test_a_profile_of_one_part_keeps_the_plan_unchecked(make_profile, make_sizes):
    from placement.planner import cross_check

    check = cross_check(make_profile(), make_sizes(), [(range(3), 6)], batch=1)
    assert check == {"folds": 0, "keep": True, "why": "fewer than two parts: nothing to hold out"}


def test_folds_follow_the_parts_and_the_checked_multi_gpu_plan_keeps_its_budgets(make_sizes):
    """Two GPUs: the check covers each GPU's layers with its own slots; parts beyond MAX_FOLDS share folds."""
    from placement.planner import MAX_FOLDS

    part_routings = [(PROMPT, [(4, 5), (6, 7)] * 5)] * (MAX_FOLDS + 3)
    profile = parts_profile(8, part_routings)
    sizes = make_sizes(num_layers=2, num_experts=8)
    placement = plan(profile, sizes, Budgets((126 + 20, 126 + 20), 1, 1000, "f16", reserve_mib=0))
    assert placement.settings["check"]["folds"] == MAX_FOLDS and placement.settings["check"]["keep"]
    for g in placement.gpus:
        assert len(g.resident) <= g.budget["expert_slots"]
        assert {4, 5, 6, 7} <= {e for _, e in g.resident}  # every decode expert of the GPU's layer
