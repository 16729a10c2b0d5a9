"""A prompt read with and without the several-token expert decode items (tiles.PROMPT_ITEMS), alternating in one
process: rounds of each, so both see the same load. Without them a prompt's few-token expert groups run as
one-token dots (the tree before cpu_kernels/tokens_dot.py).

    python bench/prompt_items_ab.py --model /tmp/compiled/bench-qwen3next-80b.gguf --threads 1 --tokens 256

Prints each round's wall and process CPU time (on a busy machine the CPU time is the steadier), and the medians
and minima.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cpu_prefill_profile import read_prompt  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    import hybrid.backends.cpu as cpu_backend
    from cpu_kernels.tiles import PROMPT_ITEMS
    from hybrid.llm import LLM, PREFILL_CHUNK

    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=args.tokens + 64)
    model, vocab = llm.model, llm.config.vocab_size
    rng = np.random.default_rng(0)
    times = {"one-token dots": [], "several-token items": []}
    cpu = {name: [] for name in times}
    for flag in (0, PROMPT_ITEMS):  # compile both
        cpu_backend.PROMPT_ITEMS = flag
        read_prompt(model, rng.integers(1, vocab, size=args.tokens), PREFILL_CHUNK)
    for r in range(args.rounds):
        ids = rng.integers(1, vocab, size=args.tokens)
        for name, flag in (("one-token dots", 0), ("several-token items", PROMPT_ITEMS))[::1 if r % 2 else -1]:
            cpu_backend.PROMPT_ITEMS = flag
            start, start_cpu = time.perf_counter(), time.process_time()
            read_prompt(model, ids, PREFILL_CHUNK)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            print(f"round {r} {name}: {times[name][-1] * 1e3:.1f} ms, CPU {cpu[name][-1] * 1e3:.1f} ms", flush=True)
    cpu_backend.PROMPT_ITEMS = PROMPT_ITEMS
    for name, t in times.items():
        print(f"{name}: median {np.median(t) * 1e3:.1f} ms ({args.tokens / np.median(t):.1f} tok/s), "
              f"min {min(t) * 1e3:.1f} ms ({args.tokens / min(t):.1f} tok/s); CPU median "
              f"{np.median(cpu[name]) * 1e3:.1f} ms, min {min(cpu[name]) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
