"""How one sequence's decode step time changes with the context it holds: after a prompt of each length, every
one-token step is timed (forward and its logits on the host), so that a cost paid once a request (the first
step: a capture, a table upload) shows apart from a cost paid every step (attention over more keys).

    python bench/decode_context.py --model /tmp/bench-8g.gguf [--kv f16] [--max-context 32768]
        [--contexts 16,256,1500,4096] [--steps 32] [--repeats 2] [--output FILE]
"""
import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
from bench.gpu_model import prompt  # noqa: E402
from hybrid import LLM  # noqa: E402
from hybrid.batch import Batch, SeqChunk  # noqa: E402

log = logging.getLogger("bench.decode_context")


def step_times(llm, context, steps, seed):
    """(seconds of each of `steps` one-token steps after a `context`-token prompt, the runner's path)."""
    kv = llm.model.new_sequence(llm.max_context)
    logits = llm._prefill(prompt(llm, context, seed), kv)[-1]
    token, times = int(np.argmax(logits)), []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = llm.model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([token], dtype=np.int64))]))[0]
        token = int(np.argmax(logits))
        times.append(time.perf_counter() - t0)
    kv.truncate(0)  # its blocks back to the pool
    return times, getattr(llm.model.runner, "last_path", "-")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="gpu")
    p.add_argument("--kv", default="f16", help="KV cache type")
    p.add_argument("--max-context", type=int, default=32768)
    p.add_argument("--contexts", default="16,256,1500,4096")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="requests per context (each a new sequence)")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    llm = LLM(args.model, device=args.device, kv=args.kv, max_context=args.max_context, kv_sequences=1)
    llm.warm_up()
    lines = ["| context | request | first step ms | median step ms (2nd on) | slowest later step ms | path |",
             "|---|---|---|---|---|---|"]
    try:
        for context in (int(c) for c in args.contexts.split(",")):
            for repeat in range(args.repeats):
                times, path = step_times(llm, context, args.steps, seed=1000 * context + repeat)
                ms = [1e3 * t for t in times]
                lines.append(f"| {context} | {repeat + 1} | {ms[0]:.2f} | {statistics.median(ms[1:]):.2f} | "
                             f"{max(ms[1:]):.2f} | {path} |")
                log.info("%s", lines[-1])
    finally:
        llm.close()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
