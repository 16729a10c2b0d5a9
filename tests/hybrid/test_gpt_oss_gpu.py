"""gpt-oss on the GPU backend: its Python side through the NumPy stand-in runtime and reference kernels (sinks,
sliding window, YaRN RoPE, o bias, the top-k-then-softmax router, the clamped SwiGLU with expert biases) against the
CPU engine at 0, 50 and 100 % of the experts resident; and on a real GPU (marked gpu) against transformers."""
import copy

import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.hybrid.gpt_oss_models import hf_logits, load_dequantized, make_gpt_oss_hf_model, write_gpt_oss_gguf

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]  # past the window of 8


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory, demo_tokenizer):
    """(GGUF path, the HF model on its dequantized weights) of a tiny gpt-oss with MXFP4 experts."""
    model = make_gpt_oss_hf_model(demo_tokenizer.vocab_size)
    path = str(tmp_path_factory.mktemp("gpt-oss-gpu") / "gpt-oss-MXFP4_MOE.gguf")
    tensors = write_gpt_oss_gguf(model, demo_tokenizer, path, "MXFP4_MOE")
    return path, load_dequantized(copy.deepcopy(model), tensors)


def score(model):
    """A prompt's logits, then two decode steps' (the second past the window of every sliding layer)."""
    kv = model.new_sequence(256)
    out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-2]), "all")]))]
    for token in TOKENS[-2:]:
        out.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([token]))])))
    return np.concatenate(out)


def masks(num_layers, num_experts):
    rng = np.random.default_rng(0)
    return {"0%": np.zeros((num_layers, num_experts), bool),
            "50%": rng.random((num_layers, num_experts)) < 0.5, "100%": np.ones((num_layers, num_experts), bool)}


@pytest.fixture(scope="module")
def cpu_scores(gpt_oss_mxfp4):
    """The CPU engine's scores; it multiplies in float as the stand-in does (act_quant="float")."""
    return score(Model(load_model(gpt_oss_mxfp4[0]), CpuBackend(act_quant="float")))


@pytest.mark.parametrize("resident", [pytest.param("0%", marks=pytest.mark.slow), "50%",
                                      pytest.param("100%", marks=pytest.mark.slow)])
def test_gpu_backend_wiring_matches_cpu(gpt_oss_mxfp4, cpu_scores, resident):
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(gpt_oss_mxfp4[0])
    c = weights.config
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2,
                         resident=masks(c.num_layers, c.num_experts)[resident])
    backend.kernels = ReferenceKernels()
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    np.testing.assert_allclose(score(model), cpu_scores, rtol=0, atol=2e-4 * np.abs(cpu_scores).max())
    model.close()


@pytest.mark.parametrize("host_attention", [pytest.param("gpu", marks=pytest.mark.slow), "cpu"])
def test_kv_ram_part_with_window_and_sinks(gpt_oss_mxfp4, cpu_scores, host_attention):
    """Only the newest 16 positions in VRAM (BT = 16: the older blocks in pinned RAM, attended through a stage in
    VRAM, or by the host and merged by log-sum-exp before the sinks join): the same scores."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(gpt_oss_mxfp4[0])
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2, resident=None, kv_resident=16,
                         kv_host_attention=host_attention)
    backend.kernels = ReferenceKernels()
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    np.testing.assert_allclose(score(model), cpu_scores, rtol=0, atol=2e-4 * np.abs(cpu_scores).max())
    model.close()


@pytest.mark.gpu
def test_gpu_matches_transformers(gpt_oss_mxfp4):
    """On a GPU: logits within 2e-3 of transformers on the dequantized weights at 0, 50 and 100 % resident."""
    from gpu_kernels.runtime import probe

    found = probe()
    if found.runtime is None:
        pytest.skip(f"no GPU: {found.reason}")
    path, reference = gpt_oss_mxfp4
    weights = load_model(path)
    c = weights.config
    ref = hf_logits(reference, TOKENS)
    for name, mask in masks(c.num_layers, c.num_experts).items():
        model = Model(weights, GpuBackend(found.runtime, max_context=256, kv_sequences=2, resident=mask),
                      host=CpuBackend())
        ours = score(model)
        model.close()
        assert float(np.abs(ours - ref).max() / np.abs(ref).max()) <= 2e-3, name
