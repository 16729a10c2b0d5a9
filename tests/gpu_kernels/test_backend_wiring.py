"""GpuBackend's Python side on the CPU: NumPy arrays for device arrays, NumPy references for the kernels.

Checks the backend's shapes, arguments, work tiles and the expert cache's slots against the plain
CPU engine, at 0, 50 and 100 % of the experts resident; the GPU tests run the same with real kernels.
"""
import gc
import weakref

import numpy as np
import pytest

from hybrid.backends import CpuBackend as HostBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model


def CpuBackend():  # noqa: N802
    """The reference kernels multiply in float, and so does the CPU engine here: its default int16 x (decode and
    prefill) moves these tiny random models' logits by up to ~3e-4 of their largest, more than the 2e-4 these
    wiring checks allow (the GPU tests compare real kernels with the default engine at 2e-3)."""
    return HostBackend(act_quant="float")


TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


def score(model):
    kv = model.new_sequence(256)
    prefill = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-1]), "all")]))
    decode = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[-1:]))]))
    return np.concatenate([prefill, decode])


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_gpu_backend_wiring_matches_cpu(gguf_models, numpy_runtime, reference_kernels, target):
    weights = load_model(gguf_models("small" if target == "Q8_0" else "kquant", target)[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend()))
    rng = np.random.default_rng(0)
    for fraction in (0.0, 0.5, 1.0):
        backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=rng.random((c.num_layers, c.num_experts)) < fraction)
        backend.kernels = reference_kernels
        got = score(Model(weights, backend, host=CpuBackend()))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max(), err_msg=f"{fraction:.0%}")


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_expert_graphs_replay_per_layer(gguf_models, numpy_runtime, reference_kernels, graphs):
    """Each layer with resident experts captures its one-token expert launches once; every later decode
    step replays them over that step's inputs (copied into the fixed scratch) and the logits stay the
    CPU engine's, with graphs or without (the dense launches' own graphs off, so the captures counted are the
    experts')."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    resident = np.random.default_rng(2).random((c.num_layers, c.num_experts)) < 0.5
    resident[0] = False  # a layer the device has nothing of: no graph
    resident[1] = True  # a fully resident layer: no routing wait, still a graph

    def decode(model, steps=4):
        kv = model.new_sequence(64)
        out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:5]), "last")]))]
        for t in TOKENS[5:5 + steps]:
            out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])))
        return np.concatenate(out)

    ref = decode(Model(weights, CpuBackend()))
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=resident, decode_graphs=graphs,
                         dense_graphs=False)
    backend.kernels = reference_kernels
    got = decode(Model(weights, backend, host=CpuBackend()))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    if graphs:
        expert_graphs = backend.device_experts._graphs
        # one-token graphs of every layer with resident experts, and the fully resident layer 1's for the 5-token
        # prompt (a step that small runs as a decode step there)
        assert numpy_runtime.captures == c.num_layers and (1, 0) not in expert_graphs and expert_graphs[(5, 1)]
        assert all(g.launches == (4 if tokens == 1 else 1) for (tokens, _), g in expert_graphs.items())
        # each graph: tiles and gather, gate and up (one launch: one format), SwiGLU, down, combine
        assert all(len(g.calls) == 5 for g in expert_graphs.values())
    else:
        assert numpy_runtime.captures == 0 and not backend.device_experts._graphs


def prompt_then_decode(model):
    """Logits [5, V]: a 4-token prompt's last, then 4 one-token decode steps, on one new sequence."""
    kv = model.new_sequence(64)
    out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:4]), "last")]))]
    out += [model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])) for t in TOKENS[4:8]]
    return np.concatenate(out)


