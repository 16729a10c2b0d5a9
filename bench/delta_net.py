"""Gated DeltaNet's CPU kernels at Qwen3-Next-80B-A3B's shapes (16 key heads, 32 value heads of 128, conv width 4):
one layer's decode step and one layer's 512-token prompt chunk, the delta rule token by token and by chunks, and
the conv. The state's cost does not grow with the context: these are the linear layers' whole per-token work
besides their projections. Median of `--runs` timings of `--reps` calls each, per thread count.

    python -m bench.delta_net [--threads 1,16] [--runs 5]
"""
import argparse
import statistics
import time

import numba
import numpy as np

from cpu_kernels import delta_net

HK, HV, DK, DV, WIDTH = 16, 32, 128, 128, 4


def inputs(rng, num_tokens):
    """q, k, v, g, beta, state, out, conv input, conv taps [W, C] (the weight transposed, as the kernel takes it),
    conv state, conv out: random, the decay near 1."""
    channels = 2 * HK * DK + HV * DV
    return dict(
        q=rng.standard_normal((num_tokens, HK, DK), np.float32),
        k=rng.standard_normal((num_tokens, HK, DK), np.float32),
        v=rng.standard_normal((num_tokens, HV, DV), np.float32),
        g=-0.1 * np.abs(rng.standard_normal((num_tokens, HV), np.float32)),
        beta=rng.random((num_tokens, HV), np.float32),
        state=np.zeros((HV, DK, DV), np.float32), out=np.empty((num_tokens, HV, DV), np.float32),
        x=rng.standard_normal((num_tokens, channels), np.float32), w=rng.standard_normal((WIDTH, channels), np.float32),
        conv_state=np.zeros((WIDTH - 1, channels), np.float32), conv_out=np.empty((num_tokens, channels), np.float32))


def seconds(fn, reps, runs):
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1", help="thread counts, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| threads | tokens | op | ms per layer | tokens/s per layer |\n|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        for num_tokens, reps in ((1, 200), (512, 3)):
            a = inputs(rng, num_tokens)
            ops = {"delta rule, token by token": lambda: delta_net.delta_rule_recurrent(
                       a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["out"]),
                   "conv + silu": lambda: delta_net.conv1d_silu(a["x"], a["w"], a["conv_state"], a["conv_out"])}
            if num_tokens > 1:
                ops["delta rule, by chunks"] = lambda: delta_net.delta_rule_chunked(
                    a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["out"])
            for name, fn in ops.items():
                t = seconds(fn, reps, args.runs)
                print(f"| {threads} | {num_tokens} | {name} | {t * 1e3:.3f} | {num_tokens / t:.0f} |")


if __name__ == "__main__":
    main()
