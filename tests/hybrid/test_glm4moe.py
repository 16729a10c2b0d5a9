"""glm4moe (GLM-4.5/4.6/4.7): tiny random models against transformers' Glm4MoeForCausalLM (float32), its GGUF
names and keys, the NextN layer kept, and one-line errors on bad files."""
import dataclasses

import numpy as np
import pytest

import hybrid
from hybrid.errors import ModelError
from tests.hybrid.glm4moe_models import glm_greedy, glm_logits, reference_dir, write_glm_gguf

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11, 3, 77, 500, 21, 9, 300, 42, 1, 2,
              60, 61, 62, 400, 33, 34, 35, 36, 37]  # 29 tokens: prefill size


def rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("target,tol,kquant", [
    ("F32", 1e-4, False), ("Q8_0", 2e-3, False),
    pytest.param("Q4_K_M", 2e-3, True, marks=pytest.mark.slow),
    pytest.param("Q4_0", 2e-3, False, marks=pytest.mark.slow),
])
def test_gguf_logits_match_transformers(glm_files, target, tol, kquant):
    path, ref_dir = glm_files(target, kquant)
    llm = hybrid.LLM(path, device="cpu")
    ours = llm.score(PROMPT_IDS)
    assert rel_err(ours, glm_logits(ref_dir, PROMPT_IDS)) <= tol


@pytest.mark.slow
@pytest.mark.parametrize("target", ["F32", "Q8_0"])
def test_greedy_generation_matches_transformers(glm_files, target):
    path, ref_dir = glm_files(target)
    llm = hybrid.LLM(path, device="cpu")
    out = llm.generate(PROMPT_IDS[:9], max_tokens=32, temperature=0.0, ignore_eos=True)
    assert out.token_ids == glm_greedy(ref_dir, PROMPT_IDS[:9], 32)


def test_safetensors_dir_matches_transformers(glm_hf_dir):
    llm = hybrid.LLM(glm_hf_dir, device="cpu")
    assert rel_err(llm.score(PROMPT_IDS), glm_logits(glm_hf_dir, PROMPT_IDS)) <= 1e-4


def test_gguf_names_keys_and_nextn_layer(glm_files):
    """llama.cpp's names (gguf-py's MODEL_TENSORS[GLM4_MOE]) and keys; the NextN layer loaded and kept, not run."""
    from gguf import GGUFReader
    from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

    path, _ = glm_files("F32")
    reader = GGUFReader(path)
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GLM4_MOE]}
    for t in reader.tensors:
        stem = t.name.rsplit(".", 1)[0]
        generic = "blk.{bid}." + stem.split(".", 2)[2] if stem.startswith("blk.") else stem
        assert generic in allowed, t.name
    keys = {f.name for f in reader.fields.values()}
    for key in ("block_count", "leading_dense_block_count", "expert_shared_count", "expert_gating_func",
                "expert_weights_scale", "expert_group_count", "expert_group_used_count", "rope.dimension_count",
                "nextn_predict_layers"):
        assert f"glm4moe.{key}" in keys
    llm = hybrid.LLM(path, device="cpu")
    c = llm.config
    assert (c.num_layers, c.num_nextn_layers, c.first_dense_layers, c.rotary_dim) == (3, 1, 1, 8)
    model = llm.model
    assert [layer.index for layer in model.nextn_layers] == [3]
    assert model.nextn_layers[0].gate_shexp is not None
    assert set(model.nextn_tensors[0]) == {"eh_proj.weight", "enorm.weight", "hnorm.weight",
                                           "shared_head_norm.weight"}
    assert len(model.layers) == 3 and model.kv_pool.num_layers == 3


def _write_without(glm_hf_dir, path, monkeypatch, drop_key=None, drop_tensor=None):
    """A tiny glm4moe GGUF without one metadata key or one tensor."""
    from hybrid.arch import ARCHS, glm4moe
    from hybrid.formats import gguf_writer

    if drop_key is not None:
        def hparams(writer, config):
            glm4moe.write_gguf_hparams(writer, config)
            writer.kv_data[0].pop(f"glm4moe.{drop_key}")

        monkeypatch.setitem(ARCHS, "glm4moe", dataclasses.replace(ARCHS["glm4moe"], write_gguf_hparams=hparams))
    if drop_tensor is not None:
        write = gguf_writer.write_gguf
        monkeypatch.setattr(gguf_writer, "write_gguf", lambda p, config, tensors, *a, **k: write(
            p, config, [t for t in tensors if t.name != drop_tensor], *a, **k))
    return write_glm_gguf(glm_hf_dir, path, "F32")


