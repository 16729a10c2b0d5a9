"""Where a GPU prompt read's time goes: each kernel's GPU time, summed by kernel over a few prompt chunks, beside the
chunk's wall time.

Every expert is resident, so no host expert runs: whatever the wall time holds beyond the kernels' sum is the host's
own work between launches (routing read back, pair grouping, Python). Each launch is timed by events around it, so
a kernel's time does not include the gaps the host leaves before it.

    python bench/gpu_prefill_profile.py --model /tmp/q8l.gguf --tokens 512 [--runs 3] [--chunks 512,4096]
        [--simt-attention] [--output FILE]

--chunks: read the prompt in chunks of each of these sizes in turn (the first gets the kernel table; default: the
whole prompt in one chunk), as the scheduler reads a prompt nobody else waits on. The GPU's idle time is the span
from the first launch's start to the last one's stop less the launches' own time: where the device waited for the
host (a routing read back, Python between launches).
--simt-attention: the prompt's attention by kv.cu's paged_attention, the kernel before paged_prefill (tensor cores).
--moe-tiles 64: the experts' work tiles of 64 pairs (gemm.cu's `gemm`) instead of MOE_GEMM_TOKENS (32, gemm32).
--host-groups: each layer's routing read back and its pairs grouped on the host (ExpertSplit's chunk path), as before
the device grouped a fully resident layer's pairs itself (prompt_groups).
"""
import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.gpu_decode_profile import kernel_table, launch_times, timed_launches  # noqa: E402


def read_prompt(model, tokens, seed, chunk=None):
    """Seconds to read one `tokens`-token prompt into a new sequence in chunks of `chunk` tokens (None: one chunk),
    the last position's logits."""
    from hybrid.batch import Batch, SeqChunk

    kv = model.new_sequence(tokens + 8)
    ids = np.random.default_rng(seed).integers(10, 1000, tokens)
    chunk = chunk or tokens
    t0 = time.perf_counter()
    for lo in range(0, tokens, chunk):
        model.forward(Batch([SeqChunk(kv, lo, ids[lo:lo + chunk], "last" if lo + chunk >= tokens else "none")]))
    model.backend.synchronize()
    seconds = time.perf_counter() - t0
    kv.truncate(0)  # its blocks back to the pool for the next run
    return seconds


def profile(model, tokens, runs, chunk):
    """({kernel: [GPU seconds of each launch]}, launches a prompt, [wall seconds of each timed prompt], GPU idle
    seconds a prompt: the span of its launches less their own time)."""
    import cupy

    idle = []
    with timed_launches(model.backend) as launched:
        walls = []
        for run in range(runs):
            first = len(launched)
            walls.append(read_prompt(model, tokens, 100 + run, chunk))
            own = sum(cupy.cuda.get_elapsed_time(start, stop) for _, start, stop in launched[first:])
            idle.append((cupy.cuda.get_elapsed_time(launched[first][1], launched[-1][2]) - own) / 1e3)
    return launch_times(model.backend, launched), len(launched) / runs, walls, idle


def markdown(args, chunk, times, per_prompt, walls, idle, plain, gpu_name):
    total = sum(sum(v) for v in times.values()) / args.runs
    attention = (" (SIMT attention)" if args.simt_attention else "") + (" (pairs grouped on the host)"
                                                                        if args.host_groups else "") + (
        f" (expert tiles of {args.moe_tiles})" if args.moe_tiles else "")
    chunks = -(-args.tokens // chunk)
    lines = [f"Model `{Path(args.model).name}`{attention} on {gpu_name}, every expert resident; a {args.tokens}-token "
             f"prompt in {chunks} chunk(s) of {chunk}: {np.median(plain) * 1e3:.1f} ms wall "
             f"({args.tokens / np.median(plain):.0f} tok/s, median of {len(plain)}); with a timing event around each "
             f"launch {np.median(walls) * 1e3:.1f} ms. {per_prompt:.0f} launches a prompt, their GPU time "
             f"{total * 1e3:.2f} ms, the GPU idle between them {np.median(idle) * 1e3:.2f} ms (waiting for the "
             "host).", "",
             *kernel_table(times, args.runs, "a prompt", "share of GPU time")]
    return "\n".join(lines) + "\n"


def wall_line(args, chunk, plain):
    return (f"{args.tokens} tokens in chunks of {chunk}: {np.median(plain) * 1e3:.1f} ms wall "
            f"({args.tokens / np.median(plain):.0f} tok/s, median of {len(plain)})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--chunks", default="", help="comma-separated chunk sizes (default: the prompt in one chunk)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--simt-attention", action="store_true")
    p.add_argument("--host-groups", action="store_true")
    p.add_argument("--moe-tiles", type=int, default=None)
    p.add_argument("--output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from hybrid import LLM

    llm = LLM(args.model, device="gpu", threads=args.threads, max_context=args.tokens + 64, kv_sequences=1)
    if args.simt_attention:
        llm.model.backend.kernels.prefill_mma = False
    if args.moe_tiles:
        import gpu_kernels.gemm as gemm_module

        gemm_module.MOE_GEMM_TOKENS = args.moe_tiles
    if args.host_groups:
        be = llm.model.backend
        be.capabilities = dataclasses.replace(be.capabilities, resident_chunks=False)
    sizes = [int(c) for c in args.chunks.split(",") if c] or [args.tokens]
    lines = []
    for chunk in sizes:
        read_prompt(llm.model, args.tokens, 0, chunk)  # warm-up: compiles and sizes the work buffers
        plain = [read_prompt(llm.model, args.tokens, 1 + run, chunk) for run in range(args.runs)]
        lines.append(wall_line(args, chunk, plain))
        if chunk == sizes[0]:
            times, per_prompt, walls, idle = profile(llm.model, args.tokens, args.runs, chunk)
            table = markdown(args, chunk, times, per_prompt, walls, idle, plain, llm.model.backend.rt.device_name)
    llm.close()
    text = table + "\n" + "\n".join(f"- {line}" for line in lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
