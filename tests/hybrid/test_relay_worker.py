"""The relay's host worker (hybrid/relay.py HostRelay) wakes a waiting caller once a step's jobs are all answered, not
at every layer: each wake-up would take a core from the next layer's host experts."""
import threading
import time
from types import SimpleNamespace

from cpu_kernels.mailbox import WAIT_OK
from hybrid.relay import HostRelay, Mailbox


class CountingCondition(threading.Condition):
    notified = 0

    def notify_all(self):
        self.notified += 1
        super().notify_all()


class InstantHost:
    """relay_decode_experts answers at once (a few ms apart, so the caller waits between answers)."""

    def relay_decode_experts(self, layer, mailbox, seq, resident, limit_ticks, num_tokens=1):
        time.sleep(0.005)
        return WAIT_OK, 1, 0, 1, 2


def test_the_worker_wakes_the_caller_once_a_step():
    worker = HostRelay(InstantHost(), Mailbox.allocate(4, 2, 8))
    worker._answered = condition = CountingCondition()
    try:
        for step in (1, 2):
            for index in range(4):
                worker.submit(SimpleNamespace(index=index), step, None)
            results = worker.collect()
            assert [r.layer for r in results] == [0, 1, 2, 3] and all(r.problem() is None for r in results)
            assert [(r.entered, r.seen, r.posted) for r in results] == [(0, 1, 2)] * 4
            assert condition.notified == step, condition.notified  # one wake-up a step, at its last layer
    finally:
        worker.close()
    assert not worker.alive