@pytest.mark.parametrize("drop_key,drop_tensor,message", [
    ("feed_forward_length", None, "missing GGUF metadata 'glm4moe.feed_forward_length'"),
    (None, "blk.1.ffn_gate_shexp.weight", "missing tensor 'blk.1.ffn_gate_shexp.weight'"),
    (None, "blk.3.nextn.eh_proj.weight", "missing tensor 'blk.3.nextn.eh_proj.weight'"),
])
def test_missing_glm_key_or_tensor_is_one_line_error(glm_hf_dir, tmp_path, monkeypatch, drop_key, drop_tensor,
                                                     message):
    path = _write_without(glm_hf_dir, str(tmp_path / "bad.gguf"), monkeypatch, drop_key, drop_tensor)
    with pytest.raises(ModelError) as err:
        hybrid.LLM(path, device="cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("bf16", 2e-3)])
def test_llama_cpp_converter_file_matches_transformers(glm_hf_dir, tmp_path, outtype, tol):
    """A file made by llama.cpp's own convert_hf_to_gguf.py (STRATA_LLAMA_CPP_DIR: a llama.cpp source tree, e.g.
    the llama-cpp-python sdist's vendor/llama.cpp): its names, keys and layouts are what we read; the reference runs
    on the file's weights as gguf-py dequantizes them."""
    import os
    import subprocess
    import sys

    llama_cpp = os.environ.get("STRATA_LLAMA_CPP_DIR")
    if not llama_cpp or not os.path.isfile(os.path.join(llama_cpp, "convert_hf_to_gguf.py")):
        pytest.skip("set STRATA_LLAMA_CPP_DIR to a llama.cpp source tree to run its converter")
    out = str(tmp_path / f"glm-{outtype}.gguf")
    script = os.path.join(os.path.dirname(__file__), "llama_convert.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, script, llama_cpp, glm_hf_dir, out, outtype], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": root})
    llm = hybrid.LLM(out, device="cpu")
    assert llm.weights["blk.1.ffn_gate_exps.weight"].qtype.name == outtype.upper()
    ref_dir = reference_dir(out, glm_hf_dir, str(tmp_path))
    assert rel_err(llm.score(PROMPT_IDS), glm_logits(ref_dir, PROMPT_IDS)) <= tol


@pytest.mark.parametrize("change,message", [
    (dict(n_group=3), "8 experts in 3 groups"), (dict(topk_group=1, num_experts_per_tok=3), "3 experts per token"),
    (dict(partial_rotary_factor=0.3125), "RoPE over 5 dims"),
    (dict(n_routed_experts=None), "missing field 'n_routed_experts'"),
])
def test_bad_hf_config_is_one_line_error(glm_hf_dir, tmp_path, change, message):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(glm_hf_dir, bad)
    with open(bad / "config.json") as f:
        cfg = json.load(f)
    cfg.update(change)
    if "partial_rotary_factor" in change:
        cfg["rope_parameters"]["partial_rotary_factor"] = change["partial_rotary_factor"]
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ModelError) as err:
        hybrid.LLM(str(bad), device="cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_long_prompt_scores_match_transformers(glm_files):
    """300 positions: the partial RoPE far from the start, prompt chunks and decode steps alike."""
    path, ref_dir = glm_files("F32")
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 1000, 300)]
    llm = hybrid.LLM(path, device="cpu", max_context=512)
    assert rel_err(llm.score(ids), glm_logits(ref_dir, ids)) <= 1e-4


def test_safetensors_dir_keeps_nextn_layer(glm_files, glm_hf_dir):
    """An HF checkpoint with its MTP weights (model.layers.{L}.eh_proj ...: the reference directory has them, as
    GLM-4.5's own do) gets its NextN layer; transformers' own save (none of them) gets none."""
    _, ref_dir = glm_files("F32")
    with_nextn = hybrid.LLM(ref_dir, device="cpu")
    assert with_nextn.config.num_nextn_layers == 1 and len(with_nextn.model.nextn_layers) == 1
    assert "eh_proj.weight" in with_nextn.model.nextn_tensors[0]
    assert hybrid.LLM(glm_hf_dir, device="cpu").config.num_nextn_layers == 0
