"""Several GPUs as pipeline stages (hybrid/staged_model.py) on two NumPy stand-in devices: logits equal the one-device
engine's for every layer split and resident share, with 1 and 4 slots; a placement planned for another split is
refused with both; no device holds more than its memory. On a real GPU presented as two logical devices (marked
gpu): the same code against the CPU engine."""
import numpy as np
import pytest

from gpu_kernels.kernels import PD_MAX_ROWS, SHORT_ATTENTION_KEYS
from gpu_kernels.numpy_runtime import NumpyRuntime
from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.staged_model import StagedModel
from hybrid.stages import auto_cuts, check_cuts, stage_ranges, stage_resident
from placement.placement import GpuPlacement, Placement, PlacementError
from tests.gpu_kernels.conftest import ReferenceKernels, dequant
from tests.hybrid.test_speculative import serve_ids

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8]
PROMPTS = [[3, 17, 42, 5, 3, 17], [99, 23, 64, 99], [7, 11, 250, 31, 8], [2, 45, 2]]
SHARES = (0.0, 0.5, 1.0)


def score(model, decode_steps=3):
    """Logits of TOKENS read as one chunk, then of decode_steps one-token steps."""
    kv = model.new_sequence(256)
    out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS), "all")]))]
    for step in range(decode_steps):
        out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[step]]))])))
    return np.concatenate(out)


class CachedKernels(ReferenceKernels):
    """The reference kernels with each weight array dequantized once (the stand-in's weights never change here; the
    cache holds the array, so its id stays its own)."""

    attention_rows = PD_MAX_ROWS  # Kernels' one-token attention planning (step graphs)
    short_attention_keys = SHORT_ATTENTION_KEYS

    def __init__(self):
        self._dequantized = {}

    def _weights(self, raw, qtype, num_cols):
        key = (id(raw), num_cols)
        if key not in self._dequantized:
            self._dequantized[key] = (raw, dequant(raw, qtype, num_cols).astype(np.float64))
        return self._dequantized[key][1]

    def matmul(self, raw, qtype, x, out, float_x=False, same_x=False):
        out[:] = x.astype(np.float64) @ self._weights(raw, qtype, x.shape[1]).T

    def moe_matmul(self, raw, qtype, x, out, tile_slot, tile_row, tile_count, tile_tokens=None):
        w = self._weights(raw, qtype, x.shape[1])  # [n, R, C]
        for slot, row, count in zip(tile_slot, tile_row, tile_count):
            out[row:row + count] = x[row:row + count].astype(np.float64) @ w[slot].T


def stand_in(resident, memory_bytes=64 << 30, index=0, **options):
    backend = GpuBackend(NumpyRuntime(index, memory_bytes), max_context=256, kv_sequences=4, resident=resident,
                         **options)
    backend.kernels = CachedKernels()
    return backend


def mask(config, share):
    return np.random.default_rng(0).random((config.num_layers, config.num_experts)) < share


