"""The engine's expert cache from a placement, a start-up plan or the dynamic mode, without a GPU.

GpuBackend runs its Python side over NumPy (the GPU tests' NumpyRuntime and reference kernels,
plus stand-in events), so swaps really copy expert bytes into slots: logits must not change.
"""
import importlib.util
import os
import re

import numpy as np
import pytest

from gpu_kernels.errors import VramError
from gpu_kernels.expert_cache import MIB, ExpertCache, plan
from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.expert_usage import ExpertUsage
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.residency import resident_choice
from placement.dynamic import DynamicResidency, DynamicSettings, SwapPolicy
from placement.placement import GpuPlacement, Placement, PlacementError
from placement.profile import ExpertProfile, ProfileError, model_id

_spec = importlib.util.spec_from_file_location(  # the GPU tests' NumPy stand-ins (tests are not a package)
    "gpu_test_fixtures", os.path.join(os.path.dirname(__file__), "..", "gpu_kernels", "conftest.py"))
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


class StandInEvent:
    """Lands `delay` polls after it is recorded (0: at once), like a copy still in flight."""

    delay = 1

    def __init__(self):
        self.left = self.delay

    def record(self, stream=None):
        self.left = self.delay

    @property
    def done(self):
        self.left -= 1
        return self.left < 0

    def synchronize(self):
        self.left = -1


class StandInRuntime(_fixtures.NumpyRuntime):
    def event(self, timing=False):
        return StandInEvent()

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)


def gpu_backend(**options):
    backend = GpuBackend(StandInRuntime(), max_context=256, kv_sequences=2, **options)
    backend.kernels = _fixtures.ReferenceKernels()
    return backend


def score(model, decode_steps=0):
    kv = model.new_sequence(256)
    out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS), "all")]))]
    for step in range(decode_steps):
        token = np.asarray([TOKENS[step % len(TOKENS)]])
        out.append(model.forward(Batch([SeqChunk(kv, kv.length, token)])))
    return np.concatenate(out)


# -- the swap policy ---------------------------------------------------------------------------

def test_policy_hysteresis():
    policy = SwapPolicy(1, 4, DynamicSettings(decay=1.0, margin=0.5, min_score=1.0, max_swaps=4))
    resident = np.array([[True, True, False, False]])
    policy.observe(np.array([[4, 6, 6, 0]]))  # 6 <= 1.5 * 4 + 1: no swap for a small lead
    assert policy.propose(resident) == []
    policy.observe(np.array([[0, 0, 2, 0]]))  # 8 > 7: expert 2 replaces the coldest (0)
    assert policy.propose(resident) == [(0, 0, 2)]


def test_policy_bounded_and_busy():
    policy = SwapPolicy(3, 4, DynamicSettings(decay=1.0, margin=0.0, min_score=0.0, max_swaps=2))
    resident = np.tile([True, True, False, False], (3, 1))
    policy.observe(np.tile([0, 0, 5, 5], (3, 1)) + np.array([[0], [1], [2]]) * np.array([0, 0, 1, 1]))
    swaps = policy.propose(resident)
    assert len(swaps) == 2 and [s[0] for s in swaps] == [2, 2]  # largest gains first
    assert policy.propose(resident, limit=1) == swaps[:1]
    busy = np.zeros_like(resident)
    busy[2] = True
    assert all(layer != 2 for layer, _, _ in policy.propose(resident, busy))


class InstantCache:
    """A cache stand-in whose swaps land at the next poll."""

    def __init__(self, resident):
        self.resident, self.pending, self.started = resident, [], 0

    def begin_swap(self, layer, out_e, in_e, stream=None):
        assert self.resident[layer, out_e] and not self.resident[layer, in_e]
        self.resident[layer, out_e] = False
        self.pending.append((layer, out_e, in_e))
        self.started += 1

    def poll(self):
        landed, self.pending = self.pending, []
        for layer, _, in_e in landed:
            self.resident[layer, in_e] = True
        return landed


def run_steps(residency, usage, steps, rng, hot):
    for step in range(steps):
        ids = np.stack([rng.choice(hot[layer](step), size=2, replace=False) for layer in range(usage.num_layers)])
        usage._decode_rows = np.ones(1, dtype=bool)
        usage.tokens_decode += 1
        for layer in range(usage.num_layers):
            usage.record(layer, ids[layer][None, :])
        residency.after_step(usage)


