"""Split GGUF models (`<name>-00001-of-00003.gguf` ...): any file loads the whole model, memory-mapped; a
missing file or a file of another model is a one-line error naming the file."""
import os
import shutil

import numpy as np
import pytest

import hybrid
from hybrid.cli import main as cli_main
from hybrid.formats import load_model
from hybrid.formats.gguf_writer import write_gguf
from hybrid.formats.weights import QuantTensor

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11]


def write_split(weights, directory, num_files=3, tensors=None):
    os.makedirs(directory, exist_ok=True)
    tensors = weights.tensors.values() if tensors is None else tensors
    return write_gguf(os.path.join(directory, "tiny.gguf"), weights.config, tensors, weights.tokenizer,
                      name="tiny-split", num_files=num_files)


@pytest.fixture(scope="module")
def single_and_split(gguf_models, tmp_path_factory):
    """(the single file, its three split files)."""
    path, _ = gguf_models("small", "Q8_0")
    return path, write_split(load_model(path), str(tmp_path_factory.mktemp("split")))


def copy_split(paths, directory):
    os.makedirs(directory, exist_ok=True)
    return [shutil.copy(p, directory) for p in paths]


def test_split_names_follow_llama_cpp(single_and_split):
    _, paths = single_and_split
    assert [os.path.basename(p) for p in paths] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_the_split_model_gives_the_single_files_logits(single_and_split):
    single, paths = single_and_split
    split = hybrid.LLM(paths[0], device="cpu")
    assert split.weights.source == paths[0]
    np.testing.assert_array_equal(split.score(PROMPT_IDS), hybrid.LLM(single, device="cpu").score(PROMPT_IDS))


@pytest.mark.parametrize("given", [1, 2])
def test_any_file_loads_every_tensor_memory_mapped(single_and_split, given):
    single, paths = single_and_split
    whole, split = load_model(single), load_model(paths[given])
    assert split.source == paths[0]
    assert split.config == whole.config
    assert sorted(split.tensors) == sorted(whole.tensors)
    readers = split.file_handles
    assert len(readers) == 3
    for name, t in split.tensors.items():
        assert t.qtype == whole[name].qtype and t.shape == whole[name].shape
        np.testing.assert_array_equal(t.raw, whole[name].raw)
        assert any(np.shares_memory(t.raw, r.data) for r in readers), name  # a view of a mapped file, no copy
    assert {len(r.tensors) for r in readers} != {0}


def test_a_missing_file_is_named(single_and_split, tmp_path):
    paths = copy_split(single_and_split[1], tmp_path)
    os.remove(paths[2])
    with pytest.raises(hybrid.ModelError, match=f"^{paths[2]}: no such file, and the split model {paths[1]} needs all "
                                                f"its 3 files \\(1 missing\\)$"):
        load_model(paths[1])


def test_a_renamed_file_says_why_the_others_are_not_found(single_and_split, tmp_path):
    renamed = shutil.copy(single_and_split[1][0], tmp_path / "model.gguf")
    with pytest.raises(hybrid.ModelError, match="model.gguf: file 1 of a 3-file split model, but its name does not "
                                                "end in -00001-of-00003.gguf"):
        load_model(str(renamed))


def fewer_experts(weights, keep):
    """The same tensors with only `keep` experts: another model with as many tensors, of other shapes."""
    for t in weights.tensors.values():
        if "_exps." in t.name or t.name.endswith("ffn_gate_inp.weight"):
            yield QuantTensor(t.name, t.qtype, (keep, *t.shape[1:]) if "_exps." in t.name else (keep, t.shape[1]),
                              t.raw[:keep])
        else:
            yield t


def test_a_file_of_another_model_is_named(single_and_split, tmp_path):
    single, paths = single_and_split
    other = write_split(load_model(single), str(tmp_path / "other"), tensors=list(fewer_experts(load_model(single), 4)))
    mixed = copy_split(paths, tmp_path / "mixed")
    shutil.copy(other[1], mixed[1])
    with pytest.raises(hybrid.ModelError, match=f"^{mixed[1]}: tensor '.*' has shape .* expected .*another model"):
        load_model(mixed[0])


def test_a_file_of_a_model_split_otherwise_is_named(single_and_split, tmp_path):
    single, paths = single_and_split
    other = write_split(load_model(single), str(tmp_path / "other"), num_files=4)
    mixed = copy_split(paths, tmp_path / "mixed")
    shutil.copy(other[2], mixed[2])  # file 3 of 4: split.count says 4
    with pytest.raises(hybrid.ModelError, match=f"^{mixed[2]}: not a file of the split model {mixed[0]} \\(file 3 "
                                                f"of 4 of a .*; expected file 3 of 3"):
        load_model(mixed[0])


def test_a_file_named_twice_is_foreign(single_and_split, tmp_path):
    mixed = copy_split(single_and_split[1], tmp_path)
    shutil.copy(mixed[0], mixed[1])
    with pytest.raises(hybrid.ModelError, match=f"^{mixed[1]}: not a file of the split model {mixed[0]} \\(file 1 "
                                                f"of 3 .*expected file 2 of 3"):
        load_model(mixed[0])


@pytest.mark.parametrize("case", ["missing", "foreign"])
def test_cli_one_line_exit_2(single_and_split, tmp_path, capsys, case):
    paths = copy_split(single_and_split[1], tmp_path)
    if case == "missing":
        os.remove(paths[1])
    else:
        shutil.copy(paths[2], paths[1])
    assert cli_main(["generate", "--model", paths[0], "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"strata: error: {paths[1]}: ")
    assert not any("Traceback" in line for line in err)