def test_warm_up_runs_on_a_one_slot_gpu_backend_and_leaves_no_trace(gguf_models, numpy_runtime, reference_kernels):
    """LLM.warm_up's steps (two scratch sequences, a long chunk, a mixed and a two-sequence step) on the GpuBackend
    that `strata serve --parallel 1` makes: they run, and a request after them gets the logits of a model that never
    warmed up, bit for bit (the dense graphs captured on scratch sequences replay over the request's)."""
    from hybrid.warm_up import long_chunk_tokens, warm_up

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    resident = np.random.default_rng(4).random((c.num_layers, c.num_experts)) < 0.5

    def model():
        backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=1, resident=resident)
        backend.kernels = reference_kernels
        return Model(weights, backend, host=CpuBackend())

    cold, warmed = model(), model()
    assert warm_up(warmed, long_chunk_tokens(warmed.backend, c, 512, 256), progress=False) > 0
    np.testing.assert_array_equal(prompt_then_decode(warmed), prompt_then_decode(cold))


@pytest.mark.parametrize("target,fraction", [("Q8_0", 0.0), ("Q8_0", 0.5), ("Q4_K_M", 0.5), ("Q8_0", 1.0),
                                             ("F16", 0.0), ("BF16", 0.5), ("F32", 0.5), ("Q4_0", 0.5), ("Q5_K", 0.5),
                                             ("Q6_K", 1.0)])
def test_dense_graphs_replay_each_layer_bit_identically(gguf_models, numpy_runtime, reference_kernels, monkeypatch,
                                                        target, fraction):
    """STRATA_DENSE_GRAPHS=1: two sequences decoding in turn give the logits of the same backend without the
    graphs, bit for bit; each layer's two regions run once as they are, are captured at the next decode step and
    replayed at every one after, over that step's residual stream and position; with every expert resident, the
    whole step is one graph instead, which both sequences replay."""
    weights = load_model(gguf_models("kquant" if "_K" in target else "small", target)[0])
    c = weights.config
    resident = np.random.default_rng(3).random((c.num_layers, c.num_experts)) < fraction

    def decode(dense_graphs, steps=3):
        backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=resident,
                             dense_graphs=dense_graphs)
        backend.kernels = reference_kernels
        model = Model(weights, backend, host=CpuBackend())
        kvs = [model.new_sequence(64) for _ in range(2)]
        out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[u:u + 4 + u]), "last")]))
               for u, kv in enumerate(kvs)]
        for step in range(steps):
            for u, kv in enumerate(kvs):
                out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[9 + 2 * step + u]]))])))
        return np.concatenate(out), backend

    ref, plain = decode(False)
    got, graphed = decode(True)
    np.testing.assert_array_equal(got, ref)
    assert plain.layer_graphs is None
    regions = graphed.layer_graphs._regions
    if fraction == 1.0:  # every expert resident: the whole step is one graph, shared by both sequences
        assert [key[0] for key in regions] == ["step"]
        assert all(graph is not None and graph.launches == 2 * 3 - 1 for _, _, graph in regions.values())
        return
    assert sorted(regions) == sorted((r, i) for r in (0, 1) for i in range(c.num_layers))  # two regions a layer
    assert all(graph is not None and graph.launches == 2 * 3 - 1 for _, _, graph in regions.values())


