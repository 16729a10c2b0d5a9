"""A pytest plugin that says where a cold run's time goes: each test's wall and CPU time, and every Numba compile
(a cache miss: what the disk cache or an earlier test did not provide) with the test that caused it.

    NUMBA_CACHE_DIR=$(mktemp -d) python -m pytest -q -m "not gpu and not slow" -p tests.compile_log
    python -m tests.compile_log compile_log.jsonl      # the costliest modules, tests and doubled instances

One JSON line a record in $STRATA_COMPILE_LOG (default compile_log.jsonl): {"kind": "test", "test", "wall",
"cpu"} after each test (CPU of this process only: a test's subprocesses are in its wall time), {"kind": "compile",
"test", "depth" (0: called from Python, > 0: compiled inside another compile), "fn", "args", "s"} after each
compile. Two instances of one function whose arguments differ only in an array's read-only flag or an omitted
default are the usual sign of a test that could share the engine's instance.
"""
import collections
import json
import os
import sys
import time

import pytest

_state = {"test": "<collect>", "starts": [], "out": None}


def _write(record):
    _state["out"].write(json.dumps(record) + "\n")
    _state["out"].flush()


def _listener():
    from numba.core import event

    class CompileListener(event.Listener):
        def on_start(self, ev):
            _state["starts"].append(time.perf_counter())

        def on_end(self, ev):
            began = _state["starts"].pop()
            func = ev.data["dispatcher"].py_func
            _write(dict(kind="compile", test=_state["test"], depth=len(_state["starts"]),
                        fn=f"{func.__module__}.{func.__qualname__}", args=str(ev.data["args"])[:400],
                        s=round(time.perf_counter() - began, 3)))

    return CompileListener()


def pytest_configure(config):
    from numba.core import event

    _state["out"] = open(os.environ.get("STRATA_COMPILE_LOG", "compile_log.jsonl"), "w")
    event.register("numba:compile", _listener())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _state["test"] = item.nodeid
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    _write(dict(kind="test", test=item.nodeid, wall=round(time.perf_counter() - wall, 3),
                cpu=round(time.process_time() - cpu, 3)))
    _state["test"] = "<between tests>"


def summary(path, top=40):
    """The log at `path` as text: CPU by module, the costliest tests, functions compiled more than once."""
    records = [json.loads(line) for line in open(path)]
    tests = [r for r in records if r["kind"] == "test"]
    wall, cpu = sum(r["wall"] for r in tests), sum(r["cpu"] for r in tests)
    lines = [f"{len(tests)} tests: wall {wall:.0f} s, cpu {cpu:.0f} s"]
    by_module = collections.Counter()
    for r in tests:
        by_module[r["test"].split("::")[0]] += r["cpu"]
    lines += [f"{cpu:8.1f} s cpu  {module}" for module, cpu in by_module.most_common(top)]
    lines += [f"{r['cpu']:8.1f} s cpu {r['wall']:8.1f} s wall  {r['test']}"
              for r in sorted(tests, key=lambda r: -r["cpu"])[:top]]
    instances = collections.defaultdict(list)
    for r in records:
        if r["kind"] == "compile" and r["depth"] == 0:
            instances[r["fn"]].append(r)
    for fn, compiles in sorted(instances.items(), key=lambda kv: -sum(r["s"] for r in kv[1])):
        if len(compiles) > 1:
            lines.append(f"{sum(r['s'] for r in compiles):8.1f} s  {len(compiles)} instances of {fn}: "
                         + ", ".join(r["test"].split("::")[-1] for r in compiles))
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1]))
