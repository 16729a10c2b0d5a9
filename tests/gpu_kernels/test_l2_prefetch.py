"""The next layer's dense weights prefetched into L2 inside a decode step graph (hybrid/backends/gpu_l2_prefetch.py):
on GpuBackend's Python side over the NumPy stand-in runtime, the side branches prefetch each layer's successor's
weights (the last layer's: the first's), join the step, and leave the logits bit for bit; on a GPU the same."""
import numpy as np
import pytest

from hybrid.backends.gpu import GpuBackend
from hybrid.backends.gpu_l2_prefetch import L2Prefetch, merged_spans
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.gpu_kernels.test_backend_wiring import TOKENS, CpuBackend


def test_merged_spans_joins_touching_and_overlapping_arrays():
    base = np.zeros(64, np.uint8)
    parts = [base[40:48], base[0:8], base[8:16], base[4:12], base[30:32]]
    start = base.ctypes.data
    assert merged_spans(parts) == [(start, 16), (start + 30, 2), (start + 40, 8)]


def decode(weights, runtime, kernels, l2_prefetch, steps=4):
    c = weights.config
    backend = GpuBackend(runtime, max_context=256, resident=np.ones((c.num_layers, c.num_experts), bool),
                         l2_prefetch=l2_prefetch)
    backend.kernels = kernels
    model = Model(weights, backend, host=CpuBackend())
    kv = model.new_sequence(256)
    prompt = np.random.default_rng(3).integers(1, c.vocab_size, 20)
    out = [model.forward(Batch([SeqChunk(kv, 0, prompt, "last")]))]
    for t in range(steps):
        out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[t]]))])))
    assert model.runner.last_path == "step graph"
    return np.concatenate(out), model


def test_step_graph_prefetches_the_next_layer_and_keeps_the_logits(gguf_models, numpy_runtime, reference_kernels):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    ref, _ = decode(weights, numpy_runtime, reference_kernels, l2_prefetch=False)
    assert not getattr(reference_kernels, "prefetched", [])
    numpy_runtime.l2_bytes = 1 << 30
    got, model = decode(weights, numpy_runtime, reference_kernels, l2_prefetch=True)
    np.testing.assert_array_equal(got, ref)
    be, layers = model.backend, model.layers
    assert isinstance(be.l2, L2Prefetch) and not be.l2._pending  # every branch joined
    calls = reference_kernels.prefetched
    assert calls and len(calls) % len(layers) == 0 and all(stream is be.l2.side for _, stream in calls)
    for i, (regions, _) in enumerate(calls[:len(layers)]):  # layer i's branch reads layer i + 1's weights
        successor = layers[(i + 1) % len(layers)]
        expected = merged_spans(be._dev[id(w)][0] for w in successor.dense_weights() if id(w) in be._dev)
        assert [tuple(r) for r in regions.tolist()] == expected
        assert regions[:, 1].sum() >= sum(w.nbytes for w in (successor.attn_q, successor.attn_output))


def test_no_prefetch_where_l2_holds_too_little(gguf_models, numpy_runtime, reference_kernels):
    weights = load_model(gguf_models("small", "Q8_0")[0])
    numpy_runtime.l2_bytes = 1024
    _, model = decode(weights, numpy_runtime, reference_kernels, l2_prefetch=True, steps=2)
    assert model.backend.l2 is None and not getattr(reference_kernels, "prefetched", [])


@pytest.mark.gpu
def test_prefetch_on_a_gpu_keeps_the_logits_bit_for_bit(gguf_models, runtime):
    weights = load_model(gguf_models("small", "Q4_K_M")[0])
    c = weights.config
    outs = []
    for on in (False, True):
        backend = GpuBackend(runtime, max_context=256, resident=np.ones((c.num_layers, c.num_experts), bool))
        model = Model(weights, backend, host=CpuBackend())
        if on:  # the tiny model's layers fit any L2: planned with an L2 of any size
            backend.l2 = L2Prefetch.plan(backend, model.layers, 1 << 40)
        kv = model.new_sequence(256)
        prompt = np.random.default_rng(3).integers(1, c.vocab_size, 20)
        out = [model.forward(Batch([SeqChunk(kv, 0, prompt, "last")]))]
        for t in range(4):
            out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([TOKENS[t]]))])))
        assert model.runner.last_path == "step graph"
        outs.append(np.concatenate(out))
    np.testing.assert_array_equal(outs[1], outs[0])