def test_dynamic_never_exceeds_slots_and_follows_the_load():
    L, E = 3, 8
    resident = np.zeros((L, E), dtype=bool)
    resident[:, :3] = True
    cache = InstantCache(resident)
    residency = DynamicResidency(cache, DynamicSettings(max_swaps=2))
    usage = ExpertUsage(L, E, 2)
    rng = np.random.default_rng(0)
    slots = resident.sum(axis=1).copy()
    for phase in range(3):  # the hot set moves twice
        hot = [np.arange(5, 8) - phase * 2 for _ in range(L)]
        for _ in range(80):
            run_steps(residency, usage, 1, rng, [lambda s, h=h: h for h in hot])
            in_flight = len(cache.pending)
            assert in_flight <= 2
            assert (resident.sum(axis=1) + np.bincount([p[0] for p in cache.pending], minlength=L) == slots).all()
        assert all(resident[layer, hot[layer]].all() for layer in range(L)), phase
    assert residency.hit_rate("decode") > 0.5


def test_dynamic_does_not_thrash_on_noise():
    L, E = 2, 8
    resident = np.zeros((L, E), dtype=bool)
    resident[:, :4] = True
    cache = InstantCache(resident)
    residency = DynamicResidency(cache)
    usage = ExpertUsage(L, E, 2)
    run_steps(residency, usage, 200, np.random.default_rng(1), [lambda s: np.arange(E)] * L)  # uniform routing
    assert cache.started <= 10  # hysteresis: uniform noise rarely beats the margin


# -- the expert cache's swaps and the logits ---------------------------------------------------

def test_swap_copies_the_newcomer_into_the_slot(gguf_models):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    model = Model(weights, CpuBackend())
    resident = np.zeros((weights.config.num_layers, weights.config.num_experts), dtype=bool)
    resident[:, :2] = True
    cache = ExpertCache(StandInRuntime(), model.layers, resident)
    cache.begin_swap(1, 0, 5)
    assert not resident[1, 0] and not resident[1, 5] and cache.slot_of[1, 0] == -1
    assert cache.poll() == []  # still in flight
    assert cache.poll() == [(1, 0, 5)]
    slot = cache.slot_of[1, 5]
    assert resident[1, 5] and slot == 0
    np.testing.assert_array_equal(cache.layers[1][2][slot], model.layers[1].down_exps.raw[5])
    with pytest.raises(ValueError, match="must be resident"):
        cache.begin_swap(1, 5, 1)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_dynamic_swaps_keep_logits(gguf_models, target):
    # the stand-in device runs float NumPy references: compare with the CPU's float path, not int16
    weights = load_model(gguf_models("small" if target == "Q8_0" else "kquant", target)[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend(act_quant="float")), decode_steps=6)
    resident = np.zeros((c.num_layers, c.num_experts), dtype=bool)
    resident[:, :3] = True
    backend = gpu_backend(resident=resident)
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    model.usage = ExpertUsage.for_config(c)
    model.residency = DynamicResidency(backend.cache, DynamicSettings(margin=0.0, min_score=0.0, max_swaps=3))
    got = score(model, decode_steps=6)
    assert model.residency.swaps_landed > 0
    assert (backend.resident.sum(axis=1) + [sum(s.layer == i for s in backend.cache.pending)
                                            for i in range(c.num_layers)] == 3).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


# -- where the resident set comes from, and bad input ------------------------------------------

def _placement(name, L, E, pairs):
    return Placement(name, L, E, [GpuPlacement(0, 0, L, pairs)], predicted={
        "hit_rate": 0.5, "decode_tok_s": 10.0, "step_ms": 100.0, "resident": len(pairs), "batch": 1},
        baselines={"uniform": {"hit_rate": 0.4}, "global_top": {"hit_rate": 0.45}})


