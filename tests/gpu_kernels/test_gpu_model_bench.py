"""bench/gpu_model.py end to end on the GPU backend's CPU stand-in (NumPy arrays, reference kernels): its
shares, decode ways, prefill and overlap tables come out whole, so a device call does not find it broken. Also
bench/gpu_host_cost.py, which runs on the CPU alone."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_kernels import runtime as gpu_runtime
from hybrid.backends import gpu as gpu_backend

from gpu_kernels.numpy_runtime import NumpyRuntime

from .conftest import ReferenceKernels

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_model.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setattr(gpu_runtime, "probe", lambda: gpu_runtime.Probe(NumpyRuntime(), ""))
    monkeypatch.setattr(gpu_backend, "Kernels", lambda runtime, stream=None, **options: ReferenceKernels())
    monkeypatch.setenv("STRATA_ACT_QUANT", "float")
    spec = importlib.util.spec_from_file_location("gpu_model_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tables(bench, gguf_models, tmp_path, *args):
    """The text the bench writes on the small Q8_0 model with these arguments (a 40-token prompt, 3 users)."""
    path, _ = gguf_models("small", "Q8_0")
    out = tmp_path / "model.md"
    assert bench.main(["--model", path, "--prompt-tokens", "40", "--users", "3", *args, "--output", str(out)]) == 0
    return out.read_text()


def test_bench_writes_every_table(bench, gguf_models, tmp_path):
    text = tables(bench, gguf_models, tmp_path, "--shares", "0,50,100", "--decode-tokens", "3", "--borrow-shares", "50",
                  "--modes", "inline,spare")
    header = "| resident % | tok/s (relay, step graph, the default) | tok/s (inline) | tok/s (relay, a core spare) |"
    assert header in text
    decode = text[text.index("## Decode"):text.index("## 3 users at once")]
    rows = [line for line in decode.splitlines() if line.startswith(("| 0 |", "| 50 |", "| 100 |"))]
    assert len(rows) == 3 and all(line.count("|") == 5 for line in rows), rows
    assert "| 50 | on |" in text and "| 50 | off |" in text
    users = text[text.index("## 3 users at once"):text.index("## Prefill")]
    assert ("| resident % | each (one by one) | together (one by one) | all decoding (one by one) | each (batch) | "
            "together (batch) | all decoding (batch) | each (batch, step graph) |") in users  # the default's graph
    rows = [line for line in users.splitlines() if line.startswith(("| 0 |", "| 50 |", "| 100 |"))]
    assert len(rows) == 3 and all(line.count("|") == 11 and "failed" not in line for line in rows), rows
    for run in ("decode, 50 % resident, relay, step graph |", "decode, 50 % resident, relay, a core spare |",
                "decode, 50 % resident, inline |", "prefill chunk, 50 % resident, borrow |"):
        assert run in text, run


def test_bench_names_an_unknown_mode(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--model", "unused.gguf", "--modes", "relay,sideways"])
    assert ("--modes: unknown sideways (known: inline, relay, spare, thread, opbyop, static, graph, graphstatic, "
            "relayN)") in capsys.readouterr().err


def test_bench_times_the_relay_at_a_thread_count_and_the_host_part_alone(bench, gguf_models, tmp_path):
    """--modes relayN: the relay with its worker on N threads, a row in each table; the hand-off table has a row per
    way and the host experts alone one per share."""
    text = tables(bench, gguf_models, tmp_path, "--shares", "50", "--decode-tokens", "2", "--borrow-shares", "-1",
                  "--modes", "relay,relay1,static", "--users", "0")
    assert "| resident % | tok/s (relay, step graph, the default) | tok/s (relay) | tok/s (relay, 1 threads) | " \
        "tok/s (relay, static shares) |" in text
    assert "decode, 50 % resident, relay, 1 threads |" in text
    handoff = text[text.index("## A decode layer's host part"):text.index("## The host experts alone")]
    rows = [line for line in handoff.splitlines() if line.startswith("| 50 %")]
    assert [r.split(" | ")[0] for r in rows] == ["| 50 %, relay, step graph", "| 50 %, relay",
                                                 "| 50 %, relay, 1 threads", "| 50 %, relay, static shares"], rows
    assert all(line.count("|") == 10 for line in rows), rows
    alone = [line for line in text[text.index("## The host experts alone"):].splitlines() if line.startswith("| 50 |")]
    assert [line.split(" | ")[2] for line in alone] == ["static", "claimed"], alone
    assert all(line.count("|") == 9 for line in alone), alone


def test_a_failed_users_run_leaves_the_other_tables(bench, gguf_models, tmp_path, monkeypatch):
    def fail(llm, users, num_tokens, relay_tokens, graphs=False):
        raise RuntimeError("2 of 3 concurrent requests failed: injected")

    monkeypatch.setattr(bench, "concurrent_rates", fail)
    text = tables(bench, gguf_models, tmp_path, "--shares", "50", "--decode-tokens", "2", "--borrow-shares", "-1",
                  "--modes", "relay")
    failed = " failed: RuntimeError: 2 of 3 concurrent requests failed: injected | | |"
    assert "| 50 |" + 2 * failed in text
    assert "decode, 50 % resident, relay |" in text


def test_host_cost_bench_counts_a_layers_launches(gguf_models):
    """bench/gpu_host_cost.py on the small model, without and with --dense-graphs: one table row each, the step's
    time split over its layers and launch calls. The kernels a layer are the same both ways (at least its dense
    ones and the resident experts'); the dense graphs take 7 launch calls a layer fewer: the attention RMSNorm,
    q/k/v (one launch on this Q8_0 model, its x rounded to int16 by one launch before it: Kernels.xq_per_launch)
    and the head norms with RoPE (one launch) become one replay, and the output projection (with its x rounding),
    residual add with the FFN RMSNorm (one launch), router and top-k another."""
    path, _ = gguf_models("small", "Q8_0")
    rows = {}
    for flags in ([], ["--dense-graphs"]):
        done = subprocess.run([sys.executable, str(BENCH.parent / "gpu_host_cost.py"), "--model", path, "--steps", "3",
                               "--warmup", "1", *flags], capture_output=True, text=True, cwd=BENCH.parents[1],
                              timeout=300)
        assert done.returncode == 0, done.stderr
        row = [v.strip() for v in done.stdout.strip().splitlines()[-1].split("|")[1:-1]]
        assert row[1] == ("yes" if flags else "no")
        layers, step_ms, layer_us, launches, kernels, launch_us = (float(v) for v in row[:1] + row[2:])
        assert layers >= 2 and step_ms > 0 and kernels >= 15
        assert abs(layer_us - step_ms * 1e3 / layers) <= 5 / layers + 0.05  # as printed: ms to 2 places, us to 1
        # layer_us to 1 place, launches to 1 (a layer's count need not be whole: x rounded once a launch adds one
        # where the launch is a `_qx` kernel's), launch_us to 2
        assert abs(launch_us - layer_us / launches) <= 0.05 / launches + 0.05 * layer_us / launches ** 2 + 0.005
        rows[bool(flags)] = launches, kernels
    assert rows[True][1] == rows[False][1]
    assert rows[False][0] - rows[True][0] == pytest.approx(7, abs=0.11)
