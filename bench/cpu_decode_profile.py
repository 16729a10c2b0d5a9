"""Where one CPU decode step's time goes: wall time per op category, and cProfile's view of the Python side.

Loads a GGUF on the CPU backend with `--threads` Numba threads, reads a short prompt, then decodes
`--steps` tokens one at a time: untimed with each layer as one compiled call (the default path) and
op by op (tok/s of each), then op by op with every backend method and the KV write timed (exclusive
time: a method's time excludes the backend methods it calls; the linear layers are split by weight),
and op by op under cProfile (the top functions by own time). The compiled layer runs the same kernels,
so the op-by-op breakdown shows where its time goes, less the Python between the ops.

    python bench/cpu_decode_profile.py --model /tmp/bm-q4km.gguf --threads 1 --steps 64

Prints markdown tables.
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT = 8
LINEAR_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "output")


class OpTimer:
    """Exclusive wall time and call counts per category, from wrappers around the timed callables."""

    def __init__(self):
        self.seconds, self.calls, self._stack = defaultdict(float), defaultdict(int), []

    def wrap(self, category, fn):
        def timed(*args, **kwargs):
            name = category(*args) if callable(category) else category
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()
                self.seconds[name] += elapsed - children
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += elapsed
        return timed


def linear_category(weight, x):
    for name in LINEAR_NAMES:
        if weight.name.endswith(f"{name}.weight"):
            return f"linear {name}"
    return "linear other"


def instrument(model, timer):
    """Time every public method of the model's backend and SequenceKV.write."""
    from hybrid.kv_cache import SequenceKV

    be = model.backend
    for attr in dir(type(be)):
        if attr.startswith("_") or not callable(getattr(be, attr)):
            continue
        category = linear_category if attr == "linear" else attr
        setattr(be, attr, timer.wrap(category, getattr(be, attr)))
    SequenceKV.write = timer.wrap("kv write", SequenceKV.write)


def decode(model, kv, ids):
    from hybrid.batch import Batch, SeqChunk

    start = time.perf_counter()
    for tok in ids:
        model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([tok], dtype=np.int64), "last")]))
    return time.perf_counter() - start


def transparent_huge_pages():
    """The kernel's THP mode and this process's anonymous memory in huge pages (the weight copies want them)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError as e:
        return f"unknown ({e})"
    fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith(" kB")}
    return (f"mode `{mode}`; {fields.get('AnonHugePages', 0) / 1024:.0f} MiB of "
            f"{fields.get('Anonymous', 0) / 1024:.0f} MiB anonymous memory in huge pages")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--top", type=int, default=25, help="cProfile rows to print")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hybrid.llm import LLM

    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=4 * args.steps + 64)
    model, vocab = llm.model, llm.config.vocab_size
    rng = np.random.default_rng(0)

    def fresh():
        kv = model.new_sequence(args.steps + SHORT_PROMPT + 8)
        decode(model, kv, rng.integers(1, vocab, size=SHORT_PROMPT))
        return kv

    decode(model, fresh(), rng.integers(1, vocab, size=args.steps))  # compile / load every kernel (twins by size too)
    compiled_s = decode(model, fresh(), rng.integers(1, vocab, size=args.steps))
    model.compiled_decode = False  # from here on, op by op
    decode(model, fresh(), rng.integers(1, vocab, size=args.steps))
    plain_s = decode(model, fresh(), rng.integers(1, vocab, size=args.steps))

    profiler = cProfile.Profile()
    kv = fresh()
    profiler.enable()
    decode(model, kv, rng.integers(1, vocab, size=args.steps))
    profiler.disable()

    timer = OpTimer()
    instrument(model, timer)
    kv = fresh()
    timer.seconds.clear()
    timer.calls.clear()
    timed_s = decode(model, kv, rng.integers(1, vocab, size=args.steps))

    per_step_ms = 1e3 / args.steps
    print(f"## {Path(args.model).name}, {args.threads} thread(s), {args.steps} decode steps\n")
    print(f"untimed, compiled layers: {args.steps / compiled_s:.1f} tok/s ({compiled_s * per_step_ms:.2f} ms/step); "
          f"op by op: {args.steps / plain_s:.1f} tok/s ({plain_s * per_step_ms:.2f} ms/step); "
          f"op by op timed: {timed_s * per_step_ms:.2f} ms/step\n")
    from cpu_kernels.prefetch import prefetch_rows

    print(f"transparent huge pages: {transparent_huge_pages()}\n")
    print(f"decode prefetch distance: {prefetch_rows()} rows ahead (chosen at load; STRATA_PREFETCH_ROWS fixes it)\n")
    print("| category | ms/step | share | calls/step |\n|---|---|---|---|")
    rest = timed_s - sum(timer.seconds.values())
    rows = sorted(timer.seconds.items(), key=lambda kv: -kv[1]) + [("rest (model.forward's Python)", rest)]
    for name, seconds in rows:
        calls = timer.calls.get(name, 0) / args.steps
        print(f"| {name} | {seconds * per_step_ms:.3f} | {seconds / timed_s:.1%} | {calls:.0f} |")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
    print("\ncProfile, sorted by own time (compiled kernels count in their Python caller's own time):\n")
    print("```\n" + out.getvalue().strip() + "\n```")


if __name__ == "__main__":
    main()
