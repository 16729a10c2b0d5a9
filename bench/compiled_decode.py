"""Decode tok/s of the CPU backend with decode layers as one compiled call each, or op by op.

One process measures one setting (run the two alternately, in fresh processes, to compare on a noisy
host): after a 16-token warm-up, the best of 3 runs of 64 one-token steps after an 8-token prompt.

    python bench/compiled_decode.py --model /tmp/bm-q4km.gguf --threads 16 --compiled 1
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from hybrid.batch import Batch, SeqChunk  # noqa: E402
from hybrid.llm import LLM  # noqa: E402


def decode_seconds(model, rng, n):
    """Seconds of n one-token steps of a fresh sequence after an 8-token prompt (random token ids)."""
    kv = model.new_sequence(n + 16)
    model.forward(Batch([SeqChunk(kv, 0, rng.integers(1, 1000, 8).astype(np.int64))]))
    start = time.perf_counter()
    for token in rng.integers(1, 1000, n):
        model.forward(Batch([SeqChunk(kv, kv.length, np.array([token], np.int64))]))
    return time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compiled", type=int, choices=(0, 1), default=1)
    args = p.parse_args(argv)
    model = LLM(args.model, device="cpu", threads=args.threads, max_context=512).model
    model.compiled_decode = bool(args.compiled)
    rng = np.random.default_rng(0)
    decode_seconds(model, rng, 16)
    best = max(64 / decode_seconds(model, rng, 64) for _ in range(3))
    print(f"{'compiled layers' if model.compiled_decode else 'op by op'}, {args.threads or 'all'} threads: "
          f"decode {best:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
