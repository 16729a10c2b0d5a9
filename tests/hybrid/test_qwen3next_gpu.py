"""Qwen3-Next on the GPU backend: its Python side through the NumPy stand-in runtime and reference kernels (the delta
rule's token-by-token and chunked forms against the NumPy recurrence; linear attention with its recurrent state in
device arrays, gated attention, the gated shared expert against the CPU engine at 0, 50 and 100 % of the experts
resident, prompt and decode); and on a real GPU (marked gpu) against transformers."""
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.hybrid.qwen3next_models import make_hf_model, reference_model, save_hf_dir, write_qwen3next_gguf

TOKENS = [int(t) for t in np.random.default_rng(6).integers(3, 250, 75)]  # a prompt over a 64-token chunk


@pytest.fixture(scope="module")
def qwen3next_q8(tmp_path_factory, demo_tokenizer):
    from tests.conftest import save_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen3next-gpu")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(directory / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    path = str(directory / "qwen3next-Q8_0.gguf")
    canonical, config = write_qwen3next_gguf(hf_dir, path, "Q8_0", demo_tokenizer)
    return path, (hf_dir, canonical, config)


@pytest.mark.parametrize("num_tokens", [1, 63, 64, 150])
@pytest.mark.parametrize("tiled", [False, True])
def test_gpu_delta_rule_matches_the_recurrence(num_tokens, tiled, monkeypatch):
    """GpuBackend.delta_rule through the stand-in runtime: short chunks token by token, from CHUNKED_MIN_TOKENS on
    (set here to one chunk; off by default) the chunked form's four stages (each a NumPy stand-in of its kernel); out
    and the state as the recurrence's."""
    from gpu_kernels.delta_launch import DN_CHUNK
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from hybrid.arch.recipe import LinearAttention
    from hybrid.backends import gpu_delta
    from tests import delta_net_reference as ref

    monkeypatch.setattr(gpu_delta, "CHUNKED_MIN_TOKENS", DN_CHUNK)
    from tests.gpu_kernels.conftest import ReferenceKernels

    part = LinearAttention(num_k_heads=2, num_v_heads=4, key_dim=16, value_dim=24, conv_width=4, tiled=tiled)
    rng = np.random.default_rng(num_tokens)
    mixed = rng.standard_normal((num_tokens, part.conv_channels)).astype(np.float32)
    g = (-0.3 * np.abs(rng.standard_normal((num_tokens, 4)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((num_tokens, 4))))).astype(np.float32)
    state = (0.3 * rng.standard_normal((4, 16, 24))).astype(np.float32)
    backend = GpuBackend(NumpyRuntime(), max_context=256)
    calls = []
    backend.kernels = type("Counted", (ReferenceKernels,), {
        "delta_rule": lambda self, *a: calls.append("delta_rule") or ReferenceKernels.delta_rule(self, *a),
        "delta_chunk_state": lambda self, *a: calls.append("chunked") or ReferenceKernels.delta_chunk_state(self, *a)})()
    out, dev_state = np.zeros((num_tokens, 4, 24), np.float32), state.copy()
    backend.delta_rule(mixed, g, beta, dev_state, out, part)
    assert calls == ["delta_rule" if num_tokens < DN_CHUNK else "chunked"]
    q, k, v = np.split(mixed, [32, 64], axis=1)
    expected, expected_state = ref.delta_rule_recurrent(q.reshape(-1, 2, 16), k.reshape(-1, 2, 16),
                                                        v.reshape(-1, 4, 24), g, beta, state, tiled)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dev_state, expected_state, rtol=1e-5, atol=1e-5)


def score(model):
    """Prompt logits in two chunks (the second a decode-sized one), then two decode steps."""
    kv = model.new_sequence(256)
    rows = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:70]), "all")])),
            model.forward(Batch([SeqChunk(kv, 70, np.asarray(TOKENS[70:73]), "all")]))]
    for t in TOKENS[73:]:
        rows.append(model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])))
    return np.concatenate(rows)


