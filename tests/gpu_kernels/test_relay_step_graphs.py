"""Hybrid decode steps (host experts through the decode relay) as one graph (hybrid/step_graph.py, relay_graphs) on
GpuBackend's Python side over the NumPy stand-in runtime with mapped memory, the reference kernels and the real relay
worker: the graph posts each relayed layer's routing and waits for its rows inside it, reading the step's number from
the device, so one capture serves every step. Its logits are the layer-by-layer relay's bit for bit at several
resident shares, for one user and several, across many steps and after an expert-cache change (captured again)."""
import numpy as np
import pytest

from gpu_kernels.numpy_runtime import NumpyRuntime
from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.expert_usage import ExpertUsage
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.split_settings import SplitSettings
from tests.gpu_kernels.conftest import greedy_reference
from tests.gpu_kernels.test_backend_wiring import TOKENS


def _model(weights, reference_kernels, resident, graphs, users=1):
    """The host with its default int16 x (the graphed and the layer-by-layer steps share it; its relay compiles are
    test_hybrid_moe's)."""
    backend = GpuBackend(NumpyRuntime(mapped_memory=True), max_context=512, kv_sequences=users, resident=resident,
                         prefill_borrow=False)  # borrowing follows measured times: the prompts' logits would vary
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend(),
                  split=SplitSettings(relay_tokens=max(users, 1), relay_graphs=graphs))
    model.usage = ExpertUsage.for_config(weights.config)
    return model


def _step_graphs(model):
    return [graph for key, (_, _, graph) in model.backend.layer_graphs._regions.items() if key[0] == "step"]


def _decode(model, prompts, steps, after=None):
    """Each user's prompt, then `steps` decode steps of every user at once; after(model, t) runs after step t.
    Returns the logits [steps + 1, users, V] and the runner's paths of the decode steps."""
    kvs = [model.new_sequence(512) for _ in prompts]
    logits = [np.concatenate([model.forward(Batch([SeqChunk(kv, 0, p, "last")])) for kv, p in zip(kvs, prompts)])]
    paths = []
    try:
        for t in range(steps):
            tokens = [np.asarray([TOKENS[(t + 3 * u) % len(TOKENS)]]) for u in range(len(kvs))]
            logits.append(model.forward(Batch([SeqChunk(kv, kv.length, tokens[u]) for u, kv in enumerate(kvs)])))
            paths.append(model.runner.last_path)
            if after is not None:
                after(model, t)
    finally:
        model.close()
    return np.array(logits), paths


@pytest.mark.parametrize("users", [1, 3])
def test_a_hybrid_step_is_one_graph_and_matches_the_layer_by_layer_relay(gguf_models, reference_kernels, users):
    """0 %, 50 % (one layer fully resident, one with none) and all but one expert resident: every decode step of
    `users` tokens is one step graph after the first, captured once and launched at every later step with the step's
    number read from the device; the logits and the usage record are the layer-by-layer relay's bit for bit."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    rng = np.random.default_rng(users)
    prompts = [rng.integers(1, c.vocab_size, n) for n in (40, 9, 23)[:users]]
    half = rng.random((c.num_layers, c.num_experts)) < 0.5
    half[0], half[1] = True, False
    almost = np.ones((c.num_layers, c.num_experts), bool)
    almost[-1, 0] = False
    steps = 6
    for name, resident in (("0 %", np.zeros_like(half)), ("50 %", half), ("all but one", almost)):
        ref_model = _model(weights, reference_kernels, resident.copy(), False, users)
        ref, ref_paths = _decode(ref_model, prompts, steps)
        model = _model(weights, reference_kernels, resident.copy(), True, users)
        got, paths = _decode(model, prompts, steps)
        np.testing.assert_array_equal(got, ref, err_msg=name)
        assert set(paths) == {"step graph"}, name
        assert "step graph" not in ref_paths, name
        assert [g.launches for g in _step_graphs(model)] == [steps - 1], name  # the first step runs uncaptured
        for field in ("prefill", "decode", "coactivation"):
            np.testing.assert_array_equal(getattr(model.usage, field), getattr(ref_model.usage, field),
                                          err_msg=f"{name} {field}")


def test_an_expert_cache_change_captures_the_step_again(gguf_models, reference_kernels):
    """Experts swapped in the cache between steps: while layer 0's only resident expert is on its way out (swap begun,
    not landed) the device has nothing of that layer and the step runs a graph captured for that split; once the swap
    lands the first graph is launched again, and a swap that keeps each layer's shape (layer 1's, landed at once)
    keeps the graph, its device part reading the new slots. Every step's logits are the layer-by-layer relay's with
    the same swaps."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    resident = np.random.default_rng(6).random((c.num_layers, c.num_experts)) < 0.5
    resident[0] = False
    resident[0, 0] = True
    prompts = [np.random.default_rng(5).integers(1, c.vocab_size, 30)]
    held, absent = int(np.flatnonzero(resident[1])[0]), int(np.flatnonzero(~resident[1])[0])

    def swap(model, t):
        cache = model.backend.cache
        if t == 1:
            cache.begin_swap(0, 0, 3, model.backend.stream)
        if t == 3:
            cache.poll()
        if t == 4:
            cache.begin_swap(1, held, absent, model.backend.stream)
            cache.poll()

    ref, _ = _decode(_model(weights, reference_kernels, resident.copy(), False), prompts, 8, swap)
    model = _model(weights, reference_kernels, resident.copy(), True)
    got, paths = _decode(model, prompts, 8, swap)
    np.testing.assert_array_equal(got, ref)
    assert set(paths) == {"step graph"}
    assert model.split.resident[0, 3] and model.split.resident[1, absent] and not model.split.resident[1, held]
    assert sorted(g.launches for g in _step_graphs(model)) == [1, 5]  # steps 2-3; steps 0-1 and 4-7


