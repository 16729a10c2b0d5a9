"""A hybrid decode token's host part, one compiled call against the op-by-op path, on the CPU alone.

The host part of ExpertSplit's decode (the token's pairs whose experts the device does not hold) as
CpuBackend.host_decode_experts (pair selection, grouping and the expert kernels in one call) and as the
NumPy bookkeeping + CpuBackend.grouped_experts it replaced. Each call takes the next of --cases random
tokens (x, top-k ids, weights) at the next layer, against a fixed random resident mask; the paths (also the
compiled call with its items claimed by the threads: CpuBackend.claimed_host_experts) alternate, --rounds rounds each, and the table gives each path's median time a call (the first round
left out: compilation and first touches).

    python bench/host_experts.py --model /tmp/bm-q4km.gguf --threads 1,2 [--resident-share 0.5] [--rounds 6]
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from hybrid.llm import LLM  # noqa: E402
from hybrid.moe import PairGroups  # noqa: E402


def op_by_op(backend, layer, x, ids, weights, resident):
    """ExpertSplit's host part before the compiled call: NumPy bookkeeping, then grouped_experts."""
    experts = ids[0].astype(np.int64)  # [K]
    slots = np.flatnonzero(~resident[experts])
    order = slots[np.argsort(experts[slots], kind="stable")]
    groups = PairGroups(order, experts[order], np.arange(len(order) + 1))
    return backend.grouped_experts(x, weights, groups, layer.gate_exps, layer.up_exps, layer.down_exps)


def compiled(backend, layer, x, ids, weights, resident):
    backend.claimed_host_experts = False
    return backend.host_decode_experts(layer, x, ids, weights, resident)[0]


def claimed(backend, layer, x, ids, weights, resident):
    """The compiled call with its gate+up and down items claimed by the threads (CpuBackend.claimed_host_experts)."""
    backend.claimed_host_experts = True
    return backend.host_decode_experts(layer, x, ids, weights, resident)[0]


def seconds_a_call(threads, model_path, share, num_cases, rounds):
    """{path name: median seconds a call} at `threads` threads."""
    llm = LLM(model_path, device="cpu", threads=threads, max_context=64)
    backend, layers, c = llm.model.backend, llm.model.layers, llm.config
    rng = np.random.default_rng(0)
    resident = rng.random((len(layers), c.num_experts)) < share  # [L, E]
    k = c.num_experts_per_tok
    cases = [(rng.standard_normal((1, c.hidden_size)).astype(np.float32),
              rng.choice(c.num_experts, k, replace=False)[None].astype(np.int32),
              rng.random((1, k)).astype(np.float32)) for _ in range(num_cases)]
    paths = [("one compiled call", compiled), ("claimed items", claimed), ("op by op", op_by_op)]
    times = {name: [] for name, _ in paths}
    for r in range(rounds):
        for name, fn in paths if r % 2 == 0 else paths[::-1]:
            start = time.perf_counter()
            for i, (x, ids, weights) in enumerate(cases):
                layer = layers[i % len(layers)]
                fn(backend, layer, x, ids, weights, resident[layer.index])
            times[name].append((time.perf_counter() - start) / num_cases)
    return {name: float(np.median(t[1:])) for name, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--resident-share", type=float, default=0.5, help="share of each layer's experts on the device")
    p.add_argument("--cases", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    print(f"| threads | one compiled call (us) | claimed items (us) | op by op (us) | model `{Path(args.model).name}`, "
          f"{args.resident_share:.0%} resident |\n|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        result = seconds_a_call(threads, args.model, args.resident_share, args.cases, args.rounds)
        print(f"| {threads} | {result['one compiled call'] * 1e6:.1f} | {result['claimed items'] * 1e6:.1f} | "
              f"{result['op by op'] * 1e6:.1f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
