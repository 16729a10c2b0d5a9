"""gpt-oss: tiny random models against transformers' GptOssForCausalLM (float32): attention sinks, sliding-window
layers crossed by the prompt, YaRN RoPE, q/k/v/o biases, the biased top-k-then-softmax router and the clamped
SwiGLU experts with biases, in F32 and with MXFP4 experts; its GGUF names and keys."""
import copy

import numpy as np
import pytest

import hybrid
from hybrid.arch.gpt_oss import SLIDING, config_from_gguf, layer_type
from hybrid.errors import ModelError
from tests.hybrid.gpt_oss_models import (hf_greedy, hf_logits, load_dequantized, make_gpt_oss_hf_model,
                                         write_gpt_oss_gguf)

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11, 3, 77, 500, 21, 9, 300, 42, 1, 2,
              60, 61, 62, 400, 33, 34, 35, 36, 37]  # 29 tokens: prefill size, past the window of 8


def rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def hf_model(demo_tokenizer):
    return make_gpt_oss_hf_model(demo_tokenizer.vocab_size)


@pytest.fixture(scope="module")
def gpt_oss_files(tmp_path_factory, hf_model, demo_tokenizer):
    """target -> (GGUF path, the HF model on its dequantized weights); built on first use."""
    cache = {}

    def get(target):
        if target not in cache:
            path = str(tmp_path_factory.mktemp(f"gpt-oss-{target}") / f"gpt-oss-{target}.gguf")
            tensors = write_gpt_oss_gguf(hf_model, demo_tokenizer, path, target)
            cache[target] = (path, load_dequantized(copy.deepcopy(hf_model), tensors))
        return cache[target]

    return get


@pytest.mark.parametrize("target,tol", [("F32", 1e-4), ("MXFP4_MOE", 2e-3)])
def test_gguf_logits_match_transformers(gpt_oss_files, target, tol):
    path, reference = gpt_oss_files(target)
    llm = hybrid.LLM(path, device="cpu")
    assert rel_err(llm.score(PROMPT_IDS), hf_logits(reference, PROMPT_IDS)) <= tol


@pytest.mark.slow
@pytest.mark.parametrize("target", ["F32", "MXFP4_MOE"])
def test_greedy_generation_matches_transformers(gpt_oss_files, target):
    """Prefill then decode steps one token at a time, each past the window."""
    path, reference = gpt_oss_files(target)
    llm = hybrid.LLM(path, device="cpu")
    out = llm.generate(PROMPT_IDS[:9], max_tokens=32, temperature=0.0, ignore_eos=True)
    assert out.token_ids == hf_greedy(reference, PROMPT_IDS[:9], 32)


@pytest.mark.slow
def test_long_scores_cross_the_window(gpt_oss_files):
    path, reference = gpt_oss_files("F32")
    ids = [int(i) for i in np.random.default_rng(5).integers(3, 500, 300)]
    assert rel_err(hybrid.LLM(path, device="cpu").score(ids), hf_logits(reference, ids)) <= 1e-4


def test_gguf_names_and_keys(gpt_oss_files):
    """llama.cpp's names (gguf-py's MODEL_TENSORS[GPT_OSS] plus the biases its converter writes) and keys."""
    from gguf import GGUFReader
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    from hybrid.formats.gguf_metadata import gguf_fields_to_dict

    path, _ = gpt_oss_files("F32")
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    allowed = {TENSOR_NAMES[t].format(bid=b) + s for t in MODEL_TENSORS[MODEL_ARCH.GPT_OSS] for b in range(4)
               for s in (".weight", ".bias")}
    assert names <= allowed
    assert "blk.0.attn_sinks.weight" in names and "blk.3.ffn_down_exps.bias" in names
    fields = gguf_fields_to_dict(reader)
    assert fields["general.architecture"] == "gpt-oss"
    config = config_from_gguf(fields, path, 512, False)
    assert (config.sliding_window, config.rope_scaling.factor, config.rope_scaling.original_max_position_embeddings) \
        == (8, 16.0, 64)
    assert [layer_type(config, i) == SLIDING for i in range(4)] == [True, False, True, False]


def test_missing_sinks_named(tmp_path, hf_model, demo_tokenizer):
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.gguf_file import load_gguf
    from hybrid.arch.gpt_oss import config_from_hf

    path = str(tmp_path / "no-sinks.gguf")
    tensors = write_gpt_oss_gguf(hf_model, demo_tokenizer, path, "F32")
    del tensors["blk.2.attn_sinks.weight"]
    write_gguf(path, config_from_hf(hf_model.config.to_dict(), "x"), tensors.values(), demo_tokenizer)
    with pytest.raises(ModelError, match="missing tensor 'blk.2.attn_sinks.weight'"):
        load_gguf(path)


@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("bf16", 2e-3)])
def test_llama_cpp_converter_file_matches_transformers(hf_model, demo_tokenizer, tmp_path, outtype, tol):
    """A file made by llama.cpp's own convert_hf_to_gguf.py (STRATA_LLAMA_CPP_DIR: a llama.cpp source tree, e.g.
    the llama-cpp-python sdist's vendor/llama.cpp) from the HF directory: its names, keys and layouts (the gate/up
    split, the sinks) are what we read; the reference runs on the file's weights as gguf-py dequantizes them."""
    import os
    import subprocess
    import sys

    from tests.conftest import save_tokenizer_files

    llama_cpp = os.environ.get("STRATA_LLAMA_CPP_DIR")
    if not llama_cpp or not os.path.isfile(os.path.join(llama_cpp, "convert_hf_to_gguf.py")):
        pytest.skip("set STRATA_LLAMA_CPP_DIR to a llama.cpp source tree to run its converter")
    hf_dir, out = str(tmp_path / "hf"), str(tmp_path / f"gpt-oss-{outtype}.gguf")
    hf_model.save_pretrained(hf_dir)
    save_tokenizer_files(demo_tokenizer, hf_dir)
    script = os.path.join(os.path.dirname(__file__), "llama_convert.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, script, llama_cpp, hf_dir, out, outtype], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": root})
    llm = hybrid.LLM(out, device="cpu")
    assert llm.weights["blk.1.ffn_gate_exps.weight"].qtype.name == outtype.upper()
    reference = load_dequantized(copy.deepcopy(hf_model), llm.weights.tensors)
    assert rel_err(llm.score(PROMPT_IDS), hf_logits(reference, PROMPT_IDS)) <= tol
