"""Qwen3-Next end to end: tiny random models (transformers, float32) as GGUF files written as llama.cpp's converter
writes them, read by Strata's CPU backend in chunks of several sizes, against transformers on the file's weights."""
import numpy as np
import pytest

import hybrid
from hybrid.batch import Batch, SeqChunk

from tests.hybrid.qwen3next_models import make_hf_model, reference_model, save_hf_dir, write_qwen3next_gguf

PROMPT_40 = [int(t) for t in np.random.default_rng(4).integers(3, 250, 40)]
PROMPT_150 = [int(t) for t in np.random.default_rng(5).integers(3, 250, 150)]  # over two 64-token chunks
PROMPT_600 = [int(t) for t in np.random.default_rng(8).integers(3, 250, 600)]  # over a 512-token chunk
PROMPTS = {40: PROMPT_40, 600: PROMPT_600}


def rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def qwen3next_files(tmp_path_factory, demo_tokenizer):
    """target type -> (GGUF path, reference transformers model on the file's weights), made on first use."""
    from tests.conftest import save_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen3next")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(directory / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    cache = {}

    def get(target):
        if target not in cache:
            path = str(directory / f"tiny-qwen3next-{target}.gguf")
            canonical, config = write_qwen3next_gguf(hf_dir, path, target, demo_tokenizer)
            cache[target] = (path, reference_model(hf_dir, canonical, config))
        return cache[target]

    return get


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def reference_logits(qwen3next_files):
    """(target, prompt length) -> transformers' logits of PROMPTS[length] on that file's weights, made once."""
    cache = {}

    def get(target, length):
        if (target, length) not in cache:
            cache[target, length] = hf_logits(qwen3next_files(target)[1], PROMPTS[length])
        return cache[target, length]

    return get


def score_in_chunks(llm, ids, chunk):
    """Logits at every position, the prompt read `chunk` tokens a forward step."""
    kv = llm.model.new_sequence(llm.max_context)
    rows = []
    for lo in range(0, len(ids), chunk):
        part = np.asarray(ids[lo:lo + chunk], dtype=np.int64)
        rows.append(llm.model.forward(Batch([SeqChunk(kv, kv.length, part, "all")])))
    return np.concatenate(rows)


@pytest.mark.parametrize("target,tol", [("F32", 1e-4), pytest.param("Q8_0", 2e-3, marks=pytest.mark.slow)])
def test_logits_match_transformers(qwen3next_files, reference_logits, target, tol):
    llm = hybrid.LLM(qwen3next_files(target)[0], device="cpu")
    assert llm.config.arch == "qwen3next" and llm.model.recurrent_shape.layers == (0, 1, 2)
    assert rel_err(llm.score(PROMPT_40), reference_logits(target, 40)) <= tol


def chunk_cases():
    """(target, tolerance, prompt length, chunk): F32 within 1e-4, Q8_0 at the default act_quant within 2e-3, for
    40 and 600 tokens read 1, 7, 64 and 512 tokens a step; one short case in the default suite."""
    for target, tol in (("F32", 1e-4), ("Q8_0", 2e-3)):
        for length in (40, 600):
            for chunk in (1, 7, 64, 512):
                slow = (target, length, chunk) != ("F32", 40, 7)
                yield pytest.param(target, tol, length, chunk, marks=[pytest.mark.slow] if slow else [],
                                   id=f"{target}-{length}-by{chunk}")


@pytest.mark.parametrize("target,tol,length,chunk", list(chunk_cases()))
def test_prompt_in_chunks_matches_transformers(qwen3next_files, reference_logits, target, tol, length, chunk):
    llm = hybrid.LLM(qwen3next_files(target)[0], device="cpu")
    assert rel_err(score_in_chunks(llm, PROMPTS[length], chunk), reference_logits(target, length)) <= tol