def test_placement_mask_and_refusals(gguf_models, tmp_path):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    path = str(tmp_path / "placement.json")
    _placement(model_id(weights), c.num_layers, c.num_experts, [(0, 1), (2, 7)]).save(path)
    mask = resident_choice(weights, placement=path)
    assert mask.sum() == 2 and mask[0, 1] and mask[2, 7]
    _placement("other", c.num_layers + 1, c.num_experts, [(0, 1)]).save(path)
    with pytest.raises(PlacementError, match=f"{c.num_layers + 1} layers x {c.num_experts} experts"):
        resident_choice(weights, placement=path)
    other = ExpertProfile.empty("other", c.num_layers, c.num_experts + 2, 2)
    with pytest.raises(ProfileError, match=f"{c.num_experts + 2} experts"):
        resident_choice(weights, profile=other)
    with pytest.raises(ValueError, match="not both"):
        resident_choice(weights, placement=path, profile=other)


def test_budget_too_small_for_the_placement():
    mask = np.ones((2, 4), dtype=bool)
    with pytest.raises(VramError, match=r"\(8 of 8\) need 80 MiB; the expert cache has 50 MiB"):
        plan(1000 * MIB, 1000 * MIB, 800 * MIB, 100 * MIB, 30 * MIB, 20 * MIB, [10 * MIB] * 2, 4, resident=mask)


def test_profile_plans_for_the_room_left(gguf_models):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    profile = ExpertProfile.empty(model_id(weights), c.num_layers, c.num_experts, c.num_experts_per_tok)
    profile.decode[:] = np.random.default_rng(0).integers(1, 100, profile.decode.shape)
    profile.tokens_decode = 100
    choose = resident_choice(weights, profile=profile, batch=1, max_context=256)
    backend = gpu_backend(resident=choose)
    Model(weights, backend, host=CpuBackend())
    per_expert = backend.budget.expert_cache / max(backend.budget.slots_resident, 1)
    assert backend.budget.slots_resident == c.num_layers * c.num_experts  # 64 GiB stand-in: everything fits
    small = gpu_backend(resident=choose, expert_cache_mib=5.5 * per_expert / MIB)
    Model(weights, small, host=CpuBackend())
    assert small.resident.sum() == 5


def test_llm_options(gguf_models, tmp_path, monkeypatch):
    import hybrid.llm as llm_module

    def fake_select(device, cpu_options, gpu_options):
        return gpu_backend(**{k: v for k, v in gpu_options.items() if k in ("expert_cache_mib", "resident")}), \
            CpuBackend(**cpu_options)

    monkeypatch.setattr(llm_module, "select_backends", fake_select)
    path = gguf_models("small", "Q8_0")[0]
    weights = load_model(path)
    placement = str(tmp_path / "placement.json")
    _placement(model_id(weights), weights.config.num_layers, weights.config.num_experts, [(1, 3)]).save(placement)
    llm = llm_module.LLM(path, device="gpu", placement=placement)
    assert llm.model.backend.resident.sum() == 1 and llm.model.residency is None
    dynamic = llm_module.LLM(path, device="gpu", expert_cache="dynamic", expert_cache_mib=0.15)
    assert dynamic.model.residency is not None and dynamic.model.usage is not None
    assert len(set(dynamic.model.backend.resident.sum(axis=1))) == 1  # the same count in every layer
    out = dynamic.generate(TOKENS, max_tokens=4, temperature=0)
    assert len(out.token_ids) == 4


# -- the --dynamic-* flags, and the hit-rate gauge of /metrics -----------------------------------

@pytest.fixture
def stand_in_gpu(monkeypatch):
    """LLM's backends: the stand-in GPU (its expert cache over NumPy) and the CPU."""
    import hybrid.llm as llm_module

    def fake_select(device, cpu_options, gpu_options):
        return gpu_backend(**{k: v for k, v in gpu_options.items() if k in ("expert_cache_mib", "resident")}), \
            CpuBackend(**cpu_options)

    monkeypatch.setattr(llm_module, "select_backends", fake_select)


def test_dynamic_flags_reach_the_engines_settings(gguf_models, stand_in_gpu):
    from hybrid.cli import build_parser
    from hybrid.cli_options import config_of, llm_objects
    from hybrid.llm import LLM
    from server.serve import build

    path = gguf_models("small", "Q8_0")[0]
    flags = ["--device", "gpu", "--expert-cache", "dynamic", "--expert-cache-mib", "0.15", "--dynamic-decay", "0.9",
             "--dynamic-margin", "0.25", "--dynamic-min-score", "0.5", "--dynamic-max-swaps", "5",
             "--dynamic-max-pending", "3"]
    want = DynamicSettings(decay=0.9, margin=0.25, min_score=0.5, max_swaps=5, max_pending=3)
    generate = build_parser().parse_args(["generate", "--model", path, "--max-context", "256", *flags])
    assert LLM(config=config_of(generate), **llm_objects(generate)).model.residency.policy.settings == want
    serve = build_parser().parse_args(["serve", "--model", path, "--max-context", "256", *flags])
    _, engine = build(config_of(serve), llm_objects(serve))
    try:
        assert engine.model.residency.policy.settings == want
    finally:
        engine.stop()


