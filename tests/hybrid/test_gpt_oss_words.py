"""gpt-oss with MXFP4 experts wide enough for the word-lookup decode dot (cpu_kernels.table_words: four 32-column
blocks a step, x in its own order): decode steps, one token at a time, against transformers (float32) on the
file's dequantized weights, per-op compiled (1 thread) and fused (2 threads). The tiny models of test_gpt_oss.py
have rows of 1-2 blocks, which only the generic block code reads."""
import copy

import numpy as np
import pytest

import hybrid
from cpu_kernels import table_words
from hybrid.batch import Batch, SeqChunk
from tests.hybrid.gpt_oss_models import hf_logits, load_dequantized, make_gpt_oss_hf_model, write_gpt_oss_gguf
from tests.hybrid.test_gpt_oss import PROMPT_IDS, rel_err

PREFILL = 12  # tokens read at once; the rest of PROMPT_IDS are decode steps (past the window of 8)


@pytest.fixture(scope="module")
def wide_files(tmp_path_factory, demo_tokenizer):
    """(GGUF path, HF logits of PROMPT_IDS on its dequantized weights): hidden 160 (5 blocks: one step and a
    tail block for the gate / up rows), expert width 288 (9 blocks: two steps and a tail for the down rows)."""
    model = make_gpt_oss_hf_model(demo_tokenizer.vocab_size, hidden_size=160, intermediate_size=288)
    path = str(tmp_path_factory.mktemp("gpt-oss-words") / "gpt-oss-words.gguf")
    tensors = write_gpt_oss_gguf(model, demo_tokenizer, path, "MXFP4_MOE")
    return path, hf_logits(load_dequantized(copy.deepcopy(model), tensors), PROMPT_IDS)


@pytest.mark.slow
@pytest.mark.skipif(not table_words.AVAILABLE, reason="the target has no AVX-512 VBMI")
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_steps_match_transformers(wide_files, threads):
    path, reference = wide_files
    llm = hybrid.LLM(path, device="cpu", threads=threads)
    kv = llm.model.new_sequence(len(PROMPT_IDS) + 8)
    llm.model.forward(Batch([SeqChunk(kv, 0, np.asarray(PROMPT_IDS[:PREFILL], dtype=np.int64), "last")]))
    for i in range(PREFILL, len(PROMPT_IDS)):
        ids = np.asarray(PROMPT_IDS[i:i + 1], dtype=np.int64)
        logits = llm.model.forward(Batch([SeqChunk(kv, kv.length, ids, "last")]))[0]
        assert rel_err(logits, reference[i]) <= 2e-3, i