def test_a_host_that_does_not_answer_fails_the_step_in_one_timeout(gguf_models, reference_kernels):
    """The relay's host jobs lost (never reaching the worker) at a launch of a captured step graph: the step fails with
    an error that names layer 0, after one timeout rather than one a layer, and the next step runs again."""
    import time

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    model = _model(weights, reference_kernels, np.zeros((c.num_layers, c.num_experts), bool), True)
    kv = model.new_sequence(512)
    model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:5]), "last")]))
    model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[0]]))]))  # the relay's worker made, uncaptured
    relay, timeout_s = model.split.relay, 0.3
    relay.worker.timeout_s = timeout_s  # the graph captured next waits this long
    model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[1]]))]))
    real_submit = relay.worker.submit
    relay.worker.submit = lambda *args, **kwargs: None
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="layer 0: the device waited"):
            model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[2]]))]))
    finally:
        relay.worker.submit = real_submit
    assert time.perf_counter() - t0 < timeout_s * (c.num_layers - 0.5)
    model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[2]]))]))
    assert model.runner.last_path == "step graph" and _step_graphs(model)[0].launches == 3
    model.close()


@pytest.mark.gpu
@pytest.mark.parametrize("users", [1, 3])
def test_on_a_gpu_the_graphed_hybrid_step_matches_the_layer_by_layer_relay(runtime, gguf_models, users):
    """On a GPU (real kernels, mapped memory, the relay kernels reading the step's number from the device): at 0 % and
    50 % resident, 8 decode steps as one replayed graph each give the layer-by-layer relay's logits (the attention's
    key splits may be planned for another bound: within 1e-5 of the largest) and the same greedy tokens."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, c.vocab_size, n) for n in (40, 9, 23)[:users]]
    half = rng.random((c.num_layers, c.num_experts)) < 0.5

    def model(resident, graphs):
        backend = GpuBackend(runtime, max_context=512, kv_sequences=users, resident=resident.copy(),
                             prefill_borrow=False)
        return Model(weights, backend, host=CpuBackend(), split=SplitSettings(relay_tokens=users, relay_graphs=graphs))

    for name, resident in (("0 %", np.zeros_like(half)), ("50 %", half)):
        ref, _ = _decode(model(resident, False), prompts, 8)
        graphed = model(resident, True)
        got, paths = _decode(graphed, prompts, 8)
        assert set(paths) == {"step graph"}, name
        graphs = _step_graphs(graphed)
        assert len(graphs) == 1 and graphs[0] is not None, name  # captured once, launched at every later step
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=name)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_on_a_gpu_an_llm_with_relay_graphs_decodes_the_cpu_engines_tokens(runtime, gguf_models, target):
    """LLM(relay_graphs=True), as a server would run it: greedy decode at 0 % and 50 % resident gives the CPU engine's
    tokens, every decode step after the first a launch of one step graph, and four users at once (relay_tokens 4)
    decode as one step graph a step, the first user's logits within 2e-3 of its own alone."""
    from hybrid import LLM

    path, prompt, ref_tokens, masks = greedy_reference(gguf_models, target)
    for name, mask in masks.items():
        with LLM(path, device="gpu", max_context=512, kv_sequences=4, resident=mask, relay_graphs=True,
                 relay_tokens=4) as gpu:
            assert gpu.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True).token_ids == ref_tokens, name
            assert gpu.model.runner.last_path == "step graph", name
            graphs = _step_graphs(gpu.model)
            assert len(graphs) == 1 and graphs[0] is not None, name
            prompts = [np.asarray(prompt[:n]) for n in (10, 7, 5, 9)]
            alone, _ = _decode(gpu.model, prompts[:1], 4)
            together, paths = _decode(gpu.model, prompts, 4)
            assert set(paths) == {"step graph"}, name
            scale = np.abs(alone).max()
            np.testing.assert_allclose(together[:, 0], alone[:, 0], rtol=0, atol=2e-3 * scale, err_msg=name)