@pytest.mark.parametrize("dense_graphs", [False, True])
def test_a_dropped_backend_is_freed_at_once(gguf_models, numpy_runtime, reference_kernels, dense_graphs):
    """No reference cycle holds a backend that has decoded (with the dense graphs or without): dropping the last
    reference frees it and its buffers then, not whenever the cyclic garbage collector runs, which may be in the
    middle of another model's decode step."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    backend = GpuBackend(numpy_runtime, max_context=256, resident=np.random.default_rng(4).random(
        (c.num_layers, c.num_experts)) < 0.5, dense_graphs=dense_graphs)
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    prompt_then_decode(model)
    if dense_graphs:
        assert all(graph is not None for _, _, graph in backend.layer_graphs._regions.values())
    refs = [weakref.ref(backend), weakref.ref(model)]
    gc.disable()
    try:
        del backend, model
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_dense_graphs_fall_back_where_capture_fails(gguf_models, numpy_runtime, reference_kernels, monkeypatch,
                                                    caplog):
    """A runtime that cannot capture: one warning, the layers run op by op, the logits unchanged."""
    weights = load_model(gguf_models("small", "Q8_0")[0])

    def decode(dense_graphs):
        backend = GpuBackend(numpy_runtime, max_context=256, resident=None, dense_graphs=dense_graphs)
        backend.kernels = reference_kernels
        return prompt_then_decode(Model(weights, backend, host=CpuBackend())), backend

    ref, _ = decode(False)

    def no_graphs(stream, queue):
        raise RuntimeError("stream capture is not supported here")

    monkeypatch.setattr(numpy_runtime, "capture", no_graphs)
    with caplog.at_level("WARNING"):
        got, backend = decode(True)
    np.testing.assert_array_equal(got, ref)
    assert not backend.layer_graphs.enabled and not backend.layer_graphs._regions
    assert sum("decode layers run op by op" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("relay_tokens", [3, 1])
def test_a_decode_step_of_several_users_runs_its_resident_pairs_from_the_device_routing(gguf_models, numpy_runtime,
                                                                                         reference_kernels,
                                                                                         relay_tokens):
    """A fully resident layer's decode step of three sequences' tokens (relay_tokens or not) packs their routing and
    rows into the three-token scratch and runs its pairs from there (one graph a layer for that count, replayed at
    the next step), without reading the routing back; the logits stay the CPU engine's. Step graphs off: with them
    the whole step is one graph (tests/gpu_kernels/test_multi_step_graphs.py)."""
    from hybrid.batch import Batch, SeqChunk

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config

    def steps(model, users=3):
        kvs = [model.new_sequence(64) for _ in range(users)]
        for u, kv in enumerate(kvs):
            model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[u:u + 5]), "last")]))
        return np.concatenate([model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[8 + s + u]]))
                                                    for u, kv in enumerate(kvs)])) for s in range(2)])

    ref = steps(Model(weights, CpuBackend()))
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=3,
                         resident=np.ones((c.num_layers, c.num_experts), bool), step_graphs=False)
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    model.split.relay.tokens = relay_tokens
    fetched = []
    backend.fetch_routing = lambda ids, weights: fetched.append(ids) or (ids, weights)
    got = steps(model)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    assert not fetched  # the 5-token prompts' routing neither: a step this small runs as a decode step too
    graphs = {key: g for key, g in backend.device_experts._graphs.items() if key[0] == 3}
    assert sorted(graphs) == [(3, i) for i in range(c.num_layers)]
    assert all(g.launches == 2 for g in graphs.values())  # one replay a step, the first after its capture
    assert backend.device_experts._decode[3][1]["out"].shape == (c.num_layers, 3, c.hidden_size)


class ProjectionCounter:
    """Reference kernels that count the dense matmuls of each row count and the RoPE launches (alone or with the
    heads' norms) of each head count."""

    def __init__(self, kernels):
        self.kernels, self.matmul_rows, self.rope_heads = kernels, [], []

    def __getattr__(self, name):
        return getattr(self.kernels, name)

    def matmul(self, raw, qtype, x, out, float_x=False, same_x=False):
        self.matmul_rows.append((x.shape[0], raw.shape[0], qtype))
        self.kernels.matmul(raw, qtype, x, out, float_x)

    def rope_neox(self, x, positions, inv_freq, scale=1.0):
        self.rope_heads.append(x.shape[:2])
        self.kernels.rope_neox(x, positions, inv_freq, scale)

    def qk_norm_rope(self, x, *args):
        self.rope_heads.append(x.shape[:2])
        self.kernels.qk_norm_rope(x, *args)


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_one_token_projects_each_run_of_one_type_with_one_matmul(gguf_models, numpy_runtime, reference_kernels,
                                                                  target):
    """q, k and v weights of one type share one device array: a decode token projects them in one matmul (Q4_K_M:
    q and k in one, its Q6_K v in another) and ropes q and k in one launch; a prompt chunk still runs three matmuls
    over the same device rows. The logits stay the CPU engine's."""
    from gguf import GGMLQuantizationType as Q

    weights = load_model(gguf_models("small" if target == "Q8_0" else "kquant", target)[0])
    c = weights.config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    backend = GpuBackend(numpy_runtime, max_context=256, resident=np.ones((c.num_layers, c.num_experts), bool))
    counter = backend.kernels = ProjectionCounter(reference_kernels)
    logits = {}
    for name, model in (("gpu", Model(weights, backend, host=CpuBackend())), ("cpu", Model(weights, CpuBackend()))):
        kv = model.new_sequence(64)
        prompt = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:5]), "last")]))
        prompt_rows = list(counter.matmul_rows)
        counter.matmul_rows.clear(), counter.rope_heads.clear()
        step = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[5:6]))]))
        logits[name] = np.concatenate([prompt, step])
        if name == "gpu":
            layer = model.layers[0]
            decode_rows, decode_ropes, chunk_rows = list(counter.matmul_rows), list(counter.rope_heads), prompt_rows
    ref = logits["cpu"]
    np.testing.assert_allclose(logits["gpu"], ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    qkv = [(1, q_rows + 2 * kv_rows, Q.Q8_0)] if target == "Q8_0" else [(1, q_rows + kv_rows, Q.Q4_K),
                                                                          (1, kv_rows, Q.Q6_K)]
    if target == "Q4_K_M":
        assert layer.attn_v.qtype == Q.Q6_K and layer.attn_q.qtype == layer.attn_k.qtype == Q.Q4_K
    for row in qkv:
        assert decode_rows.count(row) == c.num_layers, decode_rows
    assert decode_ropes == [(1, c.num_heads + c.num_kv_heads)] * c.num_layers
    assert sum(r == q_rows for _, r, _ in chunk_rows) >= c.num_layers  # the prompt's own q matmuls, 5 rows each
    assert all(t == 5 for t, r, _ in chunk_rows if r in (q_rows, kv_rows))


POISON = 7  # a prompt holding this token id makes the device's expert launches fail


class FaultyBackend(GpuBackend):
    """GpuBackend whose grouped expert launches fail (as a failed CUDA launch would) in a forward
    pass whose tokens hold POISON."""

    def embed(self, weight, token_ids):
        self.armed = POISON in token_ids
        return super().embed(weight, token_ids)

    def submit(self, *args, **kwargs):
        if self.armed:
            raise RuntimeError("CUDA error: unspecified launch failure (injected)")
        return super().submit(*args, **kwargs)


def _serve(model, tokenizer, prompts):
    from types import SimpleNamespace

    from hybrid.engine import Engine
    from hybrid.request import Request
    from hybrid.sampling import SamplingParams

    engine = Engine(SimpleNamespace(model=model, tokenizer=tokenizer, max_context=256), num_slots=2).start()
    try:
        handles = [engine.submit(Request(p, SamplingParams(max_tokens=4, temperature=0))) for p in prompts]
        return [h.result() for h in handles], engine.stats.requests
    finally:
        engine.stop()


def test_gpu_failure_fails_the_request_and_the_engine_keeps_serving(gguf_models, numpy_runtime, reference_kernels):
    from hybrid.request import Failed, Finished

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    good = [3, 17, 42, 5, 99]
    ref, _ = _serve(Model(weights, CpuBackend()), weights.tokenizer, [good])
    backend = FaultyBackend(numpy_runtime, max_context=512, resident=np.ones((c.num_layers, c.num_experts), bool))
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    results, counts = _serve(model, weights.tokenizer, [[POISON, 8, 9], good])
    assert isinstance(results[0], Failed)
    assert isinstance(results[1], Finished) and results[1].token_ids == ref[0].token_ids
    assert counts == {"error": 1, "length": 1}
    again, _ = _serve(model, weights.tokenizer, [good])  # the backend still serves after the failure
    assert again[0].token_ids == ref[0].token_ids


def test_gpu_backend_prefill_borrow_matches_cpu(gguf_models, numpy_runtime, reference_kernels):
    """Nothing resident, a 48-token chunk: the cost model borrows experts into the device part."""
    weights = load_model(gguf_models("kquant", "Q4_K_M")[0])
    c = weights.config
    tokens = list(np.resize(TOKENS, 48))
    ref = Model(weights, CpuBackend())
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=np.zeros((c.num_layers, c.num_experts), bool))
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    backend.borrow_bytes_per_second = 1e15  # copies cost nothing: every expert with pairs is borrowed
    model.split.trace = []
    got, want = (m.forward(Batch([SeqChunk(m.new_sequence(256), 0, np.asarray(tokens), "all")])) for m in (model, ref))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    assert all(t["borrowed"] > 0 for t in model.split.trace)


