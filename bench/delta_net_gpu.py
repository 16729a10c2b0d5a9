"""Gated DeltaNet's delta rule on the GPU at Qwen3-Next-80B-A3B's shapes (16 key heads, 32 value heads of 128): one
layer's chunk of T tokens token by token (src/delta_net.cu delta_rule) against the chunked form (four launches,
hybrid/backends/gpu_delta.py), per T; where they cross is what gpu_delta.CHUNKED_MIN_TOKENS should be. Median of
--runs timings of --reps calls each (the device synchronized around them: launch costs included); the two forms'
outputs are compared too.

    python -m bench.delta_net_gpu [--tokens 16,32,64,128,512,2048] [--runs 5]
"""
import argparse
import statistics
import time

import numpy as np

from bench.delta_net import DK, DV, HK, HV
from gpu_kernels.runtime import probe
from hybrid.backends.gpu import GpuBackend


def seconds(rt, fn, reps, runs):
    fn()
    rt.cp.cuda.Device().synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        rt.cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - start) / reps)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16,32,64,128,512,2048", help="chunk sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    found = probe()
    if found.runtime is None:
        raise SystemExit(f"no GPU: {found.reason}")
    rt = found.runtime
    backend = GpuBackend(rt, max_context=4096)
    rng = np.random.default_rng(0)
    print("| tokens | token by token (ms) | chunked (ms) | chunked / token by token | max |out diff| |")
    print("|---:|---:|---:|---:|---:|")
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        q, k = (rt.to_device(rng.standard_normal((num_tokens, HK, DK), np.float32)) for _ in range(2))
        v = rt.to_device(rng.standard_normal((num_tokens, HV, DV), np.float32))
        g = rt.to_device(-0.1 * np.abs(rng.standard_normal((num_tokens, HV), np.float32)))
        beta = rt.to_device(rng.random((num_tokens, HV), np.float32))
        outs = [rt.empty((num_tokens, HV, DV), np.float32) for _ in range(2)]
        states = [rt.zeros((HV, DK, DV), np.float32) for _ in range(2)]
        loop = seconds(rt, lambda: backend.kernels.delta_rule(q, k, v, g, beta, states[0], outs[0]), args.reps,
                       args.runs)
        chunked = seconds(rt, lambda: backend._delta_rule_chunked(q, k, v, g, beta, states[1], outs[1], False),
                          args.reps, args.runs)
        states = [rt.zeros((HV, DK, DV), np.float32) for _ in range(2)]  # one call each from zero: comparable
        backend.kernels.delta_rule(q, k, v, g, beta, states[0], outs[0])
        backend._delta_rule_chunked(q, k, v, g, beta, states[1], outs[1], False)
        diff = float(np.abs(rt.to_host(outs[0]) - rt.to_host(outs[1])).max())
        print(f"| {num_tokens} | {1e3 * loop:.3f} | {1e3 * chunked:.3f} | {chunked / loop:.2f} | {diff:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