@pytest.mark.slow
def test_gpu_backend_wiring_matches_cpu(qwen3next_q8):
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from tests.gpu_kernels.conftest import ReferenceKernels

    weights = load_model(qwen3next_q8[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend(act_quant="float")))
    for name, mask in masks(c.num_layers, c.num_experts).items():
        backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2, resident=mask)
        backend.kernels = ReferenceKernels()
        model = Model(weights, backend, host=CpuBackend(act_quant="float"))
        np.testing.assert_allclose(score(model), ref, rtol=0, atol=2e-4 * np.abs(ref).max(), err_msg=name)
        model.close()


@pytest.mark.slow
def test_gpu_backend_wiring_qwen35moe_matches_cpu(tmp_path, demo_tokenizer):
    """Qwen3.5-MoE on the stand-in GPU: tiled value heads, separate beta / alpha projections."""
    from gpu_kernels.numpy_runtime import NumpyRuntime
    from tests.conftest import save_tokenizer_files
    from tests.gpu_kernels.conftest import ReferenceKernels

    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, qwen35=True), str(tmp_path / "hf"),
                         save_tokenizer_files, demo_tokenizer)
    path = str(tmp_path / "qwen35moe-Q8_0.gguf")
    write_qwen3next_gguf(hf_dir, path, "Q8_0", demo_tokenizer)
    weights = load_model(path)
    ref = score(Model(weights, CpuBackend(act_quant="float")))
    backend = GpuBackend(NumpyRuntime(), max_context=256, kv_sequences=2,
                         resident=masks(weights.config.num_layers, weights.config.num_experts)["50%"])
    backend.kernels = ReferenceKernels()
    model = Model(weights, backend, host=CpuBackend(act_quant="float"))
    assert model.recipes[0].mixer.part.tiled
    np.testing.assert_allclose(score(model), ref, rtol=0, atol=2e-4 * np.abs(ref).max())
    model.close()


def masks(num_layers, num_experts):
    rng = np.random.default_rng(0)
    return {"0%": np.zeros((num_layers, num_experts), bool),
            "50%": rng.random((num_layers, num_experts)) < 0.5, "100%": np.ones((num_layers, num_experts), bool)}


@pytest.mark.gpu
def test_gpu_matches_transformers(qwen3next_q8):
    """On a GPU: logits within 2e-3 of transformers on the file's weights (a prompt past a 64-token chunk), greedy
    tokens as the CPU engine's, at 0, 50 and 100 % resident."""
    import torch

    from gpu_kernels.runtime import probe
    from hybrid import LLM

    if probe().runtime is None:
        pytest.skip("no GPU")
    path, reference = qwen3next_q8
    with torch.no_grad():
        ref = reference_model(*reference)(torch.tensor([TOKENS])).logits[0].numpy()
    cpu_tokens = LLM(path, device="cpu", max_context=256).generate(TOKENS, max_tokens=8, temperature=0,
                                                                    ignore_eos=True).token_ids
    c = load_model(path).config
    for name, mask in masks(c.num_layers, c.num_experts).items():
        gpu = LLM(path, device="gpu", max_context=256, resident=mask)
        err = np.abs(gpu.score(TOKENS) - ref).max() / np.abs(ref).max()
        assert err <= 2e-3, f"{name}: rel err {err:.2e}"
        assert gpu.generate(TOKENS, max_tokens=8, temperature=0, ignore_eos=True).token_ids == cpu_tokens, name


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 7, 64, 512])
def test_gpu_long_prompt_in_chunks_matches_transformers(qwen3next_q8, chunk):
    """On a GPU: a 600-token prompt read `chunk` tokens a step (the delta rule token by token below 64 tokens, in its
    chunked form from 64 on) within 2e-3 of transformers at 0, 50 and 100 % resident."""
    import torch

    from gpu_kernels.runtime import probe
    from hybrid import LLM
    from tests.hybrid.test_qwen3next import PROMPT_600, score_in_chunks

    if probe().runtime is None:
        pytest.skip("no GPU")
    path, reference = qwen3next_q8
    with torch.no_grad():
        ref = reference_model(*reference)(torch.tensor([PROMPT_600])).logits[0].numpy()
    c = load_model(path).config
    for name, mask in masks(c.num_layers, c.num_experts).items():
        gpu = LLM(path, device="gpu", max_context=1024, resident=mask)
        err = np.abs(score_in_chunks(gpu, PROMPT_600, chunk) - ref).max() / np.abs(ref).max()
        assert err <= 2e-3, f"{name}: rel err {err:.2e}"
