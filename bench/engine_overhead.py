"""The serving engine's own cost a step, the model's work removed: its scheduling, sampling, detokenizing and
streaming, measured through bench/gpu_model.py's `concurrent_rates` (greedy requests queued at once, the window
where every user decodes) with Model.forward replaced by one that only advances the KV and returns fixed logits.

    python bench/engine_overhead.py [--users 1,4] [--tokens 400] [--runs 5] [--model FILE]
    python bench/engine_overhead.py --model /tmp/q8l.gguf --device gpu --with-model --profile [--users 4]

Prints the microseconds a step at each user count (medians of --runs); the built-in demo model by default.
--with-model keeps the model's forward (the whole serving step); --profile adds a cProfile of the engine thread's
steps (its own time and the forward's parts, by function) at the last user count.
"""
import cProfile
import pstats
import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
from bench.gpu_model import concurrent_rates  # noqa: E402
from hybrid import LLM  # noqa: E402
from hybrid.demo import demo_model_path  # noqa: E402
from hybrid.engine import Engine  # noqa: E402


def without_model(llm, max_rows=64):
    """llm.model.forward replaced: each chunk's KV reserved and committed, fixed random logits [rows, V] returned."""
    rows = np.random.default_rng(0).standard_normal((max_rows, llm.config.vocab_size)).astype(np.float32)

    def forward(batch):
        for chunk in batch.chunks:
            chunk.kv.reserve(chunk.start + len(chunk.token_ids))
            chunk.kv.commit(chunk.start + len(chunk.token_ids))
        return rows[:len(batch.logit_rows)]

    llm.model.forward = forward
    return llm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: the built-in demo model)")
    p.add_argument("--users", default="1,4")
    p.add_argument("--tokens", type=int, default=400, help="tokens each user generates a run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--with-model", action="store_true", help="keep the model's forward: the whole serving step")
    p.add_argument("--profile", action="store_true", help="a cProfile of the engine thread at the last user count")
    args = p.parse_args(argv)
    counts = [int(u) for u in args.users.split(",")]
    llm = LLM(args.model or demo_model_path(), device=args.device, kv_sequences=max(counts))
    if not args.with_model:
        llm = without_model(llm)
    concurrent_rates(llm, max(counts), 32)  # warm-up
    print("| users | engine us a step | tok/s (all users) |\n|---|---|---|")
    for users in counts:
        # all decoding: every user's tokens while all decode (several users), or the one user's own rate
        rates = [concurrent_rates(llm, users, args.tokens)[2 if users > 1 else 0] for _ in range(args.runs)]
        rate = statistics.median(rates)
        print(f"| {users} | {users / rate * 1e6:.1f} | {rate:.0f} |")
    if args.profile:
        profile, step = cProfile.Profile(), Engine.step

        def profiled_step(engine):
            profile.enable()
            try:
                return step(engine)
            finally:
                profile.disable()

        Engine.step = profiled_step
        try:
            concurrent_rates(llm, counts[-1], args.tokens)
        finally:
            Engine.step = step
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
