"""End to end: hybrid.LLM on tiny random qwen3moe files against transformers (float32)."""
from dataclasses import replace

import numpy as np
import pytest

import hybrid

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11, 3, 77, 500, 21, 9, 300, 42, 1, 2,
              60, 61, 62, 400, 33, 34, 35, 36, 37, 38, 39, 40, 41, 900, 12]  # 35 tokens: prefill size

CASES = [  # (model size, file type, tolerance on max|diff| / max|ref|)
    ("small", "F32", 1e-4),
    ("small", "F16", 2e-3),
    ("small", "BF16", 2e-3),
    ("small", "Q8_0", 2e-3),
    ("small", "Q4_0", 2e-3),
    ("kquant", "Q4_K", 2e-3),
    ("kquant", "Q5_K", 2e-3),
    ("kquant", "Q6_K", 2e-3),
    ("kquant", "Q4_K_M", 2e-3),
]


def rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("size,target,tol", CASES, ids=[f"{s}-{t}" for s, t, _ in CASES])
def test_gguf_logits_match_transformers(gguf_models, reference_logits, size, target, tol):
    path, ref_dir = gguf_models(size, target)
    llm = hybrid.LLM(path, device="cpu")
    ours = llm.score(PROMPT_IDS)
    ref = reference_logits(ref_dir, PROMPT_IDS)
    assert ours.shape == ref.shape == (len(PROMPT_IDS), llm.config.vocab_size)
    assert rel_err(ours, ref) <= tol


@pytest.mark.parametrize("size,target", [("small", "F32"), ("small", "Q8_0"), ("kquant", "Q4_K_M")])
def test_greedy_generation_matches_transformers(gguf_models, reference_greedy, size, target):
    path, ref_dir = gguf_models(size, target)
    llm = hybrid.LLM(path, device="cpu")
    out = llm.generate(PROMPT_IDS[:9], max_tokens=32, temperature=0.0, ignore_eos=True)
    assert out.finish_reason == "length"
    assert out.token_ids == reference_greedy(ref_dir, PROMPT_IDS[:9], 32)


def test_decode_steps_match_full_prefill(gguf_models):
    """Logits from the KV-cached decode path equal those of scoring the whole sequence at once."""
    path, _ = gguf_models("small", "Q8_0")
    llm = hybrid.LLM(path, device="cpu")
    out = llm.generate(PROMPT_IDS[:5], max_tokens=6, temperature=0.0, ignore_eos=True)
    full = llm.score(PROMPT_IDS[:5] + out.token_ids)
    assert out.token_ids == [int(t) for t in np.argmax(full[4:-1], axis=-1)]


def test_safetensors_dir_matches_transformers(hf_dirs, reference_logits):
    llm = hybrid.LLM(hf_dirs["small"], device="cpu")
    assert rel_err(llm.score(PROMPT_IDS), reference_logits(hf_dirs["small"], PROMPT_IDS)) <= 1e-4


def test_bf16_safetensors_dir_matches_transformers(tmp_path, hf_dirs, reference_logits):
    import shutil

    import torch
    from transformers import Qwen3MoeForCausalLM

    bf16_dir = str(tmp_path / "bf16")
    Qwen3MoeForCausalLM.from_pretrained(hf_dirs["small"], dtype=torch.bfloat16).save_pretrained(bf16_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{hf_dirs['small']}/{name}", bf16_dir)
    llm = hybrid.LLM(bf16_dir, device="cpu")
    assert llm.weights["blk.0.attn_q.weight"].qtype.name == "BF16"
    assert rel_err(llm.score(PROMPT_IDS), reference_logits(bf16_dir, PROMPT_IDS)) <= 1e-4


def test_gguf_and_safetensors_give_the_same_model(gguf_models, hf_dirs):
    path, _ = gguf_models("small", "F32")
    from_gguf, from_dir = hybrid.LLM(path), hybrid.LLM(hf_dirs["small"])
    # GGUF stores eps as float32
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_dir.config.rms_norm_eps, rel=1e-6)
    assert replace(from_gguf.config, rms_norm_eps=from_dir.config.rms_norm_eps) == from_dir.config
    assert sorted(from_gguf.weights.tensors) == sorted(from_dir.weights.tensors)
    np.testing.assert_array_equal(from_gguf.score(PROMPT_IDS[:8]), from_dir.score(PROMPT_IDS[:8]))
