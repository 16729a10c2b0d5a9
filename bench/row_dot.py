"""Single-thread row-dot throughput of one quant format, from DRAM and from L2, float, int16 and int8 x.

Times the decode dot loops (`_rows_dot`: weights x one float32 activation row; `_rows_dot_i16`:
the same with x rounded to int16 per 32 values, STRATA_ACT_QUANT=int16; `_rows_dot_i8`, where the
format has one: x rounded to int8, STRATA_ACT_QUANT=int8, VNNI) over one ~600 MB matrix
(from DRAM) and over one 768 x 1024 matrix read 300 times (from L2), in GB/s of weight bytes.
The gap between the two says whether a format is memory- or compute-bound on this core. The DRAM
pass reads the matrix in work items of --items rows (128: a one-thread decode's largest), as the
decode kernels do; 0 reads it as one item.

    python bench/row_dot.py q4_k [--items 128]     # q8_0, q4_0, q4_k, q5_k, q6_k
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from cpu_kernels.formats import FORMATS  # noqa: E402
from cpu_kernels.act_quant import ACT_QUANTS, quantize_rows, quantize_rows_i8, quantize_rows_split  # noqa: E402
from cpu_kernels.tiles import sub_block_sums, work_items  # noqa: E402

ROWS, COLS = 768, 1024


def main(name, items=128):
    fmt = next(m for q, m in FORMATS.items() if q.name.lower() == name)
    rng = np.random.default_rng(0)
    row_bytes = COLS // fmt.BLOCK_SIZE * fmt.BLOCK_BYTES
    big = fmt.random_blocks(rng, (int(6e8 // (ROWS * row_bytes)) * ROWS, COLS), 0.02)  # [R, B], ~600 MB
    x = rng.standard_normal((1, COLS), dtype=np.float32)
    decode = work_items(np.zeros(1, np.int64), np.array([0, 1]), 1, ROWS)
    xq, aux = (quantize_rows_split if name == "q4_k" else quantize_rows)(x, decode, ACT_QUANTS["int16"])  # as the kernel
    out = np.empty(big.shape[0], dtype=np.float32)
    float_args = (x[0], sub_block_sums(x)[0]) if name in ("q4_k", "q5_k") else (x[0],)
    small = big[:ROWS].copy()
    modes = [("float", fmt._rows_dot, float_args), ("int16", fmt._rows_dot_i16, (xq[0], aux[0]))]
    if hasattr(fmt, "_rows_dot_i8"):
        x8, aux8 = quantize_rows_i8(x, decode, ACT_QUANTS["int8"], name in ("q4_k", "q5_k"))
        modes.append(("int8", fmt._rows_dot_i8, (x8[0], aux8[0])))
    for mode, dot, args in modes:
        dot(small, 0, ROWS, *args, out)  # compile
        best = 0.0
        span = items or big.shape[0]
        for _ in range(3):
            start = time.perf_counter()
            for lo in range(0, big.shape[0], span):
                dot(big, lo, min(lo + span, big.shape[0]), *args, out)
            best = max(best, big.nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        for _ in range(300):
            dot(small, 0, ROWS, *args, out)
        l2 = small.nbytes * 300 / (time.perf_counter() - start) / 1e9
        print(f"{name} {mode}: from DRAM {best:.1f} GB/s ({items or 'one'}-row items, best of 3), "
              f"from L2 {l2:.1f} GB/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("format", nargs="?", default="q8_0")
    parser.add_argument("--items", type=int, default=128, help="rows of a work item in the DRAM pass (0: one)")
    args = parser.parse_args()
    main(args.format, args.items)
