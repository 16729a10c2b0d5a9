"""Decode and prefill throughput of the CPU quant kernels vs DRAM read bandwidth.

For each format, builds random experts of one Qwen3-30B-A3B MoE layer (128 experts,
gate/up projection R=768, C=2048) and times a decode step that reads every expert
once: one moe_matmul call with 128 groups of one row (float, int16 and, where the format has
int8 dots and the CPU VNNI, int8 activations),
and (for comparison) a Python loop of 128 matvec calls. Throughput is weight bytes
read per second. Prefill: one moe_matmul of 64 tokens on each of 16 experts, GFLOP/s. Enough layer
copies are cycled that the weights never sit in the last-level cache. DRAM read
bandwidth is a parallel float32 sum over a large array, per thread count.

    python bench/cpu_kernels.py [--threads 1,2] [--formats q8_0,q4_k] [--repeats 7] [--no-prefill]

Prints the table; --out also writes it to a file (bench/results/cpu_kernels.md keeps the history by hand).
"""
import argparse
import logging
import math
import platform
import sys
import time
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

# This script shares the package's name: drop its folder from the path so the import finds the package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from cpu_kernels.formats import FORMATS  # noqa: E402
from cpu_kernels.target import vnni_width  # noqa: E402

log = logging.getLogger("bench.cpu_kernels")

NUM_EXPERTS, ROWS, COLS = 128, 768, 2048  # Qwen3-30B-A3B gate/up: [E, R, C]
PREFILL_EXPERTS, PREFILL_TOKENS = 16, 64  # a 512-token prompt gives each of 8 of 64 experts ~64 tokens


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _parallel_sum(a):
    acc = np.float32(0)
    for i in prange(a.shape[0]):
        acc += a[i]
    return acc


def median_seconds(fn, repeats):
    """Median wall time of fn() over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def dram_gbps(num_bytes, repeats):
    """Read bandwidth (GB/s) of a parallel sum over a float32 array of num_bytes."""
    a = np.random.default_rng(0).standard_normal(num_bytes // 4, dtype=np.float32)
    return a.nbytes / median_seconds(lambda: _parallel_sum(a), repeats) / 1e9


def decode_gbps(fmt, layers, repeats, modes):
    """({mode: moe_matmul GB/s} for the act_quant modes, matvec-loop GB/s) reading every expert of a layer once,
    cycling over layer copies. The modes are timed in turn, `repeats` rounds of one run each (the median per
    mode), so that load from other jobs falls on all of them alike."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((NUM_EXPERTS, COLS), dtype=np.float32)  # [N, C]: one token per expert
    out = np.empty((NUM_EXPERTS, ROWS), dtype=np.float32)  # [N, R]
    expert_ids = np.arange(NUM_EXPERTS, dtype=np.int64)  # [G]
    row_starts = np.arange(NUM_EXPERTS + 1, dtype=np.int64)  # [G+1]
    turn = iter(range(10**9))

    def moe(act_quant):
        fmt.moe_matmul(layers[next(turn) % len(layers)], x, expert_ids, row_starts, out, act_quant=act_quant)

    def loop():
        raw = layers[next(turn) % len(layers)]
        for e in range(NUM_EXPERTS):
            fmt.matvec(raw[e], x[e], out[e])

    num_bytes = layers[0].nbytes
    times = {mode: [] for mode in modes}
    for mode in modes:
        moe(mode)  # compile or load, warm
    for _ in range(repeats):
        for mode in modes:
            start = time.perf_counter()
            moe(mode)
            times[mode].append(time.perf_counter() - start)
    moe_gbps = {mode: num_bytes / float(np.median(t)) / 1e9 for mode, t in times.items()}
    return moe_gbps, num_bytes / median_seconds(loop, repeats) / 1e9


def prefill_gflops(fmt, layer, repeats):
    """GFLOP/s of a prompt-sized moe_matmul: PREFILL_TOKENS tokens on each of PREFILL_EXPERTS experts."""
    x = np.random.default_rng(2).standard_normal((PREFILL_EXPERTS * PREFILL_TOKENS, COLS), dtype=np.float32)
    out = np.empty((len(x), ROWS), dtype=np.float32)
    expert_ids = np.arange(PREFILL_EXPERTS, dtype=np.int64)
    row_starts = np.arange(0, len(x) + 1, PREFILL_TOKENS, dtype=np.int64)
    seconds = median_seconds(lambda: fmt.moe_matmul(layer, x, expert_ids, row_starts, out), repeats)
    return 2 * len(x) * ROWS * COLS / seconds / 1e9


