"""The host side of the hybrid split: the pairs of the experts the device does not hold, run by the host
backend beside the device part (in a worker thread, or in the calling thread).
Shape legend: T tokens, H hidden, K experts per token, N pairs."""
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from cpu_kernels.target import use_chosen_threads

from .pair_groups import PairGroups


class HostSide:
    """host: the host backend (hybrid/backends/base.py HostExperts); borrow: the split's placement.borrow.BorrowModel,
    told the speed of each large host call.

    host_thread: run a prompt chunk's host part in a worker thread, while the calling thread queues the device part,
    rather than in the calling thread.
    decode_host_thread: the same for a decode token, off by default: its device part is queued first (one graph a
    layer), so the calling thread would only wait for the worker, and the hand-over costs more than it hides
    (bench/results/gpu_model.md).
    compiled_host_decode: a decode token's host part as one compiled call (the host's host_decode_experts: the pair
    selection and grouping too) rather than NumPy bookkeeping and grouped_experts; bit-identical, on where the host
    has it."""

    def __init__(self, host, borrow):
        self.host, self.borrow = host, borrow
        self.host_thread, self.decode_host_thread = True, False
        self.compiled_host_decode = host.capabilities.host_decode_experts
        self._pool = _host_pool()

    def close(self):
        """Stop the worker thread; a later submit starts a new one."""
        self._pool.shutdown(wait=True)
        self._pool = _host_pool()

    def submit(self, device, layer, rows, weights, groups):
        """Start the pairs of `groups` of a layer (rows: the device's queued host copy of its hidden [T, H],
        weights [T, K] on the host): in the worker where host_thread is on, else when waited for."""
        if self.host_thread:
            return self._pool.submit(self._run, layer, device.wait_rows(rows), weights, groups)
        return lambda: self._run(layer, device.wait_rows(rows), weights, groups)

    def submit_decode(self, device, layer, routing, resident, record):
        """Start a decode token's non-resident pairs (resident bool [E]) once its routing (device.queue_routing) is
        in; record(ids), where given, gets its ids int64 [1, K] on the host."""
        if self.decode_host_thread:
            return self._pool.submit(self._run_decode, device, layer, routing, resident, record)
        return self._run_decode(device, layer, routing, resident, record)

    @staticmethod
    def wait(pending):
        """(out [T, H] or None where the host had no pairs, seconds) of a submitted part (None: nothing)."""
        if pending is None:
            return None, 0.0
        if isinstance(pending, Future):
            return pending.result()
        return pending() if callable(pending) else pending

    def _run_decode(self, device, layer, routing, resident, record):
        ids_host, weights_host, x = device.wait_routing(routing)  # [1, K], [1, K], [1, H]
        if record is not None:
            record(ids_host.astype(np.int64))
        if self.compiled_host_decode:
            t0 = time.perf_counter()
            out, num_pairs = self.host.host_decode_experts(layer, x, ids_host, weights_host, resident)
            if num_pairs == 0:
                return None, 0.0
            seconds = time.perf_counter() - t0
            self.borrow.measure(layer, num_pairs, seconds)
            return out, seconds
        experts = ids_host[0].astype(np.int64)  # [K]
        slots = np.flatnonzero(~resident[experts])  # pair slots j the host runs
        if len(slots) == 0:
            return None, 0.0
        return self._run(layer, x, weights_host, PairGroups.of_slots(experts, slots))

    def _run(self, layer, x, weights, groups):
        """(out [T, H], seconds): the host's pairs (Numba releases the GIL in a worker)."""
        t0 = time.perf_counter()
        out = self.host.grouped_experts(x, weights, groups, layer.gate_exps, layer.up_exps, layer.down_exps)
        seconds = time.perf_counter() - t0
        self.borrow.measure(layer, len(groups.order), seconds)
        return out, seconds


def _host_pool():
    """The one-thread pool that runs a split's host experts beside the device part."""
    return ThreadPoolExecutor(1, thread_name_prefix="host-experts", initializer=use_chosen_threads)