@pytest.fixture(scope="module")
def small(gguf_models):
    """(weights, host backend, {share: the one-device model's logits})."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    host = CpuBackend(act_quant="float")
    one = {share: score(Model(weights, stand_in(mask(weights.config, share)), host=host)) for share in SHARES}
    return weights, host, one


def staged(weights, host, cut, share, **options):
    c = weights.config
    ranges = check_cuts((cut,), c.num_layers, 2)
    backends = [stand_in(stage_resident(r, c.num_layers, c.num_experts, mask(c, share)), index=s)
                for s, r in enumerate(ranges)]
    return StagedModel(weights, backends, ranges, host, **options)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("cut", [1, 2])
def test_two_stages_equal_one_device(small, cut, share):
    from hybrid.expert_usage import ExpertUsage

    weights, host, one = small
    model = staged(weights, host, cut, share)
    np.testing.assert_allclose(score(model), one[share], rtol=0, atol=1e-5)
    if share == 1.0:  # a decode step is one graph on each stage, its routing recorded by layer
        c = weights.config
        model.usage = usage = ExpertUsage.for_config(c)
        kv = model.new_sequence(256)
        for step in range(3):
            model.forward(Batch([SeqChunk(kv, step, np.asarray([TOKENS[step]]))]))
        assert [s.runner.last_path for s in model.stages] == ["step graph"] * 2
        assert (usage.decode.sum(axis=1) == 3 * c.num_experts_per_tok).all()
    resident = model.backend.resident
    assert resident.sum() == mask(weights.config, share).sum()
    for stage in model.stages:  # each device holds its own layers' experts only
        outside = np.ones(len(resident), dtype=bool)
        outside[stage.layer_range.start:stage.layer_range.stop] = False
        assert not stage.backend.resident[outside].any()


@pytest.mark.parametrize("cut", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_glm4moe_over_stages(glm_files, small, cut):
    """Per-layer recipes over stages: glm4moe's leading dense layer (alone on stage 0 at cut 1), its shared expert
    and sigmoid router, half of its experts resident."""
    weights = load_model(glm_files("Q8_0")[0])
    c, host = weights.config, small[1]
    one = score(Model(weights, stand_in(mask(c, 0.5)), host=host))
    ranges = check_cuts((cut,), c.num_layers, 2)
    backends = [stand_in(stage_resident(r, c.num_layers, c.num_experts, mask(c, 0.5)), index=s)
                for s, r in enumerate(ranges)]
    np.testing.assert_allclose(score(StagedModel(weights, backends, ranges, host)), one, rtol=0, atol=1e-5)


@pytest.mark.parametrize("groups", [pytest.param(1, marks=pytest.mark.slow), "auto"])
def test_mtp_drafts_over_stages(glm_files, small, groups):
    """glm4moe's NextN layer drafts on the host from the last stage's hidden rows (pipelined groups: each group's):
    greedy equals plain greedy."""
    from hybrid.speculative import SpecSettings

    weights = load_model(glm_files("F32")[0])
    c, host = weights.config, small[1]
    ranges = check_cuts((1,), c.num_layers, 2)
    backends = [stand_in(stage_resident(r, c.num_layers, c.num_experts, mask(c, 0.5)), index=s)
                for s, r in enumerate(ranges)]
    model = StagedModel(weights, backends, ranges, host, batch_groups=groups)
    plain, _ = serve_ids(model, weights.tokenizer, PROMPTS, 4, None, max_tokens=12)
    drafted, stats = serve_ids(model, weights.tokenizer, PROMPTS, 4, SpecSettings(k=4, ngram=3, min_p=0.0, mtp=True),
                               max_tokens=12)
    model.close()
    assert drafted == plain and stats.draft_n > 0


def test_without_peer_access_through_host_memory(small, monkeypatch):
    weights, host, one = small
    monkeypatch.setattr(NumpyRuntime, "can_access_peer", lambda self, other: False)
    model = staged(weights, host, 1, 0.5)
    assert [link.describe() for link in model.links] == ["through pinned host memory"]
    np.testing.assert_allclose(score(model), one[0.5], rtol=0, atol=1e-5)


@pytest.mark.parametrize("groups", ["auto", 1, 3])
def test_four_slots_equal_each_alone(small, groups):
    """4 slots at once (auto: 2 pipelined groups; 1: every slot stage after stage; 3) give each slot's tokens
    alone, and the usage record counts every routing of every group."""
    weights, host, _ = small
    model = staged(weights, host, 1, 0.5, batch_groups=groups)
    together, _ = serve_ids(model, weights.tokenizer, PROMPTS, 4, None, max_tokens=8)
    assert (model.pipeline is None) == (groups == 1)
    c, usage = weights.config, model.usage  # the engine's
    assert usage.decode.sum() == usage.tokens_decode * c.num_layers * c.num_experts_per_tok > 0
    alone = [serve_ids(model, weights.tokenizer, [p], 1, None, max_tokens=8)[0][0] for p in PROMPTS]
    assert together == alone
    model.close()


def test_drafts_and_parked_kv_over_stages(small):
    """Speculative drafts (rolled back in every stage's KV) give plain greedy's tokens; a sequence's KV exported and
    loaded again (the conversation cache) continues as the original."""
    from tests.hybrid.test_speculative import ALWAYS

    weights, host, _ = small
    model = staged(weights, host, 2, 0.5)
    plain, _ = serve_ids(model, weights.tokenizer, PROMPTS, 4, None, max_tokens=12)
    drafted, stats = serve_ids(model, weights.tokenizer, PROMPTS, 4, ALWAYS, max_tokens=12)
    assert drafted == plain and stats.draft_n_accepted > 0
    kv = model.new_sequence(256)
    model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS), "none")]))
    restored = model.new_sequence(256)
    restored.load(*kv.export(len(TOKENS)))
    step = [model.forward(Batch([SeqChunk(s, len(TOKENS), np.asarray([5]))])) for s in (kv, restored)]
    np.testing.assert_array_equal(step[0], step[1])
    model.close()


def test_default_fill_stays_in_budget(small):
    """With little memory each device fills its cache with its own layers' experts only and never holds more
    than its memory."""
    weights, host, _ = small
    c = weights.config
    backends = [stand_in(stage_resident(r, c.num_layers, c.num_experts), memory_bytes=8 << 20, index=s,
                         vram_reserve_mib=1) for s, r in enumerate(check_cuts((1,), c.num_layers, 2))]
    model = StagedModel(weights, backends, check_cuts((1,), c.num_layers, 2), host)
    for be in backends:  # placed (the start-up copy probe's transient array aside)
        assert be.rt.allocated <= be.rt.memory_bytes - (1 << 20)
        assert 0 < be.budget.slots_resident < 8 * len(be.cache.layers)
        be.rt.peak = be.rt.allocated
    assert np.isfinite(score(model)).all()
    for be in backends:
        assert be.rt.peak <= be.rt.memory_bytes


def test_trimmed_stage_weights(small, gguf_models):
    """With trim the host copies into RAM only the experts no device holds (a layer whose experts are all resident
    stays mapped from the file): no second copy of what the devices hold."""
    weights = load_model(gguf_models("small", "Q8_0")[0])  # its own: placing copies tensors
    c, host = weights.config, small[1]
    resident = np.zeros((c.num_layers, c.num_experts), dtype=bool)
    resident[0], resident[1, :4] = True, True
    ranges = check_cuts((1,), c.num_layers, 2)
    backends = [stand_in(stage_resident(r, c.num_layers, c.num_experts, resident), index=s)
                for s, r in enumerate(ranges)]
    model = StagedModel(weights, backends, ranges, host, trim=True)
    copied = {name for name, t in weights.tensors.items() if t.raw.flags.writeable}
    assert copied == {f"blk.{i}.ffn_{p}_exps.weight" for i in (1, 2) for p in ("gate", "up", "down")}
    held = {1: 4, 2: 8}  # rows of the experts the host runs
    assert model.host_bytes == sum(weights.tensors[name].raw.nbytes * held[int(name.split(".")[1])] // c.num_experts
                                   for name in copied)
    np.testing.assert_allclose(score(model), score(Model(load_model(gguf_models("small", "Q8_0")[0]),
                                                         stand_in(resident), host=host)), rtol=0, atol=1e-5)


def test_a_stage_that_cannot_hold_its_layers_is_named(small):
    from gpu_kernels.errors import VramError

    weights, host, _ = small
    c = weights.config
    ranges = check_cuts((1,), c.num_layers, 2)
    backends = [stand_in(None, memory_bytes=64 << 30), stand_in(None, memory_bytes=1 << 20, index=1)]
    with pytest.raises(VramError, match=r"stage 1 \(numpy 1, layers 1-2\): the GPU has 1 MiB free, too little"):
        StagedModel(weights, backends, ranges, host)


def test_default_fill_skips_layers_without_experts():
    """A dense layer (glm4moe's first) or another stage's layer has no expert bytes: the fill passes over it."""
    from placement.residency import default_residency

    np.testing.assert_array_equal(default_residency([0, 10, 10], 2, 30), [[0, 0], [1, 1], [1, 0]])


def test_placement_for_another_split_is_refused():
    two = Placement("m", 3, 8, [GpuPlacement(0, 0, 1, [(0, 1)]), GpuPlacement(1, 1, 3, [(2, 3)])])
    assert stage_ranges("auto", 3, [1, 1], np.ones(3), two) == [range(0, 1), range(1, 3)]
    with pytest.raises(PlacementError, match=r"planned for 2 GPU\(s\), layers 0-0, 1-2; this engine runs 2 GPUs, "
                                             r"layers 0-1, 2-2"):
        stage_ranges((2,), 3, [1, 1], np.ones(3), two)
    one = Placement("m", 3, 8, [GpuPlacement(0, 0, 3, [(0, 1)])])
    with pytest.raises(PlacementError, match=r"planned for 1 GPU\(s\), layers 0-2; this engine runs 2 GPUs"):
        stage_ranges("auto", 3, [1, 1], np.ones(3), one)


def test_gpus_setting():
    from hybrid.config import EngineConfig
    from hybrid.devices import stage_gpus

    assert stage_gpus(EngineConfig(gpus="0,0"), "gpu") == (0, 0)
    assert stage_gpus(EngineConfig(gpus="0,1"), "cpu") == ()
    with pytest.raises(ValueError, match="--gpus 1: one GPU runs as GPU 0; choose it with CUDA_VISIBLE_DEVICES=1"):
        stage_gpus(EngineConfig(gpus=1), "gpu")
    with pytest.raises(ValueError, match="expected GPU indices"):
        EngineConfig(gpus="a,b")


def test_split_checks_and_auto_cuts():
    assert auto_cuts(np.ones(4), [1, 1]) == (2,)
    assert auto_cuts(np.ones(4), [3, 1]) == (3,)
    assert auto_cuts(np.ones(3), [1, 1, 1]) == (1, 2)
    assert auto_cuts(np.ones(4), [1, 1000]) == (1,)  # at least a layer each
    with pytest.raises(ValueError, match="--layer-split 3: need 1 increasing layer indices in 1..2 for 2 GPUs"):
        check_cuts((3,), 3, 2)
    with pytest.raises(ValueError, match="3 GPUs for 2 layers"):
        auto_cuts(np.ones(2), [1, 1, 1])


@pytest.fixture
def stand_in_gpus(monkeypatch):
    """LLM(device="gpu") over NumPy stand-in devices: one per --gpus entry."""
    from gpu_kernels import runtime as gpu_runtime
    from hybrid import devices
    from hybrid.backends import gpu as gpu_backend

    monkeypatch.setattr(gpu_runtime, "probe", lambda: gpu_runtime.Probe(NumpyRuntime(), ""))
    monkeypatch.setattr(gpu_backend, "Kernels", lambda runtime, stream=None, **options: CachedKernels())
    monkeypatch.setattr(devices, "open_runtimes", lambda gpus: [NumpyRuntime(i, 1 << 30) for i in range(len(gpus))])


def test_llm_over_two_stand_in_gpus(stand_in_gpus, gguf_models, tmp_path):
    """The settings' path (--gpus 0,0 --layer-split 2): llm.score equals one device's; a placement planned for
    another split is refused naming both."""
    from hybrid import LLM

    path, _ = gguf_models("small", "Q8_0")
    options = dict(device="gpu", max_context=256, act_quant="float", vram_reserve_mib=64)
    one = LLM(path, gpus=(0,), **options)
    two = LLM(path, gpus=(0, 0), layer_split=(2,), trim_stage_weights=True, **options)
    assert [s.layer_range for s in two.model.stages] == [range(0, 2), range(2, 3)]
    np.testing.assert_allclose(two.score(TOKENS), one.score(TOKENS), rtol=0, atol=1e-5)
    assert "GPU stage 1: KV" in two.model.backend.describe_kv(two.model.kv_pool, 256)
    assert_gpu_metrics(two)
    placement = Placement("m", 3, 8, [GpuPlacement(0, 0, 1, [(0, 1)]), GpuPlacement(1, 1, 3, [(2, 3)])])
    placement.save(tmp_path / "p.json")
    with pytest.raises(PlacementError, match="layers 0-0, 1-2; this engine runs 2 GPUs, layers 0-1, 2-2"):
        LLM(path, gpus=(0, 0), layer_split=(2,), placement=str(tmp_path / "p.json"), **options)
    with LLM(path, gpus=(0, 0), placement=str(tmp_path / "p.json"), **options) as llm:  # auto: the placement's
        assert [s.layer_range for s in llm.model.stages] == [range(0, 1), range(1, 3)]
        assert [int(s.backend.resident.sum()) for s in llm.model.stages] == [1, 1]


def assert_gpu_metrics(llm):
    """/metrics of an engine over the stages: each GPU's busy time and hit rate (its layers' pairs it holds)."""
    from prometheus_client import generate_latest

    from hybrid.engine import Engine
    from server.metrics import registry_for

    engine = Engine(llm, num_slots=1, max_queue=0)  # never started: the model is run by hand
    llm.score(TOKENS)
    text = generate_latest(registry_for(engine)).decode()
    for stage in ("0", "1"):
        assert f'strata_gpu_busy_seconds_total{{device="{llm.model.stages[int(stage)].backend.rt.device_name}",' \
               f'stage="{stage}"}}' in text
        assert f'strata_gpu_expert_cache_hit_rate{{phase="prefill",stage="{stage}"}} 1.0' in text  # all resident


def test_profile_plans_the_stages_at_start_up(stand_in_gpus, gguf_models):
    from hybrid import LLM
    from placement.profile import ExpertProfile, model_id

    path, _ = gguf_models("small", "Q8_0")
    weights = load_model(path)
    c = weights.config
    profile = ExpertProfile.empty(model_id(weights), c.num_layers, c.num_experts, c.num_experts_per_tok)
    profile.decode[:] = np.random.default_rng(0).integers(1, 100, profile.decode.shape)
    profile.tokens_decode = 100
    with LLM(path, device="gpu", gpus=(0, 0), profile=profile, max_context=256, vram_reserve_mib=64) as llm:
        assert len(llm.model.stages) == 2
        for stage in llm.model.stages:
            assert stage.backend.resident[stage.layer_range.start:stage.layer_range.stop].any()
        assert np.isfinite(llm.score(TOKENS)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("size,target,cut", [("small", "Q8_0", 1), ("small", "Q8_0", 2), ("kquant", "Q4_K_M", 1)],
                         ids=["split-1of3", "split-2of3", "split-1of2"])
def test_one_gpu_as_two_logical_devices(gguf_models, size, target, cut, share):
    """llm.score within 2e-3 of the CPU engine's, greedy equal, and 4 slots equal to each alone, over one GPU
    presented as two devices (--gpus 0,0), at splits 1/3 and 2/3 (the 3-layer model) and 1/2 (the 2-layer one)."""
    from gpu_kernels.runtime import probe
    from hybrid import LLM

    if probe().runtime is None:
        pytest.skip("no GPU")
    path, _ = gguf_models(size, target)
    cpu = LLM(path, device="cpu", max_context=256, act_quant="float")
    resident = mask(cpu.config, share)
    llm = LLM(path, device="gpu", gpus=(0, 0), layer_split=(cut,), max_context=256, act_quant="float",
              kv_sequences=4, resident=resident)
    assert [s.layer_range for s in llm.model.stages] == check_cuts((cut,), cpu.config.num_layers, 2)
    np.testing.assert_allclose(llm.score(TOKENS), cpu.score(TOKENS), rtol=0, atol=2e-3)
    greedy = dict(max_tokens=12, temperature=0, ignore_eos=True)
    assert llm.generate(TOKENS, **greedy).token_ids == cpu.generate(TOKENS, **greedy).token_ids
    together, _ = serve_ids(llm.model, llm.tokenizer, PROMPTS, 4, None, max_tokens=8)
    alone = [serve_ids(llm.model, llm.tokenizer, [p], 1, None, max_tokens=8)[0][0] for p in PROMPTS]
    assert together == alone
    for stage in llm.model.stages:
        free, total = stage.backend.rt.memory_info()
        assert stage.backend.budget.dense + stage.backend.budget.kv + stage.backend.budget.expert_cache <= free
