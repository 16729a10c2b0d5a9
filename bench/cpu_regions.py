"""What a parallel region and a barrier inside one cost on this host, for one threading setup.

A decode step opens ~8 parallel regions a layer (bench/results/vs_llamacpp_h200.md). The alternative,
llama.cpp's, keeps one region and meets at barriers between the ops. This measures both: an empty
Numba parallel region (prange over one item a thread, back to back), and one region whose threads
pass B barriers (each: claim the stage's items from an atomic counter, count them done, spin until
all are). Best of 5 timings. The threading layer and OpenMP settings come from the environment
(NUMBA_THREADING_LAYER, OMP_PROC_BIND, OMP_WAIT_POLICY), so run once per setup:

    python bench/cpu_regions.py --threads 16,4,1 [--label omp-bind]
"""
import argparse
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]  # bench/cpu_kernels.py
from cpu_kernels.sync import atomic_add, atomic_load, pause  # noqa: E402


@njit(parallel=True)
def empty_region(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


@njit(parallel=True)
def barriers_region(counters, num_barriers, num_threads):
    """counters int64 [2 * num_barriers], zero: per stage (claimed, done). Deadlock-free however the
    iterations map to threads: a thread claims what no one else has, so each stage finishes."""
    for _ in prange(num_threads):
        for stage in range(num_barriers):
            while atomic_add(counters, 2 * stage, 1) < num_threads:
                atomic_add(counters, 2 * stage + 1, 1)
            while atomic_load(counters, 2 * stage + 1) < num_threads:
                pause()


def best_us(fn, calls):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    for threads in (int(t) for t in args.threads.split(",")):
        numba.set_num_threads(threads)
        a = np.zeros(threads)
        empty_region(a)
        empty = best_us(lambda: empty_region(a), 2000)
        line = f"{args.label} layer={numba.threading_layer()} threads={threads}: empty region {empty:.2f} us"
        for num_barriers in (8, 64):
            def run():
                barriers_region(np.zeros(2 * num_barriers, dtype=np.int64), num_barriers, threads)
            run()
            total = best_us(run, 500)
            line += (f"; region with {num_barriers} barriers {total:.2f} us "
                     f"({(total - empty) / num_barriers:.2f} us a barrier)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
