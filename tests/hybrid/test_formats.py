"""Model formats: HF config variants, memory mapping, safetensors shards."""
import json
import mmap
import os
import shutil

import numpy as np
import pytest

import hybrid
from hybrid.arch.qwen3moe import config_from_hf
from hybrid.formats import load_model

BASE = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 512}


@pytest.mark.parametrize("experts", [{"num_experts": 8}, {"num_local_experts": 8}])
@pytest.mark.parametrize("rope", [{"rope_theta": 5e5}, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}])
def test_hf_config_field_variants(experts, rope):
    config = config_from_hf({**BASE, **experts, **rope}, "config.json")
    assert config.num_experts == 8 and config.rope_theta == 5e5


def test_hf_config_refuses_unsupported_rope_scaling():
    cfg = {**BASE, "num_experts": 8, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    with pytest.raises(hybrid.ModelError, match="config.json: rope type 'yarn' is not supported"):
        config_from_hf(cfg, "config.json")


def test_hf_config_missing_field_is_named():
    with pytest.raises(hybrid.ModelError, match="config.json: missing field 'num_experts'"):
        config_from_hf(dict(BASE), "config.json")


def _root(array):
    while getattr(array, "base", None) is not None and not isinstance(array.base, mmap.mmap):
        array = array.base
    return array.base


def test_gguf_weights_are_memory_mapped(gguf_models):
    weights = load_model(gguf_models("kquant", "Q4_K_M")[0])
    for name in ("blk.0.ffn_down_exps.weight", "token_embd.weight"):
        raw = weights[name].raw
        assert not raw.flags.owndata and not raw.flags.writeable
        assert isinstance(_root(raw), mmap.mmap), name


def test_sharded_safetensors_dir(tmp_path, hf_dirs, reference_logits):
    """The hub's sharded layout (index + several files) loads the same model."""
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "sharded"
    shutil.copytree(hf_dirs["small"], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    os.remove(directory / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = hybrid.LLM(str(directory)).score(ids)
    ref = reference_logits(hf_dirs["small"], ids)
    assert np.max(np.abs(ours - ref)) <= 1e-4 * np.max(np.abs(ref))


def test_truncated_safetensors_shard(tmp_path, hf_dirs):
    directory = tmp_path / "cut"
    shutil.copytree(hf_dirs["small"], directory)
    shard = directory / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(hybrid.ModelError, match=r"model.safetensors: tensor '.*' data .* is truncated"):
        load_model(str(directory))


def test_tied_embeddings_in_both_formats(tmp_path, hf_dir_factory, reference_logits):
    """A model whose head reuses the token embedding (no lm_head / output.weight) loads from both formats."""
    from hybrid.formats.gguf_writer import write_gguf

    directory = hf_dir_factory("small", tie_word_embeddings=True, num_hidden_layers=2)
    ids = [7, 70, 700, 3, 33]
    ref = reference_logits(directory, ids)
    from_dir = hybrid.LLM(directory)
    assert from_dir.config.tie_word_embeddings and "output.weight" not in from_dir.weights.tensors
    assert np.max(np.abs(from_dir.score(ids) - ref)) <= 1e-4 * np.max(np.abs(ref))
    path = str(tmp_path / "tied.gguf")
    write_gguf(path, from_dir.config, from_dir.weights.tensors.values(), from_dir.tokenizer)
    from_gguf = hybrid.LLM(path)
    assert from_gguf.config.tie_word_embeddings
    assert np.max(np.abs(from_gguf.score(ids) - ref)) <= 1e-4 * np.max(np.abs(ref))


def test_a_type_no_kernel_runs_is_one_line_naming_the_tensor():
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType as Q

    from hybrid.errors import ModelError
    from hybrid.weight_formats import check_supported

    weights = SimpleNamespace(source="m.gguf", tensors={"blk.0.ffn_up_exps.weight": SimpleNamespace(
        name="blk.0.ffn_up_exps.weight", qtype=Q.TQ1_0)})
    supported = r"\(supported: BF16, F16, F32, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, " \
        r"MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, TQ2_0\)$"
    with pytest.raises(ModelError, match=r"^m.gguf: tensor 'blk.0.ffn_up_exps.weight' has type TQ1_0, which Strata "
                                         r"does not support " + supported):
        check_supported(weights)
