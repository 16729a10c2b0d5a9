"""cpu_kernels.sync: every item of a stage is claimed exactly once, whatever the worker count and the
item count (fewer items than workers included), and no worker leaves a stage before all its items are done."""
import numba
import numpy as np
import pytest
from numba import njit, prange

from cpu_kernels import sync


@njit(parallel=True, nogil=True)
def _claim_all(item_counts, num_workers):
    """claims int64 [stages, max items]: how often each item was claimed; seen int64 [stages, W]: the done
    count each worker saw on leaving each stage."""
    num_stages = item_counts.size
    counters = sync.new_counters(num_stages, num_workers)
    claims = np.zeros((num_stages, item_counts.max()), dtype=np.int64)
    seen = np.zeros((num_stages, num_workers), dtype=np.int64)
    for w in prange(num_workers):
        for stage in range(num_stages):
            n = item_counts[stage]
            done = 0
            i, tried = sync.take(counters, stage, w, num_workers, n, 0)
            while i < n:
                sync.atomic_add(claims[stage], i, 1)
                done += 1
                i, tried = sync.take(counters, stage, w, num_workers, n, tried)
            sync.finish(counters, stage, num_workers, done, n)
            seen[stage, w] = sync.atomic_load(counters, sync._slot(stage, num_workers, num_workers))
    return claims, seen


@pytest.mark.parametrize("num_workers", [1, 3, 16])
def test_every_item_claimed_once(num_workers):
    item_counts = np.array([1, 2, num_workers, num_workers + 1, 5 * num_workers + 3, 200], dtype=np.int64)
    claims, seen = _claim_all(item_counts, num_workers)
    for stage, n in enumerate(item_counts):
        np.testing.assert_array_equal(claims[stage, :n], 1, err_msg=f"stage {stage}: {n} items")
        np.testing.assert_array_equal(seen[stage], n)  # each left only once all were done


def test_more_workers_than_threads():
    """Workers are prange iterations, not threads: with more workers than threads some run after others,
    and a worker whose share is gone must still find the items of workers not started yet."""
    claims, seen = _claim_all(np.array([7, 64], dtype=np.int64), 4 * numba.get_num_threads())
    np.testing.assert_array_equal(claims[0, :7], 1)
    np.testing.assert_array_equal(claims[1], 1)