@pytest.mark.slow
def test_greedy_tokens_match_transformers(qwen3next_files):
    import torch

    path, ref_model = qwen3next_files("F32")
    llm = hybrid.LLM(path, device="cpu")
    out = llm.generate(PROMPT_40[:9], max_tokens=32, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        ref = ref_model.generate(torch.tensor([PROMPT_40[:9]]), do_sample=False, max_new_tokens=32,
                                 min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert out.token_ids == ref[0, 9:].tolist()


@pytest.mark.slow
def test_recurrent_state_goes_back_to_a_chunk_start_only(qwen3next_files):
    """A sequence cut inside its last multi-token chunk keeps the chunk's start (its snapshot); older cuts start it
    over; reading on from the kept position gives the logits of the whole."""
    path, _ = qwen3next_files("F32")
    llm = hybrid.LLM(path, device="cpu")
    whole = llm.score(PROMPT_40)
    kv = llm.model.new_sequence(llm.max_context)
    llm.model.forward(Batch([SeqChunk(kv, 0, np.asarray(PROMPT_40[:20]), "none")]))
    llm.model.forward(Batch([SeqChunk(kv, 20, np.asarray(PROMPT_40[20:30]), "none")]))
    assert kv.rollback(25) == 20 and kv.length == kv.recurrent.length == 20
    rows = llm.model.forward(Batch([SeqChunk(kv, 20, np.asarray(PROMPT_40[20:40]), "all")]))
    assert rel_err(rows, whole[20:40]) <= 1e-5
    kv.truncate(10)  # before the snapshot: nothing kept
    assert kv.length == kv.recurrent.length == 0


@pytest.mark.slow
@pytest.mark.parametrize("qwen35", [False, True], ids=["qwen3next", "qwen35moe"])
def test_hf_directory_matches_transformers(tmp_path, demo_tokenizer, qwen35):
    """An HF directory read directly (the converter's changes made at load, BF16 kept as BF16): within 1e-4 of
    transformers on the same weights, a prompt over two 64-token chunks read 64 tokens a step."""
    import torch

    from tests.conftest import save_tokenizer_files

    model = make_hf_model(demo_tokenizer.vocab_size, qwen35=qwen35).to(torch.bfloat16)
    hf_dir = save_hf_dir(model, str(tmp_path / "hf"), save_tokenizer_files, demo_tokenizer)
    llm = hybrid.LLM(hf_dir, device="cpu")
    assert llm.config.arch == ("qwen35moe" if qwen35 else "qwen3next")
    assert llm.weights["blk.0.attn_qkv.weight"].qtype.name == "BF16"
    ref_model = type(model).from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert rel_err(score_in_chunks(llm, PROMPT_150, 64), hf_logits(ref_model, PROMPT_150)) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("target,tol", [("F32", 1e-4), ("Q8_0", 2e-3)])
def test_qwen35moe_matches_transformers(tmp_path_factory, demo_tokenizer, target, tol):
    """Qwen3.5-MoE: separate beta / alpha projections, value heads tiled in the file; chunks of 1, 64 and 512 (Q8_0
    at the default act_quant)."""
    from tests.conftest import save_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen35moe")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, qwen35=True), str(directory / "hf"),
                         save_tokenizer_files, demo_tokenizer)
    path = str(directory / f"qwen35moe-{target}.gguf")
    ref_model = reference_model(hf_dir, *write_qwen3next_gguf(hf_dir, path, target, demo_tokenizer))
    llm = hybrid.LLM(path, device="cpu")
    assert llm.config.arch == "qwen35moe" and llm.model.recipes[0].mixer.part.tiled
    for ids, chunk in ((PROMPT_40, 1), (PROMPT_150, 64), (PROMPT_600, 512)):
        assert rel_err(score_in_chunks(llm, ids, chunk), hf_logits(ref_model, ids)) <= tol


@pytest.mark.slow
def test_kv_and_budgets_hold_attention_layers_and_the_state(qwen3next_files):
    """The KV pool holds the full-attention layer only; the planner counts its KV and the linear layers' state."""
    from hybrid.formats import load_model
    from placement.budget import ModelSizes, gpu_budget

    path, _ = qwen3next_files("F32")
    llm = hybrid.LLM(path, device="cpu")
    assert llm.model.kv_pool.num_layers == llm.model.num_kv_layers == 1
    assert [layer.kv_index for layer in llm.model.layers] == [None, None, None, 0]
    sizes = ModelSizes.from_weights(load_model(path))
    layers = range(4)
    assert sizes.kv_layers(layers) == 1 and sizes.state_bytes(layers) == llm.model.recurrent_shape.slot_bytes
    budget = gpu_budget(sizes, 0, 1, 1 << 34, layers, 2, 256, "f32", 0)
    assert budget.kv == 2 * (256 * sizes.kv_bytes_per_token("f32") + llm.model.recurrent_shape.slot_bytes)


@pytest.mark.slow
def test_mtp_layer_is_loaded_and_kept(tmp_path, demo_tokenizer):
    """A qwen35moe file with an MTP layer (block_count counts it, nextn_predict_layers = 1): the decoder layers run as
    without it, the MTP layer's weights and nextn tensors are kept for a drafter."""
    from tests.conftest import save_tokenizer_files

    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, qwen35=True), str(tmp_path / "hf"),
                         save_tokenizer_files, demo_tokenizer)
    plain, with_mtp = str(tmp_path / "plain.gguf"), str(tmp_path / "mtp.gguf")
    write_qwen3next_gguf(hf_dir, plain, "F32", demo_tokenizer)
    write_qwen3next_gguf(hf_dir, with_mtp, "F32", demo_tokenizer, mtp=True)
    llm = hybrid.LLM(with_mtp, device="cpu")
    assert llm.config.num_layers == 4 and llm.config.num_nextn_layers == 1
    (layer,), (own,) = llm.model.nextn_layers, llm.model.nextn_tensors
    assert layer.attn_q.shape == (2 * llm.config.num_heads * llm.config.head_dim, llm.config.hidden_size)
    assert layer.shexp_gate is not None and set(own) == {"eh_proj.weight", "enorm.weight", "hnorm.weight",
                                                        "shared_head_norm.weight"}
    np.testing.assert_array_equal(llm.score(PROMPT_40), hybrid.LLM(plain, device="cpu").score(PROMPT_40))


