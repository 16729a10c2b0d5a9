"""bench/stages.py end to end over NumPy stand-in devices (reference kernels), so that a device call does not find it
broken: every table comes out whole."""
import importlib.util
from pathlib import Path

import pytest

from tests.hybrid.test_stages import stand_in_gpus  # noqa: F401  (the fixture)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "stages.py"


@pytest.mark.slow
def test_bench_writes_every_table(stand_in_gpus, gguf_models, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("STRATA_ACT_QUANT", "float")
    spec = importlib.util.spec_from_file_location("stages_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "stages.md"
    path, _ = gguf_models("small", "Q8_0")
    assert bench.main(["--model", path, "--split", "2", "--decode-tokens", "3", "--prompt-tokens", "40", "--runs", "2",
                       "--output", str(out)]) == 0
    text = out.read_text()
    assert "| stages' cost |" in text and "two stages pipelined (auto)" in text and "--trim-stage-weights |" in text
    assert text.count(" MiB |") == 3 and "nan" not in text and "Medians of 2 runs" in text
