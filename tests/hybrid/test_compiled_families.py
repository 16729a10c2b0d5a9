"""The compiled CPU decode layers (hybrid/backends/cpu_layer.py, cpu_decode*.py) on the newer families' parts against
the op-by-op path: glm4moe (dense leading layers, shared expert, sigmoid router, qkv bias, partial RoPE), gpt-oss
(sinks, sliding window, YaRN, biases, clamped SwiGLU, top-k-then-softmax router), qwen3next (gated attention, gated
shared expert; its Gated DeltaNet blocks run op by op inside the compiled runner). Decode steps of two sequences, and one
sequence's several tokens as one-token chunks (a verification step of a sequence without recurrent state, crossing
gpt-oss's window); one thread and all
threads (the fused layers where the recipe has them: glm4moe's and gpt-oss's, bit for bit the compiled layers'
results)."""
import copy

import numpy as np
import pytest

import hybrid
from hybrid.batch import Batch, SeqChunk
from hybrid.backends.cpu_layer import CompiledRunner
from hybrid.runners import PlainRunner
from tests.hybrid.test_compiled_decode import PROMPTS, decode

TOLERANCE = 2e-6  # relative: the same kernels in the same order, bar a few ops' float32 exp / bias-add rounding


def _glm(tmp_path_factory, demo_tokenizer, glm_hf_dir):
    from tests.hybrid.glm4moe_models import write_glm_gguf

    return write_glm_gguf(glm_hf_dir, str(tmp_path_factory.mktemp("cglm") / "glm.gguf"), "F32")


def _gpt_oss(tmp_path_factory, demo_tokenizer, glm_hf_dir):
    from tests.hybrid.gpt_oss_models import make_gpt_oss_hf_model, write_gpt_oss_gguf

    path = str(tmp_path_factory.mktemp("cgptoss") / "gpt-oss.gguf")
    write_gpt_oss_gguf(make_gpt_oss_hf_model(demo_tokenizer.vocab_size), demo_tokenizer, path, "F32")
    return path


def _qwen3next(tmp_path_factory, demo_tokenizer, glm_hf_dir):
    from tests.conftest import save_tokenizer_files
    from tests.hybrid.qwen3next_models import make_hf_model, save_hf_dir, write_qwen3next_gguf

    directory = tmp_path_factory.mktemp("cqwen3next")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(directory / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    path = str(directory / "qwen3next.gguf")
    write_qwen3next_gguf(hf_dir, path, "F32", demo_tokenizer)
    return path


MAKERS = {"glm4moe": _glm, "gpt-oss": _gpt_oss, "qwen3next": _qwen3next}


@pytest.fixture(scope="module")
def family_model(tmp_path_factory, demo_tokenizer, glm_hf_dir):
    """family -> its tiny F32 GGUF's Model on the CPU (made on first use)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = hybrid.LLM(MAKERS[family](tmp_path_factory, demo_tokenizer, glm_hf_dir),
                                       device="cpu").model
        return cache[family]

    return get


def verify_step(model, compiled, prompt, tokens):
    """Logits [n, V] of `tokens` fed after the prompt as one-token chunks of one sequence in one batch."""
    model.compiled_decode = compiled
    kv = model.new_sequence(64)
    model.forward(Batch([SeqChunk(kv, 0, np.array(prompt, np.int64))]))
    chunks = [SeqChunk(kv, len(prompt) + i, np.array([t], np.int64)) for i, t in enumerate(tokens)]
    return model.forward(Batch(chunks))


def close(ours, ref):
    assert float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref))) <= TOLERANCE


# Each family compiles its own layer instances: on top of what the families' default tests compile, ~29 s cold for
# qwen3next's and ~47 s for gpt-oss's on the loaded 2-core machine, past the default suite's budget: all run with
# `slow` (the compiled layers also run in the slow greedy tests against transformers).
@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4moe", "gpt-oss", "qwen3next"])
def test_compiled_decode_matches_op_by_op(family_model, family):
    """Every layer runs compiled (from 2 threads glm4moe's and gpt-oss's layers fused), close to op by op."""
    import numba

    model = family_model(family)
    fused = family != "qwen3next" and numba.get_num_threads() > 1
    for prompts in (PROMPTS[:1], PROMPTS):
        op_by_op = decode(model, False, prompts, 3)
        assert isinstance(model.runner, PlainRunner)
        compiled = decode(model, True, prompts, 3)
        assert isinstance(model.runner, CompiledRunner)
        assert model.runner.last_path == ("fused" if fused else "compiled")
        close(compiled, op_by_op)
    if family != "qwen3next":  # a recurrent sequence's verification step is one chunk: the op-by-op path
        tokens = [9, 300, 42, 1, 77]  # past gpt-oss's window of 8 after the 6-token prompt
        close(verify_step(model, True, PROMPTS[0], tokens), verify_step(model, False, PROMPTS[0], tokens))


# Forced on, at any thread count: ~45 s cold a family beyond the compiled layers' compile.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4moe", "gpt-oss"])
def test_fused_layer_equals_the_compiled_layer(family_model, family):
    """The fused layers (qkv / o biases, partial and YaRN RoPE, sinks, the sliding window; sigmoid and top-k-then-
    softmax routers, clamped SwiGLU with expert biases, the shared expert, dense leading layers) give the compiled
    layers' logits bit for bit, also where the attention splits its keys (300 positions, past gpt-oss's window)."""
    model = family_model(family)
    long_prompt = list(np.resize(PROMPTS[0] + PROMPTS[1], 300))
    try:
        for prompts in (PROMPTS, [long_prompt, PROMPTS[1]]):
            model.backend.fused_decode = False
            compiled = decode(model, True, prompts, 2, capacity=320)
            assert model.runner.last_path == "compiled"
            model.backend.fused_decode = True
            fused = decode(model, True, prompts, 2, capacity=320)
            assert model.runner.last_path == "fused"
            np.testing.assert_array_equal(fused, compiled)
    finally:
        model.backend.fused_decode = None


def test_which_blocks_compile():
    """glm4moe's dense and MoE layers, gpt-oss's sliding and full ones and qwen3next's gated-attention ones compile
    whole, and glm4moe's and gpt-oss's fuse; qwen3next's Gated DeltaNet mixers run op by op beside their compiled MoE
    blocks."""
    from hybrid.arch import ARCHS
    from hybrid.backends.cpu_layer import LayerKind
    from hybrid.formats.weights import ModelConfig

    base = dict(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=1e4, rms_norm_eps=1e-6, context_length=64)
    glm = ModelConfig(arch="glm4moe", first_dense_layers=1, dense_intermediate_size=64, shared_intermediate_size=32,
                      attention_bias=True, rotary_dim=8, **base)
    oss = ModelConfig(arch="gpt-oss", sliding_window=8, attention_bias=True, **base)
    nxt = ModelConfig(arch="qwen3next", full_attention_interval=4, shared_intermediate_size=32, qk_norm=True,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_conv_kernel=4, **base)
    for config, expected, fused in ((glm, [(True, True)] * 4, True), (oss, [(True, True)] * 4, True),
                                    (nxt, [(False, True)] * 3 + [(True, True)], False)):
        kinds = [LayerKind(ARCHS[config.arch].layer_recipe(config, i)) for i in range(4)]
        assert [kind.compiled for kind in kinds] == expected
        assert [kind.fuses for kind in kinds] == [fused] * 4
