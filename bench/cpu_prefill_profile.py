"""Where a CPU prompt read's time goes: wall time per backend method (exclusive), at a thread count.

Loads a GGUF on the CPU backend with `--threads` Numba threads and reads a `--tokens`-token prompt (in the
engine's prompt chunks) a few times: untimed, then with every backend method and the KV write timed as in
bench/cpu_decode_profile.py (a method's time excludes the backend methods it calls). What scales with threads
(the matmuls) and what does not (the Python between ops, serial parts) shows as the thread count grows.

    python bench/cpu_prefill_profile.py --model /tmp/bm-iq4xs.gguf --threads 16 --tokens 256

Prints a markdown table.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cpu_decode_profile import OpTimer, instrument  # noqa: E402


def read_prompt(model, ids, chunk):
    """Seconds to read `ids` into a new sequence, `chunk` tokens a forward pass."""
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(len(ids) + 8)
    start = time.perf_counter()
    for lo in range(0, len(ids), chunk):
        part = ids[lo:lo + chunk]
        model.forward(Batch([SeqChunk(kv, lo, part, "last" if lo + len(part) == len(ids) else "none")]))
    return time.perf_counter() - start


def weight_category(weight, x, exact=False):
    """linear NAME for weight blk.N.NAME.weight (output for the head)."""
    parts = weight.name.split(".")
    return f"linear {parts[-2] if len(parts) > 2 else parts[0]}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--by-weight", action="store_true",
                   help="split every linear by its weight's name (blk.N.NAME.weight -> linear NAME), not only "
                        "cpu_decode_profile's LINEAR_NAMES")
    args = p.parse_args(argv)
    from hybrid.llm import LLM, PREFILL_CHUNK

    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=args.tokens + 64)
    model, vocab = llm.model, llm.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, size=args.tokens) for _ in range(args.runs + 1)]
    read_prompt(model, prompts[0], PREFILL_CHUNK)  # compile every kernel
    plain = [read_prompt(model, ids, PREFILL_CHUNK) for ids in prompts[1:]]
    timer = OpTimer()
    instrument(model, timer)
    if args.by_weight:
        be = model.backend
        be.linear = timer.wrap(weight_category, type(be).linear.__get__(be))
    timed = [read_prompt(model, ids, PREFILL_CHUNK) for ids in prompts[1:]]
    total = sum(timed)
    print(f"## {Path(args.model).name}, {args.threads} thread(s), a {args.tokens}-token prompt\n")
    print(f"untimed: {args.tokens / np.median(plain):.1f} tok/s ({np.median(plain) * 1e3:.1f} ms, median of "
          f"{len(plain)}); timed op by op: {np.median(timed) * 1e3:.1f} ms\n")
    print("| category | ms a prompt | share | calls a prompt |\n|---|---|---|---|")
    rest = total - sum(timer.seconds.values())
    rows = sorted(timer.seconds.items(), key=lambda kv: -kv[1]) + [("rest (model.forward's Python)", rest)]
    for name, seconds in rows:
        calls = timer.calls.get(name, 0) / len(timed)
        print(f"| {name} | {seconds / len(timed) * 1e3:.2f} | {seconds / total:.1%} | {calls:.0f} |")


if __name__ == "__main__":
    main()
