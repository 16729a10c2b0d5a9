"""Bad model input raises hybrid.ModelError naming the file and the problem; the CLI prints one line, exit 2."""
import json
import logging
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
    with pytest.raises(hybrid.ModelError, match=r"junk.gguf: not a GGUF file \(it starts with b'this'"):
        load_model(str(path))


def head_of(path, num_bytes, tmp_path, name):
    with open(path, "rb") as f:
        data = f.read(num_bytes)
    out = tmp_path / name
    out.write_bytes(data)
    return str(out)


@pytest.mark.parametrize("num_bytes", [100, 1024, 4096])
def test_the_head_of_a_gguf_is_truncated_in_our_words(tmp_path, gguf_models, num_bytes):
    # gguf-py's own errors here: numpy's "When changing to a larger dtype..." (100 bytes), an IndexError (1 KB)
    cut = head_of(gguf_models("small", "Q8_0")[0], num_bytes, tmp_path, "head.gguf")
    with pytest.raises(hybrid.ModelError, match=rf"^{cut}: truncated or damaged GGUF file \({num_bytes} bytes\): "
                                                rf"its header describes more data than the file holds$"):
        load_model(cut)


@pytest.mark.parametrize("content,problem", [
    (b"", "empty file, not a GGUF model"),
    (b"GGUF\x03\x00", r"truncated GGUF file \(6 bytes, shorter than its 24-byte header\)"),
    (b"GGUF" + (9).to_bytes(4, "little") + bytes(16), "GGUF version 9, Strata reads versions 2 and 3"),
    (b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "a big-endian GGUF file; Strata reads little-endian ones"),
    (b"PK\x03\x04" + bytes(40), r"not a GGUF file \(it starts with b'PK\\x03\\x04'"),
])
def test_a_bad_gguf_header_is_named(tmp_path, content, problem):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(hybrid.ModelError, match=f"^{path}: {problem}"):
        load_model(str(path))


def test_damaged_metadata_is_named(tmp_path, gguf_models):
    path = gguf_models("small", "Q8_0")[0]
    with open(path, "rb") as f:
        data = bytearray(f.read())
    key = data.index(b"general.architecture")
    data[key] = 0xFF  # a key that is not UTF-8
    bad = tmp_path / "bad-key.gguf"
    bad.write_bytes(data)
    with pytest.raises(hybrid.ModelError, match="bad-key.gguf: damaged GGUF metadata: a key or a string is not UTF-8"):
        load_model(str(bad))


def test_damaged_tokenizer_metadata_is_named(tmp_path, gguf_models):
    from gguf import GGUFReader

    from hybrid.formats.gguf_metadata import gguf_fields_to_dict

    path = gguf_models("small", "Q8_0")[0]
    fields = gguf_fields_to_dict(GGUFReader(path))
    merged = "".join(fields["tokenizer.ggml.merges"][0].split(" "))
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[tokens.index(merged)] = "<renamed>"  # a merge now makes a token the vocabulary lacks
    dst = _rewrite_gguf(path, str(tmp_path / "vocab.gguf"), overrides={"tokenizer.ggml.tokens": tokens})
    with pytest.raises(hybrid.ModelError, match=r"vocab.gguf: damaged tokenizer metadata \(the tokenizers library: "):
        load_model(dst)


def _rewrite_gguf(src, dst, tensor_filter=None, arch=None, retype=None, overrides=None):
    """Copy a GGUF's metadata and tensors, optionally dropping, retyping, renaming the arch or replacing
    metadata values (`overrides`: key -> value of the same type)."""
    from gguf import GGUFReader

    from hybrid.formats.gguf_metadata import gguf_fields_to_dict

    reader = GGUFReader(src)
    fields = gguf_fields_to_dict(reader)
    writer = GGUFWriter(dst, arch or fields["general.architecture"])
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (overrides or {}).get(key, fields[key])
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
    # I32 has F32's 4 bytes per value: the retyped file is well formed but unsupported.
    path, _ = gguf_models("small", "F32")
    dst = _rewrite_gguf(path, str(tmp_path / "iq.gguf"), retype={"blk.0.attn_q.weight": GGMLQuantizationType.I32})
    with pytest.raises(hybrid.ModelError, match=r"iq.gguf: tensor 'blk.0.attn_q.weight' has type I32"):
        hybrid.LLM(dst)  # the file is read; the engine has no kernel for the type


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


def test_a_directory_without_config_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(hybrid.ModelError, match=r"empty: not a model directory \(no config.json; a GGUF model is "):
        load_model(str(tmp_path / "empty"))


def test_a_config_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(hybrid.ModelError, match="config.json: expected a JSON object of model settings, got a list"):
        load_model(str(tmp_path))


def test_one_safetensors_shard_is_not_a_model(tmp_path):
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(bytes(16))
    with pytest.raises(hybrid.ModelError, match=r"model.safetensors: give the model's directory"):
        load_model(str(shard))


def test_a_safetensors_header_that_is_not_an_object(tmp_path, hf_dirs):
    directory = tmp_path / "listed"
    shutil.copytree(hf_dirs["small"], directory)
    header = b"[1]"
    (directory / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(hybrid.ModelError, match="model.safetensors: not a valid safetensors file \\(its header is not"):
        load_model(str(directory))


def test_cli_names_a_100_byte_gguf_in_one_line(tmp_path, gguf_models, capsys):
    cut = head_of(gguf_models("small", "Q8_0")[0], 100, tmp_path, "tiny.gguf")
    assert cli_main(["generate", "--model", cut, "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"strata: error: {cut}: truncated or damaged GGUF file (100 bytes): its header describes "
                       f"more data than the file holds")


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


def spill_file(path, header, token_ids):
    np.savez(path, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), token_ids=token_ids)


def test_damaged_spill_files_are_moved_aside_once(tmp_path, caplog):
    from hybrid.conversation_cache import SPILL_MAGIC, SPILL_VERSION, ConversationCache

    spill = tmp_path / "spill"
    spill.mkdir()
    (spill / "junk.npz").write_bytes(b"not a zip file")
    header = {"magic": SPILL_MAGIC, "version": SPILL_VERSION, "model": "m", "store": "f32",
              "tokens_sha256": "not the checksum"}
    spill_file(spill / "checksum.npz", header, np.arange(32))
    spill_file(spill / "foreign.npz", {**header, "model": "another model"}, np.arange(32))
    with caplog.at_level(logging.WARNING):
        assert not ConversationCache(1 << 20, "m", spill_dir=str(spill)).entries
    assert f"{spill / 'junk.npz'}: unreadable" in caplog.text
    assert f"{spill / 'checksum.npz'}: token ids do not match their checksum; moved aside" in caplog.text
    assert sorted(os.listdir(spill)) == ["checksum.npz.damaged", "foreign.npz", "junk.npz.damaged"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ConversationCache(1 << 20, "m", spill_dir=str(spill))
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping conversation spill file {spill / 'foreign.npz'}: written for another model"]
