"""Where a GPU prompt read's time goes: each kernel's GPU time, summed by kernel over a few prompt chunks, beside the
chunk's wall time.

Every expert is resident, so no host expert runs: whatever the wall time holds beyond the kernels' sum is the host's
own work between launches (routing read back, pair grouping, Python). Each launch is timed by events around it, so
a kernel's time does not include the gaps the host leaves before it.

    python bench/gpu_prefill_profile.py --model /tmp/q8l.gguf --tokens 512 [--runs 3] [--simt-attention] [--output FILE]

--simt-attention: the prompt's attention by kv.cu's paged_attention, the kernel before paged_prefill (tensor cores).
"""
import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.gpu_decode_profile import kernel_table, launch_times, timed_launches  # noqa: E402


def read_prompt(model, tokens, seed):
    """Seconds to read one `tokens`-token prompt in one chunk into a new sequence (the last position's logits)."""
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(tokens + 8)
    ids = np.random.default_rng(seed).integers(10, 1000, tokens)
    t0 = time.perf_counter()
    model.forward(Batch([SeqChunk(kv, 0, ids, "last")]))
    model.backend.stream.synchronize()
    seconds = time.perf_counter() - t0
    kv.truncate(0)  # its blocks back to the pool for the next run
    return seconds


def profile(model, tokens, runs):
    """({kernel: [GPU seconds of each launch]}, launches a chunk, [wall seconds of each timed chunk])."""
    with timed_launches(model.backend) as launched:
        walls = [read_prompt(model, tokens, 100 + run) for run in range(runs)]
    return launch_times(model.backend, launched), len(launched) / runs, walls


def markdown(args, times, per_chunk, walls, plain, gpu_name):
    total = sum(sum(v) for v in times.values()) / args.runs
    attention = " (SIMT attention)" if args.simt_attention else ""
    lines = [f"Model `{Path(args.model).name}`{attention} on {gpu_name}, every expert resident; a {args.tokens}-token "
             f"prompt in one chunk: {np.median(plain) * 1e3:.1f} ms wall ({args.tokens / np.median(plain):.0f} tok/s, "
             f"median of {len(plain)}); with a timing event around each launch {np.median(walls) * 1e3:.1f} ms. "
             f"{per_chunk:.0f} launches a chunk, their GPU time {total * 1e3:.2f} ms: the rest of the wall time is the "
             "host's.", "",
             *kernel_table(times, args.runs, "a chunk", "share of GPU time")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--simt-attention", action="store_true")
    p.add_argument("--output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from hybrid import LLM

    llm = LLM(args.model, device="gpu", threads=args.threads, max_context=args.tokens + 64, kv_sequences=1)
    if args.simt_attention:
        llm.model.backend.kernels.prefill_mma = False
    read_prompt(llm.model, args.tokens, 0)  # warm-up: compiles and sizes the work buffers
    plain = [read_prompt(llm.model, args.tokens, 1 + run) for run in range(args.runs)]
    times, per_chunk, walls = profile(llm.model, args.tokens, args.runs)
    text = markdown(args, times, per_chunk, walls, plain, llm.model.backend.rt.device_name)
    llm.close()
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
