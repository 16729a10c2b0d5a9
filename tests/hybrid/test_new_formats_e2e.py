"""End to end on every quant type a downloaded GGUF may hold (issue 35): a tiny random qwen3moe in each type and
mix against transformers (float32) on the weights gguf-py dequantizes from the file; the type mix printed at load;
bench/make_model.py's types; a tensor of an unknown type id."""
import logging
import os
import re
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q

import hybrid
from cpu_kernels.formats import is_supported
from hybrid.cli import main as cli_main
from hybrid.formats import load_model
from hybrid.formats.synthetic import mix_types

from .test_model_vs_transformers import PROMPT_IDS, rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 2e-3  # max|diff| / max|ref| of the logits
GREEDY_TOKENS = 16

# (model size, file type or mix): "kquant" for the formats of 256-weight super-blocks. Every case is slow: each
# file's combination of formats compiles its own CPU decode layer (a minute or more cold on a 2-core VM).
CASES = [("kquant", "UD_MIX"), ("kquant", "IQ4_XS"), ("kquant", "IQ3_S"), ("kquant", "IQ2_XXS"), ("kquant", "Q3_K"),
         ("kquant", "Q2_K"), ("small", "MXFP4"), ("kquant", "Q3_K_M"), ("kquant", "MXFP4_MOE"), ("small", "Q4_1"),
         ("small", "Q5_0"), ("small", "Q5_1"), ("small", "IQ4_NL"), ("kquant", "IQ3_XXS"), ("kquant", "IQ2_XS"),
         ("kquant", "IQ2_S"), ("kquant", "IQ1_S"), ("kquant", "IQ1_M")]


def needs_kernels(target):
    missing = sorted(q.name for q in mix_types(target) if not is_supported(q))
    if missing:
        pytest.skip(f"no CPU kernels yet for {', '.join(missing)}")


@pytest.mark.slow
@pytest.mark.parametrize("size,target", CASES, ids=[f"{size}-{target}" for size, target in CASES])
def test_logits_and_greedy_tokens_match_transformers(gguf_models, reference_logits, reference_greedy, size, target):
    needs_kernels(target)
    path, ref_dir = gguf_models(size, target)
    llm = hybrid.LLM(path, device="cpu")
    assert {t.qtype for t in llm.weights.tensors.values()} - {Q.F32} == mix_types(target)
    ours, ref = llm.score(PROMPT_IDS), reference_logits(ref_dir, PROMPT_IDS)
    assert ours.shape == ref.shape == (len(PROMPT_IDS), llm.config.vocab_size)
    assert rel_err(ours, ref) <= TOL
    out = llm.generate(PROMPT_IDS[:9], max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    assert out.token_ids == reference_greedy(ref_dir, PROMPT_IDS[:9], GREEDY_TOKENS)


def test_the_type_mix_is_by_bytes_largest_first(gguf_models):
    weights = load_model(gguf_models("kquant", "Q4_K_M")[0])
    assert re.fullmatch(r"Q4_K \d+ %, Q6_K \d+ %, F32 (\d+|0\.\d|<0\.1) %", weights.type_mix()), weights.type_mix()


def test_generate_prints_the_type_mix_at_load(gguf_models, caplog, capsys):
    path, _ = gguf_models("small", "Q8_0")
    with caplog.at_level(logging.INFO):
        assert cli_main(["generate", "--model", path, "--device", "cpu", "-n", "1", "--prompt-ids", "1,2"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model types by bytes: ")]
    assert lines == [f"model types by bytes: {load_model(path).type_mix()}"]
    assert lines[0].startswith("model types by bytes: Q8_0 ")


def _retype_first_tensor(src, dst, type_id):
    """A copy of the GGUF at src with its first tensor's GGML type id set to type_id."""
    from gguf import GGUFReader

    reader = GGUFReader(src)
    first = reader.tensors[0]
    with open(src, "rb") as f:
        data = bytearray(f.read())
    at = first.field.offset + 8 + len(first.name.encode())  # the tensor's info: name (u64 length, bytes), dims, type
    dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * dims
    assert int.from_bytes(data[at:at + 4], "little") == first.tensor_type
    data[at:at + 4] = type_id.to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return str(dst)


def test_an_unknown_type_id_is_named(gguf_models, tmp_path, capsys):
    bad = _retype_first_tensor(gguf_models("small", "Q8_0")[0], tmp_path / "type99.gguf", 99)
    with pytest.raises(hybrid.ModelError, match=r"^.*type99.gguf: a tensor of unknown GGML type id 99 "):
        load_model(bad)
    assert cli_main(["generate", "--model", bad, "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"strata: error: {bad}: a tensor of unknown GGML type id 99")
    assert not any("Traceback" in line for line in err)


MAKE_MODEL_TYPES = ["Q3_K_M", "IQ4_XS", "IQ3_S", "IQ2_XXS", "MXFP4_MOE", "UD_MIX"]


@pytest.mark.slow
@pytest.mark.parametrize("target", MAKE_MODEL_TYPES)
def test_make_model_writes_each_type(tmp_path, target):
    needs_kernels(target)
    out = tmp_path / "bench.gguf"
    tiny = ["--layers", "2", "--hidden", "256", "--experts", "4", "--top-k", "2", "--moe-ff", "256", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--context", "256"]
    done = subprocess.run([sys.executable, "bench/make_model.py", "-o", str(out), "--type", target, "--files", "2",
                           *tiny], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    llm = hybrid.LLM(str(tmp_path / "bench-00001-of-00002.gguf"), device="cpu")
    assert {t.qtype for t in llm.weights.tensors.values()} - {Q.F32, Q.Q8_0} <= mix_types(target)
    assert llm.generate([1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True).token_ids
