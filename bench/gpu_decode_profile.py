"""Where a GPU decode step's time goes: each kernel's GPU time, summed by kernel over a few one-token steps.

The step's launches are queued one by one (dense, expert and step graphs off) behind a spin kernel that keeps
the stream busy until every launch is queued, so the timing events around each launch measure the kernels
back to back as the GPU runs them, not the host's launch gaps. The graphs replay the same kernels, so this is
what a graphed step's GPU time is made of (the graphed step's own time is printed beside it).

    python bench/gpu_decode_profile.py --model /tmp/q30b.gguf --steps 8 [--users 4] [--output FILE]

--step-users 1,4 prints only the default (graphed) step's wall time at each user count side by side, and each
one's ratio to the first count's (several users' one-token chunks in one step: the serving engine's decode batch).
"""
import argparse
import logging
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
log = logging.getLogger("bench.gpu_decode_profile")

SPIN = r'''extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}'''


def kernel_names(runtime):
    """id(compiled function) -> "module.kernel", over every module the runtime compiled."""
    return {id(fn): f"{module}.{name}" for module, functions in runtime._modules.items()
            for name, fn in functions.items()}


@contextmanager
def timed_launches(be):
    """Within: every kernel the backend launches is recorded as (function, start event, stop event) in the list
    yielded, the events recorded on the backend's stream around the launch."""
    import cupy

    launched, real_launch = [], be.kernels._launch

    def timed_launch(fn, grid, block, args, shared_mem=0):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(be.stream)
        real_launch(fn, grid, block, args, shared_mem)
        stop.record(be.stream)
        launched.append((fn, start, stop))

    be.kernels._launch = timed_launch
    try:
        yield launched
    finally:
        be.kernels._launch = real_launch


def launch_times(be, launched):
    """{"module.kernel": [GPU seconds of each launch]} of timed_launches' records (after the stream finished)."""
    import cupy

    names, times = kernel_names(be.rt), defaultdict(list)
    for fn, start, stop in launched:
        times[names.get(id(fn), "?")].append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return times


def kernel_table(times, count, unit, share="share"):
    """Markdown lines of kernels by GPU time: launches and us per `unit` (a step, a chunk) over `count` of them."""
    total = sum(sum(v) for v in times.values()) / count
    lines = [f"| kernel | launches {unit} | us a launch (median) | us {unit} | {share} |", "|---|---|---|---|---|"]
    for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        per = sum(v) / count
        lines.append(f"| {name} | {len(v) / count:.0f} | {np.median(v) * 1e6:.1f} | {per * 1e6:.0f} "
                     f"| {per / total:.0%} |")
    return lines


def profile(llm, steps, users, spin_cycles, context=32):
    """({kernel: [GPU seconds of each launch]}, launches per step) over `steps` decode steps of `users` sequences
    after a `context`-token prompt each."""
    import cupy

    from hybrid.batch import Batch, SeqChunk

    model, be = llm.model, llm.model.backend
    spin = cupy.RawKernel(SPIN, "spin")
    rng = np.random.default_rng(0)
    kvs = [model.new_sequence(context + 32 + steps) for _ in range(users)]
    for kv in kvs:
        for lo in range(0, context, 512):
            model.forward(Batch([SeqChunk(kv, lo, rng.integers(10, 1000, min(512, context - lo)), "last")]))
    with timed_launches(be) as launched:
        for step in range(steps):
            with be.stream:
                spin((1,), (1,), (np.int64(spin_cycles),))
            model.forward(Batch([SeqChunk(kv, kv.length, rng.integers(10, 1000, 1)) for kv in kvs]))
            be.stream.synchronize()
    times = launch_times(be, launched)
    return times, len(launched) / steps


