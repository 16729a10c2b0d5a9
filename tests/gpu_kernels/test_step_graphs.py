"""Whole decode steps as one graph (hybrid/step_graph.py, hybrid/backends/gpu_step.py) on GpuBackend's Python side
over the NumPy stand-in runtime and reference kernels: captured per keys bound, shared by every sequence, bit for
bit the layer-by-layer graphs."""
import gc

import numpy as np

from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.gpu_kernels.test_backend_wiring import TOKENS, CpuBackend


def test_a_fully_resident_step_is_one_graph_across_its_keys_bound(gguf_models, numpy_runtime, reference_kernels):
    """Every expert resident: each decode step is one graph, captured at its second step and captured again once the
    position passes the keys bound its attention was planned for (256); the logits are the layer-by-layer graphs'
    bit for bit, and the routing reaches the ExpertUsage as theirs does."""
    from hybrid.expert_usage import ExpertUsage

    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    prompt = np.random.default_rng(1).integers(1, c.vocab_size, 250)

    def decode(step_graphs, steps=10):
        backend = GpuBackend(numpy_runtime, max_context=512, resident=np.ones((c.num_layers, c.num_experts), bool),
                             step_graphs=step_graphs)
        backend.kernels = reference_kernels
        model = Model(weights, backend, host=CpuBackend())
        model.usage = ExpertUsage.for_config(c)
        kv = model.new_sequence(512)
        out = [model.forward(Batch([SeqChunk(kv, 0, prompt, "last")]))]
        captures = numpy_runtime.captures
        for t in range(steps):
            out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[t]]))])))
        return np.concatenate(out), model, numpy_runtime.captures - captures

    ref, by_layer, _ = decode(False)
    got, whole, captures = decode(True)
    np.testing.assert_array_equal(got, ref)
    assert whole.runner.last_path == "step graph" and by_layer.runner.last_path == "graphs"
    graphs = [graph for key, (_, _, graph) in whole.backend.layer_graphs._regions.items() if key[0] == "step"]
    assert captures == 2 and [g.launches for g in graphs] == [5, 3]  # positions 251-255, then 257-259
    for name in ("prefill", "decode", "coactivation"):
        np.testing.assert_array_equal(getattr(whole.usage, name), getattr(by_layer.usage, name), err_msg=name)
    assert whole.usage.tokens_decode == 10


def test_one_step_graph_serves_every_sequence(gguf_models, numpy_runtime, reference_kernels):
    """Sequences decoding in turn, and a new one after another was dropped, share one step graph (captured once: a
    new request does not capture again), each step reading its own sequence's block table; the logits are the
    layer-by-layer graphs' bit for bit, and a dropped sequence's blocks go back to the pool (no graph holds it)."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, c.vocab_size, n) for n in (70, 9, 40)]

    def decode(step_graphs, steps=3):
        backend = GpuBackend(numpy_runtime, max_context=512, resident=np.ones((c.num_layers, c.num_experts), bool),
                             step_graphs=step_graphs)
        backend.kernels = reference_kernels
        model = Model(weights, backend, host=CpuBackend())
        free = model.kv_pool.blocks_free
        kvs = [model.new_sequence(512) for _ in prompts[:2]]
        out = [model.forward(Batch([SeqChunk(kvs[u], 0, prompts[u], "last")])) for u in range(2)]
        captures = numpy_runtime.captures
        for t in range(steps):
            for u in range(2):
                out.append(model.forward(Batch([SeqChunk(kvs[u], kvs[u].length, np.asarray([TOKENS[t]]))])))
        del kvs[0]
        gc.collect()
        kvs.append(model.new_sequence(512))
        out.append(model.forward(Batch([SeqChunk(kvs[-1], 0, prompts[2], "last")])))
        for t in range(steps):
            out.append(model.forward(Batch([SeqChunk(kvs[-1], kvs[-1].length, np.asarray([TOKENS[t]]))])))
        del kvs
        gc.collect()
        assert model.kv_pool.blocks_free == free
        return np.concatenate(out), model, numpy_runtime.captures - captures

    ref, _, _ = decode(False)
    got, whole, captures = decode(True)
    np.testing.assert_array_equal(got, ref)
    steps = [key for key in whole.backend.layer_graphs._regions if key[0] == "step"]
    assert whole.runner.last_path == "step graph" and captures == 1 and len(steps) == 1
