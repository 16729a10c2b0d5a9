"""The decode prefetch distance: a run-time value the compiled dot loops follow, chosen per host by timing."""
import os
from types import SimpleNamespace

import numpy as np
import pytest

from cpu_kernels import prefetch, q4_k, q8_0
from cpu_kernels.tiles import ONE_EXPERT, kernels_of


@pytest.fixture(autouse=True)
def keep_distance():
    before = prefetch.prefetch_rows()
    yield
    prefetch.set_prefetch_rows(before)


def expert_tensor(fmt, qtype, seed, shape=(4, 64, 256)):
    return SimpleNamespace(raw=fmt.random_blocks(np.random.default_rng(seed), shape, 0.05), qtype=qtype)


@pytest.mark.parametrize("fmt", [q4_k, q8_0], ids=["q4_k", "q8_0"])
def test_results_do_not_depend_on_the_distance(fmt):
    raw = fmt.random_blocks(np.random.default_rng(0), (2, 40, 512), 0.05)  # [E, R, B]
    parallel, serial, cols = kernels_of(fmt, raw)
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    outs = []
    for rows in (0, 4, 33, 1024):  # 33 and 1024 run past the last row: clamped there
        prefetch.set_prefetch_rows(rows)
        out = np.empty((1, 40), np.float32)
        serial((raw,), x, ONE_EXPERT + 1, np.array([0, 1]), (out,), 1)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_calibrate_keeps_the_fastest_candidate(monkeypatch):
    tensors = [expert_tensor(q4_k, q4_k.QTYPE, seed) for seed in range(3)]
    timings = iter([0.0, 0.02, 0.0, 0.01, 0.0, 0.03] * 4)  # per timed pass: start, end (8 rows ahead fastest)
    monkeypatch.setattr(prefetch.time, "perf_counter", lambda: next(timings))
    rates = prefetch.calibrate(tensors, min_bytes=0, candidates=(4, 8, 16))
    assert set(rates) == {4, 8, 16} and prefetch.prefetch_rows() == 8
    assert rates[8] == max(rates.values())


def test_calibrate_leaves_small_models_and_a_fixed_setting_alone():
    tensors = [expert_tensor(q4_k, q4_k.QTYPE, 0)]
    prefetch.set_prefetch_rows(12)
    assert prefetch.calibrate(tensors) == {}  # a few KB: in cache, nothing to learn
    assert prefetch.prefetch_rows() == 12
    assert prefetch.calibrate(tensors, rows=20, min_bytes=0) == {}
    assert prefetch.prefetch_rows() == 20
    with pytest.raises(ValueError, match="prefetch distance -1"):
        prefetch.set_prefetch_rows(-1)
    with pytest.raises(ValueError, match="prefetch distance 'lots'"):
        prefetch.calibrate(tensors, rows="lots", min_bytes=0)


def test_cached_kernels_run_first_in_a_fresh_process(tmp_path):
    """A kernel reads the prefetch distance through an external symbol: compiled in one process and loaded
    from Numba's cache in the next, as that process's first kernel, it runs and gives the same result."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import numpy as np\n"
        "from cpu_kernels import q8_0\n"
        "from cpu_kernels.tiles import kernels_of\n"
        "raw = q8_0.random_blocks(np.random.default_rng(0), (2, 32, 256), 0.05)\n"
        "_, serial, cols = kernels_of(q8_0, raw)\n"
        "out = np.empty((2, 32), np.float32)\n"
        "serial((raw,), np.ones((2, cols), np.float32), np.arange(2), np.arange(3), (out,), 1)\n"
        "print(float(out.sum()))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and any(tmp_path.rglob("*.nbi"))
