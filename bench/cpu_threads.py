"""Strata's CPU decode and prompt read against the thread count, next to DRAM read bandwidth.

One process loads the GGUF once and, for each thread count (Numba's pool is resized in
place), reads a `--prompt-tokens` prompt in one batch (prompt read tok/s), decodes
`--decode-tokens` tokens one at a time (decode tok/s), and times a parallel float32 sum
over 1 GiB (DRAM read GB/s). Effective bandwidth = weight bytes one decode token reads
(dense tensors + top-k experts) x decode tok/s. For many-core hosts where llama.cpp is not
at hand (bench/vs_llamacpp.py compares the two where it is).

    python bench/make_model.py --type Q4_K_M -o /tmp/bm-q4km.gguf
    python bench/cpu_threads.py --model /tmp/bm-q4km.gguf --threads 1,2,4,8,16

Writes bench/results/cpu_threads.md.
"""
import argparse
import logging
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

# bench/ holds a cpu_kernels.py: drop the folder from the path so `cpu_kernels` is the package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.vs_llamacpp import SHORT_PROMPT, WARM_PROMPT, decode_bytes_per_token, dram_gbps, token_ids  # noqa: E402

log = logging.getLogger("bench.cpu_threads")
RESULTS = Path(__file__).parent / "results" / "cpu_threads.md"


def measure(model, thread_counts, prompt_tokens, decode_tokens):
    """Rows of (threads, prompt tok/s, decode tok/s, DRAM GB/s)."""
    import numba

    from hybrid.batch import Batch, SeqChunk
    from hybrid.llm import LLM

    max_context = prompt_tokens + decode_tokens + 2 * WARM_PROMPT
    llm = LLM(model, device="cpu", threads=max(thread_counts), max_context=max_context)
    vocab = llm.config.vocab_size

    def read(kv, ids):
        return llm.model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(ids, dtype=np.int64), "last")]))

    start = time.perf_counter()
    warm = llm.model.new_sequence(SHORT_PROMPT + 1 + WARM_PROMPT)  # compile or load every kernel
    for ids in (token_ids(SHORT_PROMPT, vocab, 1), token_ids(1, vocab, 1), token_ids(WARM_PROMPT, vocab, 1)):
        read(warm, ids)
    log.info("warm-up (compile or cache load): %.1f s", time.perf_counter() - start)
    rows = []
    for threads in thread_counts:
        numba.set_num_threads(threads)
        kv = llm.model.new_sequence(prompt_tokens + 1)
        start = time.perf_counter()
        read(kv, token_ids(prompt_tokens, vocab, 2))
        prompt_tps = prompt_tokens / (time.perf_counter() - start)
        kv = llm.model.new_sequence(SHORT_PROMPT + decode_tokens + 1)
        read(kv, token_ids(SHORT_PROMPT, vocab, 3))
        start = time.perf_counter()
        for tok in token_ids(decode_tokens, vocab, 4):
            read(kv, [tok])
        decode_tps = decode_tokens / (time.perf_counter() - start)
        dram = dram_gbps(threads)
        log.info("%d thread(s): prompt %.1f tok/s, decode %.1f tok/s, DRAM %.1f GB/s", threads, prompt_tps, decode_tps,
                 dram)
        rows.append((threads, prompt_tps, decode_tps, dram))
    return rows


def markdown(rows, model, touched, args):
    lines = [
        "# Strata CPU decode and prompt read by thread count",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs; model {os.path.basename(model)} ({touched / 1e6:.0f} MB of "
        f"weights read per decode token). One process, one run per thread count: prompt read = {args.prompt_tokens} "
        f"tokens in one batch, decode = {args.decode_tokens} tokens one at a time. GB/s = MB/token x decode tok/s; "
        "DRAM = parallel float32 sum over 1 GiB, same thread count.",
        "",
        "| threads | prompt tok/s | decode tok/s | decode GB/s | DRAM GB/s | % of DRAM |",
        "|---|---|---|---|---|---|",
    ]
    for threads, prompt_tps, decode_tps, dram in rows:
        gbps = touched * decode_tps / 1e9
        lines.append(f"| {threads} | {prompt_tps:.1f} | {decode_tps:.1f} | {gbps:.1f} | {dram:.1f} | "
                     f"{100 * gbps / dram:.0f}% |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", default="1,2,4,8,16", help="comma-separated thread counts")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--output", default=str(RESULTS))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    thread_counts = [int(t) for t in args.threads.split(",")]
    touched = decode_bytes_per_token(args.model)
    table = markdown(measure(args.model, thread_counts, args.prompt_tokens, args.decode_tokens), args.model, touched,
                     args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
