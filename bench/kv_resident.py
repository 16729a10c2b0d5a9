"""The KV resident window on the GPU: decode and prompt-chunk speed of a long conversation whose KV
lives all in VRAM, or only its newest tokens (--kv-resident) with the rest in pinned RAM, attended by
the host (merged by log-sum-exp) or copied to the GPU layer by layer.

Every expert is resident, so the step is the dense part and attention; the KV of the first N positions
is filled with random rows (`load`), which costs what real rows cost to attend. Make the model with
bench/make_model.py (e.g. `--type Q8_0 --layers 16 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128`,
the attention shape of Qwen3-30B-A3B).

    python bench/kv_resident.py --model /tmp/kvr.gguf [--contexts 8192,32768] [--resident 2048]
        [--kv f32,f16,int8] [--decode-tokens 16] [--chunk 512] [--runs 3]

Writes bench/results/kv_resident.md.
"""
import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from hybrid import LLM  # noqa: E402
from hybrid.batch import Batch, SeqChunk  # noqa: E402
from hybrid.kv_store import bytes_per_token  # noqa: E402

log = logging.getLogger("bench.kv_resident")
RESULTS = Path(__file__).parent / "results" / "kv_resident.md"


def filled_sequence(llm, num_tokens, seed=0):
    """A sequence whose first num_tokens positions hold random K/V rows (unit variance, like normed keys)."""
    c = llm.config
    rng = np.random.default_rng(seed)
    kv = llm.model.new_sequence(llm.max_context)
    shape = (c.num_layers, num_tokens, c.num_kv_heads, c.head_dim)
    kv.load(rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
    return kv


def step_seconds(llm, kv, token_ids):
    t0 = time.perf_counter()
    llm.model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(token_ids, dtype=np.int64), "last")]))
    return time.perf_counter() - t0


def measure(llm, context, decode_tokens, chunk, runs):
    """(median decode seconds per token, median seconds of one prompt chunk) at `context` tokens."""
    rng = np.random.default_rng(context)
    decode, chunks = [], []
    kv = filled_sequence(llm, context)
    step_seconds(llm, kv, [5])  # warm-up: kernels compiled, buffers sized
    for _ in range(runs):
        kv.truncate(context)
        decode += [step_seconds(llm, kv, [int(t)]) for t in rng.integers(10, 1000, decode_tokens)]
        kv.truncate(context)
        chunks.append(step_seconds(llm, kv, rng.integers(10, 1000, chunk).tolist()))
    return statistics.median(decode), statistics.median(chunks)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--resident", type=int, default=2048, help="--kv-resident tokens of the windowed runs")
    p.add_argument("--kv", default="f32,f16,int8", help="KV encodings to run")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    contexts = [int(x) for x in args.contexts.split(",")]
    max_context = max(contexts) + args.chunk + args.decode_tokens * args.runs + 64
    configs = [("all in VRAM", None, "cpu"), (f"newest {args.resident} in VRAM, RAM part on the CPU", args.resident,
                                               "cpu"),
               (f"newest {args.resident} in VRAM, RAM part copied to the GPU", args.resident, "gpu")]
    rows = []
    for kv in args.kv.split(","):
        for label, resident, host_attention in configs:
            llm = LLM(args.model, device="gpu", threads=args.threads, max_context=max_context, kv=kv,
                      kv_resident=resident, kv_host_attention=host_attention, expert_cache_mib=None)
            c = llm.config
            vram_tokens = llm.model.backend.vram_blocks_per_sequence() * 64
            per_token = bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv)
            for context in contexts:
                decode_s, chunk_s = measure(llm, context, args.decode_tokens, args.chunk, args.runs)
                ram = max(0, context - vram_tokens) * per_token if resident else 0
                rows.append((kv, label, context, 1 / decode_s, args.chunk / chunk_s,
                             min(context + args.chunk, vram_tokens) * per_token / 2**20, ram / 2**20))
                log.info("%s | %s | %d tokens: decode %.1f tok/s, %d-token chunk %.0f tok/s", kv, label, context,
                         1 / decode_s, args.chunk, args.chunk / chunk_s)
            del llm
    lines = ["# KV resident window (GPU)", "",
             f"`python bench/kv_resident.py --model {args.model} --contexts {args.contexts} --resident {args.resident} "
             f"--kv {args.kv} --decode-tokens {args.decode_tokens} --chunk {args.chunk} --runs {args.runs}`", "",
             f"Model: {c.num_layers} layers, {c.num_heads} query / {c.num_kv_heads} kv heads of {c.head_dim}; every "
             "expert resident; the first N positions hold random K/V. Medians over runs.", "",
             f"| KV | where the KV lives | context | decode tok/s | prompt chunk ({args.chunk}) tok/s | VRAM KV MiB | "
             "RAM KV MiB |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {kv} | {label} | {ctx} | {dec:.1f} | {pre:.0f} | {vram:.0f} | {ram:.0f} |"
              for kv, label, ctx, dec, pre, vram, ram in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
