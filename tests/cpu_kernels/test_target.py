"""CPU controls: the ISA floor reaches Numba's code generator; thread counts apply."""
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from cpu_kernels.target import apply_isa_floor, set_threads

PROBE_HEAD = """
import hybrid  # applies STRATA_ISA_FLOOR before the kernels are imported
import numpy as np
from cpu_kernels import attention
from numba.core import config
rng = np.random.default_rng(0)
"""
FORMATS = """
from cpu_kernels import f16, q8_0
raw = q8_0.random_blocks(rng, (37, 160), 0.05)
w = np.empty((37, 160), np.float32); q8_0.dequantize(raw, w)
x = rng.standard_normal(160).astype(np.float32); out = np.empty(37, np.float32)
q8_0.matvec(raw, x, out, act_quant="float")
assert np.allclose(out, w @ x, rtol=1e-4, atol=1e-5)
q8_0.matvec(raw, x, out, act_quant="int16")  # the integer dot compiles under every floor (float below AVX2)
assert np.allclose(out, w @ x, rtol=1e-4, atol=1e-4)
halves = (rng.standard_normal((37, 160)) * 0.05).astype(np.float16)  # F16 weights: the integer widening without F16C
f16.matvec(halves.view(np.uint8), x, out)
assert np.allclose(out, halves.astype(np.float32) @ x, rtol=1e-4, atol=1e-5)
"""
ATTENTION = """
q = rng.standard_normal((5, 2, 16)).astype(np.float32)
k, v = (rng.standard_normal((1, 5, 2, 16)).astype(np.float32) for _ in range(2))
o = np.empty_like(q); attention.attention(q, k, v, np.zeros(1, np.int32), 0, 0, 5, 0.25, o)
asm = "".join(attention.attention.inspect_asm().values())
print(config.CPU_NAME, repr(config.CPU_FEATURES), "fma" if "vfmadd" in asm else "no-fma")
"""
PROBE = PROBE_HEAD + FORMATS + ATTENTION


def test_floor_names_map_to_numba_settings(monkeypatch):
    from numba.core import config

    # setenv first, so that the teardown removes what apply_isa_floor writes into os.environ
    # (left behind, it would make later subprocesses compile for Sandy Bridge)
    monkeypatch.setenv("NUMBA_CPU_NAME", "placeholder")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "placeholder")
    try:
        assert apply_isa_floor("avx") == "avx"
        assert os.environ["NUMBA_CPU_NAME"] == "sandybridge" and os.environ["NUMBA_CPU_FEATURES"] == ""
        assert config.CPU_NAME == "sandybridge"
    finally:
        monkeypatch.undo()
        config.reload_config()


def test_unknown_floor_is_refused():
    with pytest.raises(ValueError, match="ISA floor 'sse9'"):
        apply_isa_floor("sse9")


def start_probe(probe, cache_dir, floor=None, numba_target=None):
    """A fresh process running `probe` with an empty Numba cache, under STRATA_ISA_FLOOR=floor or with Numba's
    target (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES) set directly."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    for name in ("STRATA_ISA_FLOOR", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        env.pop(name, None)
    if floor is not None:
        env["STRATA_ISA_FLOOR"] = floor
    if numba_target is not None:
        env["NUMBA_CPU_NAME"], env["NUMBA_CPU_FEATURES"] = numba_target
    return subprocess.Popen([sys.executable, "-c", probe], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def probe_output(proc):
    """The probe's printed words, once it has exited 0."""
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    return tuple(stdout.split())


def run_probe(floor, cache_dir):
    return probe_output(start_probe(PROBE, cache_dir, floor=floor))


DIRECT_TARGET_PROBE = PROBE_HEAD + ATTENTION + "\nfrom cpu_kernels import q4_k\n" + (
    "raw = q4_k.random_blocks(rng, (9, 512), 0.05); w = np.empty((9, 512), np.float32); q4_k.dequantize(raw, w)\n"
    "x = rng.standard_normal(512).astype(np.float32); out = np.empty(9, np.float32); q4_k.matvec(raw, x, out)\n"
    "assert np.allclose(out, w @ x, rtol=1e-3, atol=1e-3)\n")


@pytest.fixture(scope="module")
def default_probes(tmp_path_factory):
    """The default tests' two probe processes, started together: each compiles cold (~25 s), one core each."""
    procs = {"avx2": start_probe(PROBE, tmp_path_factory.mktemp("avx2"), floor="avx2"),
             "direct": start_probe(DIRECT_TARGET_PROBE, tmp_path_factory.mktemp("direct"),
                                   numba_target=("sandybridge", ""))}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow  # a cold compile of its own (~25 s); test_avx2_floor_keeps_fma checks the floor by default
def test_avx_floor_compiles_without_fma(tmp_path):
    """With STRATA_ISA_FLOOR=avx the kernels compile for Sandy Bridge: correct results, no FMA instructions."""
    assert run_probe("avx", tmp_path / "avx") == ("sandybridge", "''", "no-fma")


def test_avx2_floor_keeps_fma(default_probes):
    """The probe does see FMA where the floor allows it (so the test above can fail)."""
    assert probe_output(default_probes["avx2"]) == ("haswell", "''", "fma")


def test_threads_setting():
    before = numba.get_num_threads()
    try:
        assert set_threads(1) == 1 and numba.get_num_threads() == 1
        assert set_threads() == 1  # None: the count as it is
        with pytest.raises(ValueError, match="threads must be >= 1"):
            set_threads(0)
    finally:
        numba.set_num_threads(before)


def test_threads_that_start_later_take_the_chosen_count():
    """Numba keeps the count per thread; the engine's threads call use_chosen_threads (or run as the
    host-experts pool's initializer) so that --threads holds for them too."""
    from concurrent.futures import ThreadPoolExecutor

    from cpu_kernels import target
    from hybrid.backends import CpuBackend
    from hybrid.moe import ExpertSplit

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads to tell the chosen count from the default")
    before = numba.get_num_threads()
    try:
        set_threads(1)
        with ThreadPoolExecutor(1) as plain:
            assert plain.submit(numba.get_num_threads).result() == numba.config.NUMBA_NUM_THREADS  # Numba's default
        split = ExpertSplit(host=CpuBackend(), resident=np.zeros((1, 4), dtype=bool))
        assert split.host_side._pool.submit(numba.get_num_threads).result() == 1
    finally:
        target._chosen_threads = None
        numba.set_num_threads(before)


def test_numba_target_set_directly_picks_code_it_can_compile(default_probes):
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES set without STRATA_ISA_FLOOR: kernels follow Numba's target,
    not the host (AVX-512 code for a Sandy Bridge target crashes LLVM)."""
    assert probe_output(default_probes["direct"]) == ("sandybridge", "''", "no-fma")
