"""One-thread int16 decode dot of MXFP4 / IQ4_NL: the generic block code (one block at a time, pshufb lookup)
against the word-lookup dot of cpu_kernels.table_words (four blocks a step; with vpdpwssd and with pmaddwd),
in one process, alternating, best of N rounds, GB/s of weight bytes.

From L2: a 256-row matrix of C columns read 100 times a round. From DRAM: ~600 MB of rows read once a round in
work items of 128 rows (a one-thread decode's largest), as the expert kernels read them.

    python bench/table_words.py mxfp4 --cols 2880 --rounds 9
"""
import argparse
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from cpu_kernels import table_words  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "cpu_kernels"))
from test_table_words import int16_x, rows_dot  # noqa: E402


def generic_dot(fmt):
    """The dot loop around the generic block code alone."""
    from numba import njit

    from cpu_kernels import simd

    dot4 = simd.rows_dot_intrinsic(fmt._block_i16.tail, fmt.BLOCK_BYTES, simd.ROWS_IN_FLIGHT)
    dot1 = simd.rows_dot_intrinsic(fmt._block_i16.tail, fmt.BLOCK_BYTES, 1)

    @njit(nogil=True, fastmath=True)
    def dot(w, r0, r1, xq, aux, out):
        groups, step, stride = simd.row_streams(r0, r1)
        for i in range(groups):
            dot4(w, r0 + i * step, stride, xq, aux, out)
        for rr in range(r0 + groups * simd.ROWS_IN_FLIGHT, r1):
            dot1(w, rr, xq, aux, out)

    return dot


def main(name, cols, rounds):
    if not table_words.AVAILABLE:
        sys.exit("the target has no AVX-512 VBMI: no word dot to compare")
    fmt = importlib.import_module(f"cpu_kernels.{name}")
    variants = {"generic": generic_dot(fmt), "words vpdpwssd": rows_dot(fmt, True),
                "words pmaddwd": rows_dot(fmt, False)}
    rng = np.random.default_rng(0)
    row_bytes = cols // 32 * fmt.BLOCK_BYTES
    num_rows = int(6e8 // row_bytes) // 128 * 128
    big = fmt.random_blocks(rng, (num_rows, cols), 0.02)  # [R, B]
    small = big[:256].copy()
    x = rng.standard_normal((1, cols)).astype(np.float32)
    xs = {key: int16_x(x, words=key != "generic") for key in variants}  # x as each dot reads it
    out = np.empty(num_rows, np.float32)
    l2 = dict.fromkeys(variants, 0.0)
    dram = dict.fromkeys(variants, 0.0)
    for key, dot in variants.items():
        dot(small, 0, small.shape[0], *xs[key], out)  # compile
    for _ in range(rounds):
        for key, dot in variants.items():
            xq, aux = xs[key]
            start = time.perf_counter()
            for _ in range(100):
                dot(small, 0, small.shape[0], xq, aux, out)
            l2[key] = max(l2[key], small.nbytes * 100 / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for lo in range(0, num_rows, 128):
                dot(big, lo, lo + 128, xq, aux, out)
            dram[key] = max(dram[key], big.nbytes / (time.perf_counter() - start) / 1e9)
    for key in variants:
        print(f"{name} C={cols} {key}: from L2 {l2[key]:.1f} GB/s, from DRAM {dram[key]:.1f} GB/s "
              f"(best of {rounds}; {l2[key] / l2['generic']:.2f}x / {dram[key] / dram['generic']:.2f}x generic)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", choices=["mxfp4", "iq4_nl"])
    parser.add_argument("--cols", type=int, default=2880)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    main(args.format, args.cols, args.rounds)
