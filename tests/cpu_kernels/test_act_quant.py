"""Decode activations rounded to int16 (STRATA_ACT_QUANT): the rounding, the setting, end-to-end fidelity."""
import numpy as np
import pytest

import hybrid
from cpu_kernels import act_quant as aq
from cpu_kernels.tiles import work_items
from hybrid.batch import Batch, SeqChunk

PROMPT_IDS = [5, 17, 300, 42, 7, 99, 123, 64, 8, 250, 11, 3, 77, 500, 21, 9]
DECODE_TOL = 2e-3  # the end-to-end tolerance of quantized files (test_model_vs_transformers)


def decode_items(num_rows):
    """Work items of num_rows one-token groups of one expert (a decode step's shape)."""
    return work_items(np.zeros(num_rows, np.int64), np.arange(num_rows + 1, dtype=np.int64), 1, 16)


def test_quantize_rows_rounds_each_block_to_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 96)) * np.repeat([[1e-3, 1.0, 50.0]], 32, axis=1)).astype(np.float32)  # [N, C]
    x[1, 32:64] = 0.0  # an all-zero block
    xq, aux = aq.quantize_rows(x, decode_items(3), aq.ACT_QUANTS["int16"])
    scale = aux[:, 0::2]  # [N, C/32]
    assert np.abs(xq).max() == 32767 and scale[1, 1] == 0.0
    assert np.all(np.abs(xq * np.repeat(scale, 32, axis=1) - x) <= np.repeat(scale, 32, axis=1) * 0.5001)
    np.testing.assert_allclose(aux[:, 1::2], x.reshape(3, 3, 32).sum(axis=2), rtol=1e-5, atol=1e-6)


def test_quantize_rows_skips_float_and_prefill():
    x = np.ones((40, 64), np.float32)
    assert aq.quantize_rows(x[:2], decode_items(2), aq.ACT_QUANTS["float"])[0].shape == (0, 64)
    prefill = work_items(np.zeros(1, np.int64), np.array([0, 40]), 1, 16)  # one 40-token group
    assert aq.quantize_rows(x, prefill, aq.ACT_QUANTS["int16"])[0].shape == (0, 64)


def test_setting_names_and_default(monkeypatch):
    monkeypatch.delenv("STRATA_ACT_QUANT", raising=False)
    int16 = aq.ACT_QUANTS["int16"] if aq.int_dot_width() >= 16 else aq.ACT_QUANTS["float"]
    assert aq.default_act_quant() == int16
    monkeypatch.setenv("STRATA_ACT_QUANT", "float")
    assert aq.default_act_quant() == aq.ACT_QUANTS["float"]
    monkeypatch.setenv("STRATA_ACT_QUANT", "int4")
    with pytest.raises(ValueError, match="STRATA_ACT_QUANT='int4'"):
        aq.default_act_quant()
    with pytest.raises(ValueError, match="act_quant='int4'"):
        aq.act_quant_code("int4")


def decode_logits(llm, ids):
    """Logits [T, V] of ids read one token at a time (every matvec on the decode path)."""
    kv = llm.model.new_sequence(len(ids) + 1)
    return np.concatenate([llm.model.forward(Batch([SeqChunk(kv, kv.length, np.array([t]), "last")])) for t in ids])


@pytest.mark.parametrize("size,target", [("small", "Q8_0"), ("kquant", "Q4_K_M"), ("kquant", "Q6_K")])
def test_int16_decode_matches_transformers(gguf_models, reference_logits, monkeypatch, size, target):
    """Decode logits with int16 activations stay within the quantized-file tolerance of transformers, and
    within a quarter of it of the float path's (measured: 7e-5 Q8_0, 1.1e-4 Q4_K_M, 1.8e-4 Q6_K)."""
    path, ref_dir = gguf_models(size, target)
    ref = reference_logits(ref_dir, PROMPT_IDS)
    logits = {}
    for mode in aq.ACT_QUANTS:
        monkeypatch.setenv("STRATA_ACT_QUANT", mode)
        logits[mode] = decode_logits(hybrid.LLM(path, device="cpu"), PROMPT_IDS)
    scale = np.abs(ref).max()
    assert np.abs(logits["int16"] - ref).max() / scale <= DECODE_TOL
    assert np.abs(logits["int16"] - logits["float"]).max() / scale <= DECODE_TOL / 4
