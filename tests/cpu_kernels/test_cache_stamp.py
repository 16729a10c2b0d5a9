"""cpu_kernels.cache_stamp: a cached kernel whose own file is unchanged compiles afresh when a module it imports
changed (Numba alone would load its old machine code), and loads from the cache when nothing changed."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = textwrap.dedent("""
    import sys
    from cpu_kernels.cache_stamp import install
    install(("stamp_pkg",))
    from stamp_pkg.caller import twice
    print(twice(5.0), twice.stats.cache_hits.get(twice.signatures[0], 0) if twice.signatures else 0)
""")


def _run(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    value, hits = done.stdout.split()
    return float(value), int(hits)


def test_a_cached_kernel_follows_an_edit_of_a_module_it_imports(tmp_path):
    package = tmp_path / "stamp_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "caller.py").write_text(textwrap.dedent("""
        from numba import njit
        from .callee import scale

        @njit(cache=True)
        def twice(x):
            return 2.0 * scale(x)
    """))
    callee = package / "callee.py"
    callee.write_text("from numba import njit\n\n\n@njit(cache=True)\ndef scale(x):\n    return x + 1.0\n")
    assert _run(tmp_path) == (12.0, 0)  # compiled
    assert _run(tmp_path) == (12.0, 1)  # nothing changed: from the cache
    callee.write_text("from numba import njit\n\n\n@njit(cache=True)\ndef scale(x):\n    return x + 3.0\n")
    assert _run(tmp_path)[0] == 16.0  # the callee's edit reaches the caller, whose file did not change
    assert _run(tmp_path) == (16.0, 1)


def test_module_digest_follows_relative_and_absolute_imports():
    from cpu_kernels.cache_stamp import module_digest

    assert module_digest("cpu_kernels.q4_k") != module_digest("cpu_kernels.q8_0")
    assert len(module_digest("hybrid.backends.cpu_decode")) == 40