def step_seconds(llm, users, steps=16, context=32):
    """Median seconds of a decode step of `users` sequences after a `context`-token prompt each, the default way
    (graphs on)."""
    from hybrid.batch import Batch, SeqChunk

    model, rng = llm.model, np.random.default_rng(1)
    kvs = [model.new_sequence(context + 32 + steps) for _ in range(users)]
    for kv in kvs:
        for lo in range(0, context, 512):
            model.forward(Batch([SeqChunk(kv, lo, rng.integers(10, 1000, min(512, context - lo)), "last")]))
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward(Batch([SeqChunk(kv, kv.length, rng.integers(10, 1000, 1)) for kv in kvs]))
        out.append(time.perf_counter() - t0)
    return float(np.median(out[2:]))


def step_table(llm, counts, context, path):
    """Markdown lines: the default step's median wall time at each user count of `counts`, its tokens a second, and
    its time against the first count's (path: the runner's last_path of each)."""
    rows = ["| users | step ms | tok/s (all users) | step / first count's | path |", "|---|---|---|---|---|"]
    first = None
    for users in counts:
        seconds = step_seconds(llm, users, context=context)
        first = first or seconds
        rows.append(f"| {users} | {seconds * 1e3:.3f} | {users / seconds:.0f} | {seconds / first:.2f} | "
                    f"{path(llm)} |")
        log.info(rows[-1])
    return rows


def tuned(llm, args):
    """llm with the kernel tuning the arguments ask for (before its first step: graphs capture the launches)."""
    if args.attention_rows:
        llm.model.backend.kernels.attention_rows = args.attention_rows
    kernels = llm.model.backend.kernels
    if args.fill_sms:
        kernels.fill_sms = True
    if args.decode_rows:
        kernels.decode_rows = args.decode_rows
    if args.lane_slices:
        kernels.lane_slices = args.lane_slices
    if args.short_attention:
        kernels.short_attention_keys = args.short_attention
    if args.prefetch:
        kernels.prefetch = args.prefetch
        kernels._functions.clear()  # compiled again with the ring
    kernels._launches.clear()  # the shapes launched while loading, planned again
    if args.multi_tokens is not None:
        kernels.multi_tokens = args.multi_tokens
    if args.xq_per_launch:
        from gpu_kernels.kernels import XQ_KERNELS

        kernels.xq_per_launch = frozenset(XQ_KERNELS)
    if args.round_each_projection:  # the A/B of same_x: every projection rounds its x again
        plain = kernels.matmul
        kernels.matmul = lambda raw, qtype, x, out, float_x=False, same_x=False: plain(raw, qtype, x, out, float_x)
    if args.group_tokens is not None:
        llm.model.backend.device_experts.group_tokens = args.group_tokens or None
    return llm


