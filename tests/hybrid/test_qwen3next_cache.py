"""Conversation cache with a recurrent state (Qwen3-Next): state checkpoints every N tokens and at a parked
conversation's end; a returning conversation restores the longest prefix ending at a checkpoint and gives the
logits of reading it whole; a checkpoint of another shape, another model's or a damaged one is skipped with a warning;
checkpoints survive a spill."""
import logging
from dataclasses import replace

import numpy as np
import pytest

import hybrid
from hybrid.batch import Batch, SeqChunk
from hybrid.conversation_cache import ConversationCache
from tests.hybrid.qwen3next_models import make_hf_model, save_hf_dir, write_qwen3next_gguf

RNG = np.random.default_rng(7)
HISTORY = [int(t) for t in RNG.integers(3, 250, 150)]
RETURNING = HISTORY + [int(t) for t in RNG.integers(3, 250, 30)]  # the conversation goes on
EDITED = HISTORY[:100] + [int(t) for t in RNG.integers(3, 250, 40)]  # its history differs from position 100


@pytest.fixture(scope="module")
def llm(tmp_path_factory, demo_tokenizer):
    from tests.conftest import save_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen3next-cache")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(directory / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    path = str(directory / "qwen3next-F32.gguf")
    write_qwen3next_gguf(hf_dir, path, "F32", demo_tokenizer)
    return hybrid.LLM(path, device="cpu")


def read(llm, kv, ids, chunk=50):
    """Read ids from kv's length on, `chunk` tokens a step; the logits of every position read."""
    rows = []
    while kv.length < len(ids):
        part = np.asarray(ids[kv.length:kv.length + chunk], dtype=np.int64)
        rows.append(llm.model.forward(Batch([SeqChunk(kv, kv.length, part, "all")])))
    return np.concatenate(rows)


def parked_cache(llm, **settings):
    cache = ConversationCache(1 << 30, "model", checkpoint_tokens=64, **settings)
    kv = llm.model.new_sequence(1024)
    assert cache.restore(HISTORY, kv) == 0  # a miss, and the sequence now takes checkpoints
    read(llm, kv, HISTORY)
    assert [c.position for c in kv.recurrent.checkpoints] == [64, 128]
    cache.park(HISTORY, kv)
    assert [c.position for c in cache.entries[0].checkpoints] == [64, 128, 150]  # and one at its end
    return cache


@pytest.mark.parametrize("prompt,restored", [(RETURNING, 150), pytest.param(EDITED, 64, marks=pytest.mark.slow)],
                         ids=["returning", "edited"])
def test_restored_conversation_gives_the_logits_of_reading_it_whole(llm, prompt, restored):
    whole = llm.score(prompt)
    cache = parked_cache(llm)
    kv = llm.model.new_sequence(1024)
    assert cache.restore(prompt, kv) == restored == kv.length == kv.recurrent.length
    rows = read(llm, kv, prompt)
    err = np.abs(rows - whole[restored:]).max() / np.abs(whole).max()
    assert err <= 1e-4
    assert cache.state_bytes == sum(c.nbytes for c in cache.entries[0].checkpoints) > 0


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_is_skipped_with_a_warning(llm, caplog):
    cache = parked_cache(llm)
    entry = cache.entries[0]
    entry.checkpoints = [replace(c, conv=c.conv[:, :1]) for c in entry.checkpoints]
    kv = llm.model.new_sequence(1024)
    with caplog.at_level(logging.WARNING, logger="hybrid.conversation_cache"):
        assert cache.restore(RETURNING, kv) == 0
    assert "state checkpoint" in caplog.text
    assert kv.length == kv.recurrent.length == 0 and not cache.entries
    whole = llm.score(RETURNING)  # read again from the start
    assert np.abs(read(llm, kv, RETURNING) - whole).max() <= 1e-4 * np.abs(whole).max()


@pytest.mark.slow
def test_checkpoints_survive_a_spill(llm, tmp_path):
    parked_cache(llm, spill_dir=str(tmp_path))
    reloaded = ConversationCache(1 << 30, "model", checkpoint_tokens=64, spill_dir=str(tmp_path))
    assert [c.position for c in reloaded.entries[0].checkpoints] == [64, 128, 150]
    kv = llm.model.new_sequence(1024)
    assert reloaded.restore(RETURNING, kv) == 150
    err = np.abs(read(llm, kv, RETURNING) - llm.score(RETURNING)[150:]).max()
    assert err <= 1e-4 * np.abs(llm.score(RETURNING)).max()


@pytest.mark.slow
def test_a_damaged_spilled_checkpoint_is_moved_aside_with_a_warning(llm, tmp_path, caplog):
    import glob

    parked_cache(llm, spill_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.npz"))
    with np.load(path) as data:
        arrays = dict(data)
    arrays["state_positions"] = arrays["state_positions"][:-1]  # one checkpoint's position lost
    np.savez(path, **arrays)
    with caplog.at_level(logging.WARNING, logger="hybrid.conversation_cache"):
        reloaded = ConversationCache(1 << 30, "model", checkpoint_tokens=64, spill_dir=str(tmp_path))
    assert not reloaded.entries and "recurrent-state checkpoints" in caplog.text
    assert glob.glob(str(tmp_path / "*.damaged"))


def test_a_damaged_spilled_state_is_moved_aside_with_a_warning(llm, tmp_path, caplog):
    """One flipped bit in a spilled delta state: the file's checksum tells, it is never loaded."""
    import glob

    parked_cache(llm, spill_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.npz"))
    with np.load(path) as data:
        arrays = dict(data)
    arrays["state_delta"].view(np.uint32)[1, 0, 1, 2, 3] ^= 1 << 20
    np.savez(path, **arrays)
    with caplog.at_level(logging.WARNING, logger="hybrid.conversation_cache"):
        reloaded = ConversationCache(1 << 30, "model", checkpoint_tokens=64, spill_dir=str(tmp_path))
    assert not reloaded.entries and "do not match their checksum" in caplog.text
    assert glob.glob(str(tmp_path / "*.damaged"))
    kv = llm.model.new_sequence(1024)
    assert reloaded.restore(RETURNING, kv) == 0 and kv.recurrent.length == 0


def test_spilled_checkpoints_of_another_model_are_skipped_with_a_warning(llm, tmp_path, caplog):
    """Another model of the same shapes (another fingerprint): its parked conversations and their states are left
    on disk, never loaded; the conversation is read again from the start."""
    parked_cache(llm, spill_dir=str(tmp_path))  # fingerprint "model"
    with caplog.at_level(logging.WARNING, logger="hybrid.conversation_cache"):
        other = ConversationCache(1 << 30, "another-model", checkpoint_tokens=64, spill_dir=str(tmp_path))
    assert not other.entries and "written for another model" in caplog.text
    kv = llm.model.new_sequence(1024)
    assert other.restore(RETURNING, kv) == 0 and kv.recurrent.length == 0
    whole = llm.score(RETURNING)
    assert np.abs(read(llm, kv, RETURNING) - whole).max() <= 1e-4 * np.abs(whole).max()
