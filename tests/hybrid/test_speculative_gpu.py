"""Speculative decoding on the GPU backend's Python side (NumPy stand-in runtime and reference kernels), with
half of the experts resident: the drafts of several slots are one chunk for the hybrid CPU / GPU split, and
greedy output equals the same model's plain greedy output."""
import numpy as np
import pytest

from gpu_kernels.numpy_runtime import NumpyRuntime
from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.formats import load_model
from hybrid.model import Model
from tests.gpu_kernels.conftest import ReferenceKernels
from tests.hybrid.test_speculative import ALWAYS, serve_ids

PROMPTS = [[3, 17, 42, 5, 3, 17, 42, 5, 3, 17], [99, 23, 64, 99, 23, 64, 99], [7, 11, 250, 31, 8, 7, 11], [2, 45, 2]]


@pytest.fixture(scope="module", params=[0.5, 1.0], ids=["half-resident", "resident"])
def stand_in(gguf_models, request):
    """The model on the stand-in GPU with that share of its experts resident (all: a layer's step of a few
    tokens runs as a decode step on the device)."""
    weights = load_model(gguf_models("small", "Q8_0")[0])
    c = weights.config
    resident = np.random.default_rng(0).random((c.num_layers, c.num_experts)) < request.param
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=4, resident=resident)
    backend.kernels = ReferenceKernels()
    return weights, Model(weights, backend, host=CpuBackend(act_quant="float"))


@pytest.mark.parametrize("num_slots", [1, 4])
def test_greedy_with_drafts_on_the_stand_in_gpu_equals_plain_greedy(stand_in, num_slots):
    weights, model = stand_in
    plain, _ = serve_ids(model, weights.tokenizer, PROMPTS, num_slots, None)
    drafted, stats = serve_ids(model, weights.tokenizer, PROMPTS, num_slots, ALWAYS)
    assert drafted == plain
    assert 0 < stats.draft_n_accepted < stats.draft_n


@pytest.mark.gpu
def test_greedy_with_drafts_on_the_gpu_equals_plain_greedy(gguf_models):
    """Real kernels, half of the experts resident, 4 slots. Float x: a verification chunk multiplies as a prompt
    chunk does, a plain decode step (int16 x by default) would differ from it by rounding alone."""
    from gpu_kernels.runtime import probe
    from hybrid import LLM

    if probe().runtime is None:
        pytest.skip("no GPU")
    path, _ = gguf_models("small", "Q8_0")
    llm = LLM(path, device="gpu", max_context=256, act_quant="float", kv_sequences=4)
    c = llm.model.config
    llm_half = LLM(path, device="gpu", max_context=256, act_quant="float", kv_sequences=4,
                   resident=np.random.default_rng(0).random((c.num_layers, c.num_experts)) < 0.5)
    for model in (llm.model, llm_half.model):
        plain, _ = serve_ids(model, llm.tokenizer, PROMPTS, 4, None)
        drafted, stats = serve_ids(model, llm.tokenizer, PROMPTS, 4, ALWAYS)
        assert drafted == plain and stats.draft_n_accepted > 0