def markdown(args, times, per_step, graphed_s, gpu_name):
    total = sum(sum(v) for v in times.values()) / args.steps
    rows = f", attention {args.attention_rows} heads a block" if args.attention_rows else ""
    rows += ", fill_sms" if args.fill_sms else ""
    rows += f", one-token matmuls {args.decode_rows} rows a group" if args.decode_rows else ""
    rows += f", {args.lane_slices} slices a lane" if args.lane_slices else ""
    rows += f", short attention up to {args.short_attention} keys" if args.short_attention else ""
    rows += f", {args.prefetch} slices in flight" if args.prefetch else ""
    rows += f", pairs grouped from {args.group_tokens or 'no'} tokens" if args.group_tokens is not None else ""
    rows += f", few-token matmuls up to {args.multi_tokens} tokens" if args.multi_tokens is not None else ""
    rows += ", x rounded once a launch" if args.xq_per_launch else ""
    lines = [f"Model `{Path(args.model).name}` on {gpu_name}, {args.users} user(s){rows}, every expert resident; "
             f"{args.steps} decode steps after {args.context}-token prompts, {per_step:.0f} launches a step. GPU time "
             f"of the launches back to back: "
             f"{total * 1e3:.2f} ms a step; the default (graphed) step took {graphed_s * 1e3:.2f} ms of wall time.", "",
             *kernel_table(times, args.steps, "a step")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--spin-ms", type=float, default=200.0, help="how long the stream waits while a step is queued")
    p.add_argument("--attention-rows", type=int, default=None, choices=(1, 2, 4, 8),
                   help="most heads a one-token attention block takes (default: the kernels')")
    p.add_argument("--context", type=int, default=32, help="prompt tokens each user holds before the decode steps")
    p.add_argument("--fill-sms", action="store_true",
                   help="one-token matmuls with fewer blocks than multiprocessors take fewer rows a lane group "
                        "(gpu_kernels.kernels.Kernels fill_sms)")
    p.add_argument("--decode-rows", type=int, default=None, choices=(1, 2, 4, 8),
                   help="rows a lane group of every one-token matmul (default: each format's DECODE_TUNING)")
    p.add_argument("--lane-slices", type=int, default=None, help="slices a lane of every one-token matmul")
    p.add_argument("--short-attention", type=int, default=None,
                   help="one-token attention over at most this many keys by paged_attention_1s (a block a head)")
    p.add_argument("--prefetch", type=int, default=None, choices=(3, 4, 6, 8),
                   help="one-token matmuls' slices in flight a lane plus one (matmul.cu's DECODE_PREFETCH; default 2)")
    p.add_argument("--multi-tokens", type=int, default=None,
                   help="dense matmuls of 2 to this many tokens take matmul_n / matmul_nq (0: the tiled kernel; "
                        "default: gpu_kernels.kernels MULTI_DECODE_TOKENS)")
    p.add_argument("--xq-per-launch", action="store_true",
                   help="every int16 one- and few-token matmul's x rounded once a launch into global memory, not in "
                        "every block (gpu_kernels.kernels.Kernels xq_per_launch)")
    p.add_argument("--round-each-projection", action="store_true",
                   help="q, k and v each round their x to int16 again (Kernels.matmul's same_x off)")
    p.add_argument("--group-tokens", type=int, default=None,
                   help="decode steps of at least this many tokens group their pairs by expert (0: never; default: "
                        "hybrid/backends/gpu_experts.py GROUP_DECODE_TOKENS)")
    p.add_argument("--step-users", default=None,
                   help="comma-separated user counts: print the default step's time at each, side by side (no "
                        "kernel profile)")
    p.add_argument("--output")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from hybrid import LLM

    if args.step_users:
        counts = [int(u) for u in args.step_users.split(",")]
        llm = tuned(LLM(args.model, device="gpu", threads=args.threads, max_context=args.context + 512,
                        kv_sequences=max(counts)), args)
        grouped = llm.model.backend.device_experts.group_tokens
        lines = [f"Model `{Path(args.model).name}` on {llm.model.backend.rt.device_name}, every expert resident; the "
                 f"default decode step after {args.context}-token prompts, median of 14 steps, by users at once "
                 f"(pairs grouped by expert from {grouped or 'no'} tokens; dense matmuls of 2 to "
                 f"{llm.model.backend.kernels.multi_tokens} tokens by matmul_n / matmul_nq"
                 f"{'; x rounded once a launch' if args.xq_per_launch else ''}"
                 f"{'; q, k, v each rounding x' if args.round_each_projection else ''}).", "",
                 *step_table(llm, counts, args.context, lambda m: m.model.runner.last_path)]
        text = "\n".join(lines) + "\n"
        print(text)
        if args.output:
            Path(args.output).write_text(text)
        return

    graphed = tuned(LLM(args.model, device="gpu", threads=args.threads, max_context=args.context + 512,
                        kv_sequences=args.users),
                    args)
    graphed_s = step_seconds(graphed, args.users, context=args.context)
    gpu_name = graphed.model.backend.rt.device_name
    graphed.close()
    del graphed
    llm = tuned(LLM(args.model, device="gpu", threads=args.threads, max_context=args.context + 512,
                    kv_sequences=args.users,
                    dense_graphs=False, decode_graphs=False, step_graphs=False), args)
    times, per_step = profile(llm, args.steps, args.users, int(args.spin_ms * 2e6), args.context)
    text = markdown(args, times, per_step, graphed_s, gpu_name)
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
