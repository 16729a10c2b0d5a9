"""Single-thread row-dot throughput of one quant format, from DRAM and from L2.

Times the decode dot loop (`_rows_dot`: weights x one activation row) over one
~600 MB matrix (from DRAM) and over one 768 x 1024 matrix read 300 times (from L2),
in GB/s of weight bytes. The gap between the two says whether a format is memory-
or compute-bound on this core.

    python bench/row_dot.py q4_k      # q8_0, q4_k, q6_k, q4_0 (the formats with a `_rows_dot` loop)
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from cpu_kernels import FORMATS  # noqa: E402
from cpu_kernels.tiles import sub_block_sums  # noqa: E402

ROWS, COLS = 768, 1024


def main(name):
    fmt = next(m for q, m in FORMATS.items() if q.name.lower() == name)
    rng = np.random.default_rng(0)
    row_bytes = COLS // fmt.BLOCK_SIZE * fmt.BLOCK_BYTES
    big = fmt.random_blocks(rng, (int(6e8 // (ROWS * row_bytes)) * ROWS, COLS), 0.02)  # [R, B], ~600 MB
    x = rng.standard_normal(COLS, dtype=np.float32)
    out = np.empty(big.shape[0], dtype=np.float32)
    args = (x, sub_block_sums(x.reshape(1, -1))[0]) if name in ("q4_k", "q5_k") else (x,)
    fmt._rows_dot(big[:ROWS], 0, ROWS, *args, out)  # compile
    for _ in range(3):
        start = time.perf_counter()
        fmt._rows_dot(big, 0, big.shape[0], *args, out)
        print(f"{name} from DRAM: {big.nbytes / (time.perf_counter() - start) / 1e9:.1f} GB/s")
    small = big[:ROWS].copy()
    start = time.perf_counter()
    for _ in range(300):
        fmt._rows_dot(small, 0, ROWS, *args, out)
    print(f"{name} from L2: {small.nbytes * 300 / (time.perf_counter() - start) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "q8_0")