def run(format_names, thread_counts, repeats, min_bytes, prefill=True):
    """Rows of (format, threads, moe float GB/s, moe int16 GB/s, moe int8 GB/s or None, loop GB/s,
    prefill GFLOP/s or None, DRAM GB/s)."""
    dram = {}
    for threads in thread_counts:
        numba.set_num_threads(threads)
        dram[threads] = dram_gbps(min_bytes, repeats)
        log.info("DRAM read, %d thread(s): %.1f GB/s", threads, dram[threads])
    rows = []
    for qtype, fmt in FORMATS.items():
        name = qtype.name.lower()
        if format_names and name not in format_names:
            continue
        layer_bytes = NUM_EXPERTS * ROWS * COLS // fmt.BLOCK_SIZE * fmt.BLOCK_BYTES
        num_copies = max(2, math.ceil(min_bytes / layer_bytes))
        log.info("%s: building %d layer copies of %.0f MB", name, num_copies, layer_bytes / 1e6)
        rng = np.random.default_rng(0)
        layers = [fmt.random_blocks(rng, (NUM_EXPERTS, ROWS, COLS), 0.02) for _ in range(num_copies)]
        modes = ("float", "int16", "int8") if hasattr(fmt, "_rows_dot_i8") and vnni_width() else ("float", "int16")
        for threads in thread_counts:
            numba.set_num_threads(threads)
            moe, loop = decode_gbps(fmt, layers, repeats, modes)
            gflops = prefill_gflops(fmt, layers[0], repeats) if prefill else None
            log.info("%s, %d thread(s): moe_matmul GB/s %s, matvec loop %.1f GB/s, prefill %s GFLOP/s", name, threads,
                     ", ".join(f"{v:.1f} {k} x" for k, v in moe.items()), loop, gflops)
            rows.append((name, threads, moe["float"], moe["int16"], moe.get("int8"), loop, gflops, dram[threads]))
        del layers
    return rows


def markdown(rows, repeats, min_bytes):
    lines = [
        "# CPU kernel decode throughput",
        "",
        f"{platform.processor() or platform.machine()}, {numba.config.NUMBA_NUM_THREADS} Numba threads available, "
        f"numba {numba.__version__}. One Qwen3-30B-A3B MoE layer: {NUM_EXPERTS} experts of [{ROWS}, {COLS}], "
        f"every expert read once per step; layer copies cycled over >= {min_bytes / 2**30:.1f} GiB. "
        f"Median of {repeats} runs after a warm-up (decode modes alternating). GB/s = weight bytes read / time. "
        "Decode: one token per expert, x as float32 (STRATA_ACT_QUANT=float), rounded to int16 per 32 values "
        "(int16, the default where the CPU has AVX2; float formats have no integer path) or to int8 per 32 values "
        "(int8, opt-in, VNNI; Q8_0, Q4_K, Q5_K, Q6_K). Prefill: "
        f"{PREFILL_TOKENS} tokens on each of {PREFILL_EXPERTS} experts, GFLOP/s = 2 x tokens x R x C / time.",
        "",
        "| format | threads | decode GB/s float x | decode GB/s int16 x | decode GB/s int8 x | % of DRAM, int16 x "
        "(default) | % of DRAM, best | matvec loop GB/s (default) | prefill GFLOP/s | DRAM read GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, threads, moe_float, moe_int16, moe_int8, loop, prefill, dram in rows:
        best = max(moe_float, moe_int16, moe_int8 or 0.0)
        int8 = "-" if moe_int8 is None else f"{moe_int8:.1f}"
        gflops = "-" if prefill is None else f"{prefill:.1f}"
        lines.append(f"| {name} | {threads} | {moe_float:.1f} | {moe_int16:.1f} | {int8} | {100 * moe_int16 / dram:.0f}% | "
                     f"{100 * best / dram:.0f}% | "
                     f"{loop:.1f} | {gflops} | {dram:.1f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated Numba thread counts")
    parser.add_argument("--formats", default="", help="comma-separated formats (default: all in cpu_kernels.formats.FORMATS)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gib", type=float, default=1.5, help="bytes cycled per measurement, in GiB (beat the LLC)")
    parser.add_argument("--no-prefill", action="store_true", help="decode columns only")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    thread_counts = [int(t) for t in args.threads.split(",")]
    format_names = {f.strip().lower() for f in args.formats.split(",") if f.strip()}
    min_bytes = int(args.gib * 2**30)
    rows = run(format_names, thread_counts, args.repeats, min_bytes, prefill=not args.no_prefill)
    table = markdown(rows, args.repeats, min_bytes)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