@pytest.mark.parametrize("flag, value, message", [
    ("--dynamic-decay", "1.5", r"in \(0, 1\], got 1.5"), ("--dynamic-decay", "0", r"in \(0, 1\], got 0"),
    ("--dynamic-margin", "-1", ">= 0, got -1"), ("--dynamic-min-score", "nan", "a finite number, got 'nan'"),
    ("--dynamic-max-swaps", "0", ">= 1, got 0"),
    ("--dynamic-max-pending", "2.5", "an integer, got '2.5'")])
def test_bad_dynamic_flags_name_the_flag(flag, value, message, capsys):
    from hybrid.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--expert-cache", "dynamic", flag, value])
    assert exit_info.value.code == 2
    assert re.search(f"argument {flag}: (must be|expected) {message}", capsys.readouterr().err)


def test_dynamic_flags_need_the_dynamic_cache(capsys):
    from hybrid.cli import main

    assert main(["generate", "--dynamic-margin", "1", "--dynamic-max-swaps", "3"]) == 2
    err = capsys.readouterr().err
    assert "--dynamic-margin, --dynamic-max-swaps: only with --expert-cache dynamic" in err


def test_dynamic_settings_refuse_bad_values():
    with pytest.raises(ValueError, match=r"DynamicSettings.decay: must be in \(0, 1\], got 1.5"):
        DynamicSettings(decay=1.5)
    with pytest.raises(ValueError, match="DynamicSettings.max_swaps: must be an integer >= 1, got 1.5"):
        DynamicSettings(max_swaps=1.5)


def _gauge(client, phase):
    """strata_expert_cache_hit_rate{phase} from /metrics (None when not exported) and the routings counter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.simulate_get("/metrics").text
    samples = {(s.name, s.labels.get("phase")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples}
    return samples.get(("strata_expert_cache_hit_rate", phase)), samples[("strata_expert_routings_total", phase)]


@pytest.mark.parametrize("mode", ["auto", "dynamic"])
def test_metrics_hit_rate_moves_with_traffic(gguf_models, stand_in_gpu, tmp_path, mode):
    from falcon.testing import TestClient

    from hybrid.engine import Engine
    from hybrid.llm import LLM
    from server import create_app

    path = gguf_models("small", "Q8_0")[0]
    weights = load_model(path)
    c = weights.config
    placement = str(tmp_path / "placement.json")
    _placement(model_id(weights), c.num_layers, c.num_experts,
               [(layer, e) for layer in range(c.num_layers) for e in range(3)]).save(placement)
    llm = LLM(path, device="gpu", max_context=256, placement=placement, expert_cache=mode)
    engine = Engine(llm).start()
    try:
        client = TestClient(create_app(engine, "tiny"))
        assert _gauge(client, "decode") == (None, 0)  # no routing yet: no hit rate
        seen = []
        for prompt in (TOKENS, TOKENS[::-1][:9], [200, 201, 202]):
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            assert client.simulate_post("/v1/completions", json=body).status_code == 200
            hit_rate, routings = _gauge(client, "decode")
            usage = engine.usage
            if mode == "auto":  # the fixed mask: the share of the recorded routings on resident experts
                want = usage.decode[llm.model.backend.resident].sum() / usage.decode.sum()
            else:  # counted against each step's mask as experts swap in
                want = llm.model.residency.hits["decode"] / llm.model.residency.routed["decode"]
            assert routings == usage.decode.sum() > (seen[-1][1] if seen else 0)
            assert 0 < hit_rate < 1 and hit_rate == pytest.approx(want)
            seen.append((hit_rate, routings))
        assert len({h for h, _ in seen}) == len(seen)  # it moved with every request
        if mode == "dynamic":
            assert llm.model.residency.swaps_landed > 0
    finally:
        engine.stop()
