"""The decode dot loops' software prefetch distance, chosen for this host at start-up.

A dot loop reads four rows of a weight at once (four streams a quarter work item apart in long items,
neighbouring rows in short ones: simd.row_streams) and prefetches n loop steps on, n = simd.PREFETCH_ROWS.
The best n is the host's (a short look-ahead on some hosts, a long one on others where the rows are
neighbours; bench/results/ has the timings). `calibrate` times one thread's decode dot over the model's own
expert weights at each candidate and keeps the fastest, unless given a fixed n.

Shape legend: E experts, R rows, B bytes per row, C columns.
"""
import logging
import time

import numba
import numpy as np

from .formats import format_for
from .act_quant import act_quant_code
from .simd import PREFETCH_ROWS
from .tiles import kernels_of

log = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8)  # rows ahead in each stream
ROUNDS = 2  # passes over the candidates, alternating; each candidate's best pass counts
SAMPLE_BYTES = 512 << 20  # weights read per candidate and pass, at most (past any last-level cache we know)
MIN_SAMPLE_BYTES = 64 << 20  # with fewer expert bytes than this the weights sit in cache: keep the default


def prefetch_rows():
    return PREFETCH_ROWS.value


def set_prefetch_rows(rows):
    """Rows ahead the dot loops prefetch (0: the rows being read, i.e. no look-ahead)."""
    try:
        value = int(rows)
    except ValueError:
        value = -1
    if not 0 <= value <= 1024:
        raise ValueError(f"prefetch distance {rows!r}: expected a whole number of rows, "
                         "0 to 1024")
    PREFETCH_ROWS.value = value


def calibrate(tensors, rows=None, min_bytes=MIN_SAMPLE_BYTES, candidates=CANDIDATES):
    """Set the prefetch distance from timed decode dots over `tensors` (expert weights, each with .raw
    [E, R, B] and .qtype; the first SAMPLE_BYTES of them are read, so pass them mixed as a decode step reads
    them: gate, up, down of a layer); returns {rows: GB/s} of the candidates (empty when nothing was timed).
    rows: a fixed distance instead (nothing timed)."""
    if rows is not None:
        set_prefetch_rows(rows)
        log.info("decode prefetch: %d rows ahead (fixed)", prefetch_rows())
        return {}
    sample, total = [], 0
    for tensor in tensors:
        if total >= SAMPLE_BYTES:
            break
        sample.append(tensor)
        total += tensor.raw.nbytes
    if total < min_bytes or not sample:
        return {}
    rates = {rows: 0.0 for rows in candidates}
    read = _decode_reader(sample)
    read()  # compile or load the kernel, fault in the pages
    for _ in range(ROUNDS):
        for rows in candidates:
            set_prefetch_rows(rows)
            start = time.perf_counter()
            read()
            rates[rows] = max(rates[rows], total / (time.perf_counter() - start) / 1e9)
    best = max(candidates, key=lambda rows: (rates[rows], -rows))
    set_prefetch_rows(best)
    formats = "/".join(sorted({t.qtype.name for t in sample}))
    log.info("decode prefetch: %d rows ahead (one thread over %.0f MB of %s experts, GB/s: %s)", best, total / 1e6,
             formats, ", ".join(f"{rows}: {rate:.1f}" for rows, rate in rates.items()))
    return rates


def _decode_reader(tensors):
    """A function that reads every expert of `tensors` once as a one-thread decode step does (int16 x): the
    format's parallel kernel, which serving compiles anyway, on one Numba thread: its serial twin, used by
    nothing else from two threads on, would be compiled for this alone."""
    act_quant = act_quant_code(None)
    calls = []
    rng = np.random.default_rng(0)
    for tensor in tensors:
        raw = tensor.raw if tensor.raw.ndim == 3 else tensor.raw.reshape(1, *tensor.raw.shape)  # [E, R, B]
        parallel, _, cols = kernels_of(format_for(tensor.qtype), raw)
        num_experts, num_rows = raw.shape[:2]
        x = rng.standard_normal((num_experts, cols)).astype(np.float32)  # [E, C]: one token per expert
        groups = np.arange(num_experts, dtype=np.int64), np.arange(num_experts + 1, dtype=np.int64)
        calls.append((parallel, (raw,), x, *groups, (np.empty((num_experts, num_rows), np.float32),)))

    def read():
        threads = numba.get_num_threads()
        numba.set_num_threads(1)
        try:
            for kernel, raws, x, expert_ids, row_starts, outs in calls:
                kernel(raws, x, expert_ids, row_starts, outs, act_quant)
        finally:
            numba.set_num_threads(threads)

    return read