def test_device_kv_parks_in_host_ram_and_restores(gguf_models, numpy_runtime, reference_kernels):
    """A device KV cache exports to host arrays for the conversation cache and loads them back."""
    from hybrid.backends.gpu import DeviceSequenceKV
    from hybrid.conversation_cache import ConversationCache, model_fingerprint

    weights = load_model(gguf_models("small", "Q8_0")[0])
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=np.ones((3, 8), dtype=bool))
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    kv = model.new_sequence(256)
    assert isinstance(kv, DeviceSequenceKV)
    full = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS), "all")]))
    cache = ConversationCache(1 << 24, model_fingerprint(weights), block_tokens=8)
    cache.park(TOKENS, kv)
    assert all(type(a) is np.ndarray for a in cache.entries[0].arrays.values())
    restored = model.new_sequence(256)
    n = cache.restore(TOKENS + [1], restored)
    assert n == 16
    rest = model.forward(Batch([SeqChunk(restored, n, np.asarray(TOKENS[n:]), "all")]))
    np.testing.assert_allclose(rest, full[n:], rtol=0, atol=1e-5 * np.abs(full).max())


def test_swaps_keep_the_device_slot_map_in_step(gguf_models, numpy_runtime, reference_kernels):
    """Decode finds resident pairs from the device's slot map: a swap takes both experts out of it at
    once, its landing puts the newcomer in, and the model's logits stay the CPU engine's throughout."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    resident = np.zeros((c.num_layers, c.num_experts), bool)
    resident[:, :3] = True
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=resident)
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    ref = score(Model(weights, CpuBackend()))
    cache = backend.cache
    cache.begin_swap(1, 0, 5, backend.stream)
    assert cache.slot_map[1, 0] == -1 and cache.slot_map[1, 5] == -1
    np.testing.assert_array_equal(cache.slot_map, cache.slot_of)
    np.testing.assert_allclose(score(model), ref, rtol=0, atol=2e-4 * np.abs(ref).max())  # mid-swap
    assert cache.poll() == [(1, 0, 5)]
    assert cache.slot_map[1, 5] == 0 and resident[1, 5] and not resident[1, 0]
    np.testing.assert_array_equal(cache.slot_map, cache.slot_of)
    np.testing.assert_allclose(score(model), ref, rtol=0, atol=2e-4 * np.abs(ref).max())  # after landing


def test_split_records_the_usage_of_the_plain_path(gguf_models, numpy_runtime, reference_kernels):
    """Every layer's routing reaches the ExpertUsage once, also from fully resident layers, whose
    decode routing is copied without a wait and recorded at the end of the step."""
    from hybrid.expert_usage import ExpertUsage

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    mask = np.random.default_rng(0).random((c.num_layers, c.num_experts)) < 0.5
    mask[0] = True  # a fully resident layer

    def recorded(model):
        model.usage = ExpertUsage.for_config(c)
        score(model)
        return model.usage

    ref = recorded(Model(weights, CpuBackend()))
    backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=mask)
    backend.kernels = reference_kernels
    got = recorded(Model(weights, backend, host=CpuBackend()))
    assert got.tokens_decode == ref.tokens_decode == 1 and got.tokens_prefill == ref.tokens_prefill
    for name in ("prefill", "decode", "coactivation"):
        np.testing.assert_array_equal(getattr(got, name), getattr(ref, name), err_msg=name)


def _long_score(model, tokens, chunk):
    """Logits of `tokens` read `chunk` at a time, then two decode steps."""
    kv, read = model.new_sequence(512), len(tokens) - 2
    out = [model.forward(Batch([SeqChunk(kv, lo, np.asarray(tokens[lo:min(lo + chunk, read)]), "all")]))
           for lo in range(0, read, chunk)]
    for t in tokens[len(tokens) - 2:]:
        out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])))
    return np.concatenate(out), kv


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "int8"])
@pytest.mark.parametrize("resident_tokens,host_attention", [(None, "cpu"), (64, "cpu"), (100, "gpu")])
def test_device_kv_encodings_and_resident_window(gguf_models, numpy_runtime, reference_kernels, kv_dtype,
                                                 resident_tokens, host_attention):
    """The device KV in each encoding, all in VRAM or with only the newest blocks there (the rest in RAM,
    attended by the host and merged, or staged back to the device), gives the CPU engine's logits with
    the same encoding; the blocks past the window really left VRAM."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    tokens = list(np.resize(TOKENS, 300))
    want, _ = _long_score(Model(weights, CpuBackend(), kv_dtype=kv_dtype), tokens, 48)
    backend = GpuBackend(numpy_runtime, max_context=512, chunk_tokens=48, kv_dtype=kv_dtype,
                         kv_resident=resident_tokens, kv_host_attention=host_attention,
                         resident=np.random.default_rng(1).random((c.num_layers, c.num_experts)) < 0.5)
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend(), kv_dtype=kv_dtype)
    got, kv = _long_score(model, tokens, 48)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * np.abs(want).max())
    if resident_tokens is not None:
        window = -(-resident_tokens // 64)
        assert len(kv.blocks) == window and kv.host_blocks == -(-300 // 64) - window
        assert (kv.table[:kv.host_blocks] == -1).all()
        assert backend.kv_pool.num_blocks == backend.vram_blocks_per_sequence() < -(-512 // 64)
        k, _ = kv.export(300)
        assert k.shape == (c.num_layers, 300, c.num_kv_heads, c.head_dim) and np.isfinite(k).all()


def test_device_kv_resident_restores_a_long_conversation_window_by_window(gguf_models, numpy_runtime,
                                                                         reference_kernels):
    """Loading a parked conversation longer than the VRAM window goes through the window: the pool never
    runs out, and the restored sequence continues as the original would."""
    from hybrid.conversation_cache import ConversationCache, model_fingerprint

    weights = load_model(gguf_models("small", "Q8_0")[0])
    tokens = list(np.resize(TOKENS, 260))
    backend = GpuBackend(numpy_runtime, max_context=512, chunk_tokens=64, kv_resident=64,
                         resident=np.ones((3, 8), dtype=bool))
    backend.kernels = reference_kernels
    model = Model(weights, backend, host=CpuBackend())
    full, kv = _long_score(model, tokens, 64)
    cache = ConversationCache(1 << 26, model_fingerprint(weights), block_tokens=64)
    cache.park(tokens, kv)
    del kv
    restored = model.new_sequence(512)
    n = cache.restore(tokens + [1], restored)
    assert n == 256 and restored.host_blocks == 3
    rest = model.forward(Batch([SeqChunk(restored, n, np.asarray(tokens[n:]), "all")]))
    np.testing.assert_allclose(rest, full[n:], rtol=0, atol=1e-4 * np.abs(full).max())
