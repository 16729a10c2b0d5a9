"""glm4moe on the GPU backend: its Python side through the NumPy stand-in runtime and reference kernels (every
op of the new parts: sigmoid router, shared expert, dense layer, q/k/v biases, partial RoPE) against the CPU
engine at 0, 50 and 100 % of the experts resident; and on a real GPU (marked gpu) against transformers."""
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.hybrid.glm4moe_models import glm_logits

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


@pytest.fixture
def glm_q8(glm_files):
    """(GGUF path, reference HF dir) of a tiny Q8_0 glm4moe."""
    return glm_files("Q8_0")


def score(model):
    kv = model.new_sequence(256)
    prefill = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-1]), "all")]))
    decode = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[-1:]))]))
    return np.concatenate([prefill, decode])


def masks(num_layers, num_experts):
    rng = np.random.default_rng(0)
    return {"0%": np.zeros((num_layers, num_experts), bool),
            "50%": rng.random((num_layers, num_experts)) < 0.5, "100%": np.ones((num_layers, num_experts), bool)}


def test_gpu_backend_wiring_matches_cpu(glm_q8):
    """The stand-in multiplies in float, and so does the CPU engine here (act_quant="float"), op by op: its compiled
    and fused layers give the same logits (tests/hybrid/test_compiled_families.py), and their glm4moe Q8_0
    instances would be compiled for this test alone (~75 s cold in CI)."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(glm_q8[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend(act_quant="float"), compiled_decode=False))
    for name, mask in masks(c.num_layers, c.num_experts).items():
        backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2, resident=mask)
        backend.kernels = ReferenceKernels()
        model = Model(weights, backend, host=CpuBackend(act_quant="float"))
        assert not model.backend.resident[0].any()  # the dense layer has no experts to hold
        np.testing.assert_allclose(score(model), ref, rtol=0, atol=2e-4 * np.abs(ref).max(), err_msg=name)
        model.close()


@pytest.mark.gpu
def test_gpu_matches_transformers(glm_q8):
    """On a GPU: logits within 2e-3 of transformers on the dequantized weights, greedy tokens as the CPU engine's,
    at 0, 50 and 100 % resident."""
    from gpu_kernels.runtime import probe
    from hybrid import LLM

    if probe().runtime is None:
        pytest.skip("no GPU")
    path, ref_dir = glm_q8
    ref = glm_logits(ref_dir, TOKENS)
    cpu_tokens = LLM(path, device="cpu", max_context=256).generate(TOKENS, max_tokens=8, temperature=0,
                                                                    ignore_eos=True).token_ids
    c = load_model(path).config
    for name, mask in masks(c.num_layers, c.num_experts).items():
        gpu = LLM(path, device="gpu", max_context=256, resident=mask)
        err = np.abs(gpu.score(TOKENS) - ref).max() / np.abs(ref).max()
        assert err <= 2e-3, f"{name}: rel err {err:.2e}"
        assert gpu.generate(TOKENS, max_tokens=8, temperature=0, ignore_eos=True).token_ids == cpu_tokens, name


@pytest.fixture(scope="module")
def gpu_kernels():
    """(runtime, Kernels) on a GPU, else skipped."""
    from gpu_kernels.kernels import Kernels
    from gpu_kernels.runtime import probe

    found = probe()
    if found.runtime is None:
        pytest.skip(f"no GPU: {found.reason}")
    return found.runtime, Kernels(found.runtime)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,k,num_groups,topk_groups,normalize,scale", [
    (1, 128, 8, 1, 1, True, 2.5), (1, 16, 4, 4, 2, True, 2.5), (37, 24, 3, 8, 3, False, 1.5),
    (37, 160, 8, 8, 4, True, 2.5)])
def test_route_sigmoid_kernel(gpu_kernels, num_tokens, num_experts, k, num_groups, topk_groups, normalize, scale):
    from tests.cpu_kernels.test_routing_sigmoid import reference

    rt, kn = gpu_kernels
    rng = np.random.default_rng(num_tokens + num_experts)
    logits = (2.0 * rng.standard_normal((num_tokens, num_experts))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
    ids, weights = rt.empty((num_tokens, k), np.int32), rt.empty((num_tokens, k), np.float32)
    kn.route_sigmoid(rt.to_device(logits), rt.to_device(bias), k, num_groups, topk_groups, normalize, scale, ids,
                     weights)
    want_ids, want_weights = reference(logits, bias, k, num_groups, topk_groups, normalize, scale)
    np.testing.assert_array_equal(rt.to_host(ids), want_ids)
    np.testing.assert_allclose(rt.to_host(weights), want_weights, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,width", [(1, 96), (29, 1040)])
def test_add_bias_kernel(gpu_kernels, num_tokens, width):
    rt, kn = gpu_kernels
    rng = np.random.default_rng(width)
    x = rng.standard_normal((num_tokens, width)).astype(np.float32)
    bias = rng.standard_normal(width).astype(np.float32)
    dev = rt.to_device(x)
    kn.add_bias(dev, rt.to_device(bias))
    np.testing.assert_array_equal(rt.to_host(dev), x + bias)