@pytest.mark.slow
@pytest.mark.parametrize("qwen35", [False, True], ids=["qwen3next", "qwen35moe"])
@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("bf16", 2e-3)])
def test_llama_cpp_converter_file_matches_transformers(tmp_path, demo_tokenizer, qwen35, outtype, tol):
    """A file made by llama.cpp's own convert_hf_to_gguf.py (STRATA_LLAMA_CPP_DIR: a llama.cpp source tree, e.g.
    the llama-cpp-python sdist's vendor/llama.cpp): its names, keys and stored forms (A_log as -exp, the conv
    squeezed, norms + 1, qwen35moe's tiled value heads) are what we read; the reference runs on the file's weights
    as gguf-py dequantizes them; a prompt over two 64-token chunks read 64 tokens a step."""
    import os
    import subprocess
    import sys

    from gguf import GGUFReader
    from gguf.quants import dequantize

    from tests.conftest import save_tokenizer_files

    llama_cpp = os.environ.get("STRATA_LLAMA_CPP_DIR")
    if not llama_cpp or not os.path.isfile(os.path.join(llama_cpp, "convert_hf_to_gguf.py")):
        pytest.skip("set STRATA_LLAMA_CPP_DIR to a llama.cpp source tree to run its converter")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, qwen35=qwen35), str(tmp_path / "hf"),
                         save_tokenizer_files, demo_tokenizer)
    out = str(tmp_path / f"converted-{outtype}.gguf")
    script = os.path.join(os.path.dirname(__file__), "llama_convert.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, script, llama_cpp, hf_dir, out, outtype, "--no-mtp"], check=True,
                   capture_output=True, env={**os.environ, "PYTHONPATH": root})  # the tiny models have no MTP layer
    llm = hybrid.LLM(out, device="cpu", act_quant="float")
    assert llm.config.arch == ("qwen35moe" if qwen35 else "qwen3next")
    canonical = {t.name: np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
        [int(d) for d in reversed(t.shape)]) for t in GGUFReader(out).tensors}
    ref_model = reference_model(hf_dir, canonical, llm.config)
    assert rel_err(score_in_chunks(llm, PROMPT_150, 64), hf_logits(ref_model, PROMPT_150)) <= tol


@pytest.mark.slow
def test_layer_pattern_from_the_file(tmp_path, demo_tokenizer):
    """Full attention where the file's per-layer list says (llama.cpp's attention.recurrent_layers, from HF
    layer_types), not only every fourth layer."""
    from tests.conftest import save_tokenizer_files

    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size, layer_types=types), str(tmp_path / "hf"),
                         save_tokenizer_files, demo_tokenizer)
    path = str(tmp_path / "pattern.gguf")
    ref_model = reference_model(hf_dir, *write_qwen3next_gguf(hf_dir, path, "F32", demo_tokenizer))
    llm = hybrid.LLM(path, device="cpu")
    assert llm.config.layer_types == tuple(types) and llm.model.recurrent_shape.layers == (0, 2)
    assert rel_err(llm.score(PROMPT_40), hf_logits(ref_model, PROMPT_40)) <= 1e-4
