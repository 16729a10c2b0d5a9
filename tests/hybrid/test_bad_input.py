"""Bad model input raises hybrid.ModelError naming the file and the problem; the CLI prints one line, exit 2."""
import json
import os
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

import hybrid
from hybrid.cli import main as cli_main
from hybrid.formats import load_model


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.gguf")
    with pytest.raises(hybrid.ModelError, match="nope.gguf: no such file"):
        load_model(path)


def test_truncated_gguf(tmp_path, gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    cut = str(tmp_path / "cut.gguf")
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(path) * 2 // 3))
    with pytest.raises(hybrid.ModelError, match="cut.gguf: truncated"):
        load_model(cut)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model file at all" * 10)
    with pytest.raises(hybrid.ModelError, match="junk.gguf: not a valid GGUF"):
        load_model(str(path))


def _rewrite_gguf(src, dst, tensor_filter=None, arch=None, retype=None):
    """Copy a GGUF's metadata and tensors, optionally dropping, retyping or renaming the arch."""
    from gguf import GGUFReader

    from hybrid.formats.gguf_metadata import gguf_fields_to_dict

    reader = GGUFReader(src)
    fields = gguf_fields_to_dict(reader)
    writer = GGUFWriter(dst, arch or fields["general.architecture"])
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = fields[key]
        vtype = field.types[0]
        sub = field.types[-1] if vtype.name == "ARRAY" else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if tensor_filter and not tensor_filter(t.name):
            continue
        qtype = retype.get(t.name, t.tensor_type) if retype else t.tensor_type
        writer.add_tensor(t.name, np.asarray(t.data).view(np.uint8), raw_dtype=qtype)  # [..., R, B]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture(tmp_path, gguf_models):
    path, _ = gguf_models("small", "F32")
    dst = _rewrite_gguf(path, str(tmp_path / "arch.gguf"), arch="mamba9")
    with pytest.raises(hybrid.ModelError, match=r"arch.gguf: unsupported architecture 'mamba9'"):
        load_model(dst)


def test_missing_gguf_tensor(tmp_path, gguf_models):
    path, _ = gguf_models("small", "F32")
    dst = _rewrite_gguf(path, str(tmp_path / "hole.gguf"), tensor_filter=lambda n: n != "blk.1.attn_k.weight")
    with pytest.raises(hybrid.ModelError, match=r"hole.gguf: missing tensor 'blk.1.attn_k.weight'"):
        load_model(dst)


def test_unsupported_tensor_type(tmp_path, gguf_models):
    # IQ4_NL has Q4_0's 18 bytes per 32 weights: the retyped file is well formed but unsupported.
    path, _ = gguf_models("small", "Q4_0")
    dst = _rewrite_gguf(path, str(tmp_path / "iq.gguf"), retype={"blk.0.attn_q.weight": GGMLQuantizationType.IQ4_NL})
    with pytest.raises(hybrid.ModelError, match=r"iq.gguf: tensor 'blk.0.attn_q.weight' has type IQ4_NL"):
        load_model(dst)


def test_safetensors_dir_missing_a_tensor(tmp_path, hf_dirs):
    from safetensors.numpy import load_file, save_file

    directory = tmp_path / "holed"
    shutil.copytree(hf_dirs["small"], directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(hybrid.ModelError, match=r"holed: missing tensor 'model.layers.2.mlp.experts.5.up_proj"):
        load_model(str(directory))


def test_safetensors_dir_unsupported_model_type(tmp_path, hf_dirs):
    directory = tmp_path / "other"
    shutil.copytree(hf_dirs["small"], directory)
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "llama"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(hybrid.ModelError, match=r"config.json: unsupported model_type 'llama'"):
        load_model(str(directory))


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    code = cli_main(["generate", "--model", str(tmp_path / "missing.gguf"), "-n", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == f"strata: error: {tmp_path / 'missing.gguf'}: no such file or directory"
    assert not any("Traceback" in line for line in err)


def test_prompt_longer_than_context(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    with hybrid.LLM(path, max_context=16) as llm:  # closed on the way out, the error raised through it
        with pytest.raises(hybrid.RequestError, match="prompt has 20 tokens; the context holds 16"):
            llm.generate(list(range(1, 21)), max_tokens=2)
