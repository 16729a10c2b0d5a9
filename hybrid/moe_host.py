"""The host side of the hybrid split: the pairs of the experts the device does not hold, run by the host
backend beside the device part (in a worker thread, or in the calling thread). It meets the split through
the Experts contract (hybrid/backends/base.py): submit, then wait.
Shape legend: T tokens, H hidden, E experts, K experts per token, N pairs."""
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from cpu_kernels.target import use_chosen_threads

from .pair_groups import PairGroups


class HostSide:
    """host: the host backend (hybrid/backends/base.py HostExperts); resident: the split's bool [L, E] (updated in
    place by a dynamic cache); borrow: the split's placement.borrow.BorrowModel, told the speed of large host calls.

    host_thread: run a prompt chunk's host part in a worker thread, while the calling thread queues the device part,
    rather than in the calling thread.
    decode_host_thread: the same for a decode token, off by default: its device part is queued first (one graph a
    layer), so the calling thread would only wait for the worker, and the hand-over costs more than it hides
    (bench/results/gpu_model.md).
    compiled_host_decode: a decode token's host part as one compiled call (the host's host_decode_experts: the pair
    selection and grouping too) rather than NumPy bookkeeping and grouped_experts; bit-identical, on where the host
    has it."""

    def __init__(self, host, resident, borrow):
        self.host, self.resident, self.borrow = host, resident, borrow
        self.host_thread, self.decode_host_thread = True, False
        self.compiled_host_decode = host.capabilities.host_decode_experts
        self._pool = _host_pool()

    def close(self):
        """Stop the worker thread; a later submit starts a new one."""
        self._pool.shutdown(wait=True)
        self._pool = _host_pool()

    def submit(self, layer, hidden, ids, weights, groups=None):
        """Start a layer's host pairs: those of `groups`, or with groups None a decode token's pairs whose experts are
        not resident. hidden [T, H], ids int [T, K], weights [T, K] on the host. In the worker where host_thread
        (decode_host_thread for a decode token) is on, else now."""
        if groups is None:
            run, threaded = self._run_decode, self.decode_host_thread
        else:
            run, threaded = self._run, self.host_thread
        return self._pool.submit(run, layer, hidden, ids, weights, groups) if threaded \
            else run(layer, hidden, ids, weights, groups)

    @staticmethod
    def wait(pending):
        """(out [T, H] or None where the host had no pairs, seconds) of a submitted part (None: nothing)."""
        if pending is None:
            return None, 0.0
        return pending.result() if isinstance(pending, Future) else pending

    def _run_decode(self, layer, x, ids, weights, _):
        resident = self.resident[layer.index]  # [E]
        if self.compiled_host_decode and layer.expert_glu is None:  # the compiled call runs plain SwiGLU only
            t0 = time.perf_counter()
            out, num_pairs = self.host.host_decode_experts(layer, x, ids, weights, resident)
            if num_pairs == 0:
                return None, 0.0
            seconds = time.perf_counter() - t0
            self.borrow.measure(layer, num_pairs, seconds)
            return out, seconds
        experts = ids[0].astype(np.int64)  # [K]
        slots = np.flatnonzero(~resident[experts])  # pair slots j the host runs
        if len(slots) == 0:
            return None, 0.0
        return self._run(layer, x, ids, weights, PairGroups.of_slots(experts, slots))

    def _run(self, layer, x, ids, weights, groups):
        """(out [T, H], seconds): the host's pairs of `groups` (Numba releases the GIL in a worker)."""
        t0 = time.perf_counter()
        out = self.host.grouped_experts(x, weights, groups, layer.gate_exps, layer.up_exps, layer.down_exps,
                                        layer.expert_glu)
        seconds = time.perf_counter() - t0
        self.borrow.measure(layer, len(groups.order), seconds)
        return out, seconds


def _host_pool():
    """The one-thread pool that runs a split's host experts beside the device part."""
    return ThreadPoolExecutor(1, thread_name_prefix="host-experts", initializer=use_chosen_threads)
