"""The relay's flags (cpu_kernels/mailbox.py): data written before a post is seen after the wait, a wait
ends on abort and on its time limit."""
import threading
import time

import numpy as np
from numba import njit

from cpu_kernels.mailbox import WAIT_ABORTED, WAIT_OK, WAIT_TIMED_OUT, new_flags, post, ticks, wait_for
from cpu_kernels.sync import LINE


@njit(nogil=True)
def _reader(flags, data, rounds, abort, limit, seen):
    """For each round r, wait for flag 0 to reach r, copy data, post r on flag 1."""
    for r in range(1, rounds + 1):
        if wait_for(flags, 0, r, abort, limit) != WAIT_OK:
            return r
        seen[r - 1] = data[0] + data[-1]
        post(flags, LINE, r)
    return 0


def test_posted_data_is_seen_after_the_wait():
    rounds, flags, abort = 2000, new_flags(2), np.zeros(LINE, np.int64)
    data, seen = np.zeros(4096, np.int64), np.zeros(rounds, np.int64)
    result = []
    reader = threading.Thread(target=lambda: result.append(_reader(flags, data, rounds, abort, ticks(10), seen)))
    reader.start()
    never = np.zeros(LINE, np.int64)
    for r in range(1, rounds + 1):
        data[:] = r  # then the post: the reader must see this round's data, never an older one
        post(flags, 0, r)
        assert wait_for(flags, LINE, r, never, ticks(10)) == WAIT_OK
    reader.join()
    assert result == [0]
    np.testing.assert_array_equal(seen, 2 * np.arange(1, rounds + 1))


def test_wait_ends_on_its_limit_and_on_abort():
    flags, abort = new_flags(1), np.zeros(LINE, np.int64)
    post(flags, 0, 5)
    assert wait_for(flags, 0, 5, abort, ticks(1)) == WAIT_OK  # an older step's number passes too
    start = time.perf_counter()
    assert wait_for(flags, 0, 6, abort, ticks(0.2)) == WAIT_TIMED_OUT
    assert 0.1 < time.perf_counter() - start < 5
    timer = threading.Timer(0.1, lambda: abort.__setitem__(0, 1))
    timer.start()
    start = time.perf_counter()
    assert wait_for(flags, 0, 6, abort, ticks(30)) == WAIT_ABORTED
    assert time.perf_counter() - start < 10
