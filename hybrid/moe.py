"""The MoE block's experts, written once: the routed experts' weighted sum (the router is its own
part, hybrid/blocks.py).

With an `ExpertSplit`, each (token, expert) pair runs where its expert lives: route, split the pairs
by the resident mask, submit the device part (resident and borrowed experts, one grouped launch),
run the host part (the rest) at the same time, wait for both, and combine. The two sides meet the
split through the Experts contract (hybrid/backends/base.py: submit / wait). A decode token (one
row) never makes the calling thread wait for the device part: the device finds its resident pairs
from the routing it holds, so that part is queued first, and the host part goes through the decode
relay (hybrid/moe_relay.py) where both sides have it, or fetches the routing and runs the rest.
Prefill borrow: for a large chunk, non-resident experts many tokens use may be copied to the device
and run there (placement/borrow.py decides).
Shape legend: T tokens, H hidden, E experts, K experts per token, G experts with pairs.
"""
import sys
import time

import numpy as np

from placement.borrow import BORROW_MIN_TOKENS, BorrowModel, expert_bytes

from .moe_host import HostSide
from .moe_relay import DecodeRelay
from .pair_groups import PairGroups
from .split_settings import SplitSettings

__all__ = ["ExpertSplit", "PairGroups", "SplitSettings", "expert_mixture"]

# Python's thread switch interval while a split is alive. The host part's worker needs the GIL for
# a moment between its compiled calls while the calling thread queues the device part in Python;
# at the default 5 ms each such hand-over could wait for the whole queuing, serialising the two.
GIL_SWITCH_S = 5e-5
# The most tokens of a fully resident layer's step that run as a decode step (each pair its own expert rows) rather
# than as grouped pairs (each expert's rows once for all its tokens, after a host wait for the routing).
DEVICE_DECODE_TOKENS = 16


class ExpertSplit:
    """Runs each layer's pairs on `device` (resident and borrowed experts) and `host` (the rest) at once.

    resident: bool [L, E], the experts the device holds (updated in place by a dynamic cache).
    settings: a SplitSettings (None: its defaults). host_side: the host part (hybrid/moe_host.py: its worker
    thread switches); relay: the decode relay's driver (hybrid/moe_relay.py); borrow: the borrow decision.
    trace: set to a list to record per layer {layer, tokens, cpu_s, gpu_s, queue_s, step_s, borrowed}
    (queue_s: host time spent queuing the device part; a relayed layer's is read at finish_step, step_s
    from the device's clock, routing posted to host rows added).
    """

    def __init__(self, host, resident, settings=None):
        self.settings = settings = settings or SplitSettings()
        self.host, self.resident = host, np.asarray(resident, dtype=bool)
        self.borrow = BorrowModel(settings.cpu_share)
        self.host_side = HostSide(host, self.resident, self.borrow)
        self.relay = DecodeRelay(host, settings.decode_relay, settings.relay_tokens, settings.relay_threads,
                                 settings.relay_graphs)
        self.trace = None
        self._untimed = None  # (device, layer, pending, borrowed bytes, gather s, pair rows): the last chunk layer's part
        self._deferred = []  # (layer index, queued routing copy) of fully resident decode layers, for finish_step
        self._deferred_host = []  # (layer index, routing ids [1, K] on the host) of decode layers, for finish_step
        self._deferred_step = []  # (queued copy of ids [L, K], (row, layer index) pairs) of a step graph, for finish_step
        self._step = 0  # the step's number, posted on the relay's flags
        if sys.getswitchinterval() > GIL_SWITCH_S:
            sys.setswitchinterval(GIL_SWITCH_S)

    @property
    def decode_relay(self):
        """Whether decode tokens' host parts go through the relay (where both sides have it)."""
        return self.relay.enabled

    @property
    def step_number(self):
        """The current step's number, which the relay posts on its flags."""
        return self._step

    def close(self):
        """Stop the threads this split started (the host part's worker, the relay's); a later layer starts them
        again."""
        self.relay.close()
        self.host_side.close()

    def run(self, device, layer, h, ids, weights, usage=None):
        """The layer's expert mixture [T, H]; `usage` (an ExpertUsage) records the routing."""
        num_tokens, resident = len(h), self.resident[layer.index]
        relayed = self.relay.takes(device, num_tokens, ids.shape[1]) and layer.expert_glu is None  # plain SwiGLU
        if relayed and not resident.all():
            out = self.relay.run(device, layer, h, ids, weights, self.resident, self._step)
            if out is not None:
                return out
        if self.trace is not None:
            device.synchronize()  # time this layer's expert work alone
        if device.capabilities.decode_experts and (num_tokens == 1 or resident.all() and (
                relayed or self._device_decode_fits(device, num_tokens, ids.shape[1]))):
            return self._run_decode(device, layer, h, ids, weights, usage)
        if resident.all() and device.capabilities.resident_chunks:
            return self._run_resident_chunk(device, layer, h, ids, weights, usage)
        return self._run_chunk(device, layer, h, ids, weights, usage)

    @staticmethod
    def _device_decode_fits(device, num_tokens, top_k):
        """Whether a fully resident layer's step of num_tokens tokens (several users' decode tokens, a verification
        chunk) runs as a decode step: the device finds its pairs, no routing is read back (faster than grouping the
        pairs on the host while the step is this small)."""
        limit = device.capabilities.max_decode_pairs or num_tokens * top_k
        return num_tokens <= DEVICE_DECODE_TOKENS and num_tokens * top_k <= limit

    def _run_chunk(self, device, layer, h, ids, weights, usage):
        """A prompt chunk (or a step of many tokens) with a host part: fetch the routing, split the pairs, borrow, run
        both parts."""
        t0 = time.perf_counter()
        ids_host, weights_host = device.fetch_routing(ids, weights)  # [T, K] each
        self._time_last_part()
        if usage is not None:
            usage.record(layer.index, ids_host)
        groups = PairGroups(*self.host.group_pairs(ids_host, self.resident.shape[1]))
        on_device = self.resident[layer.index][groups.expert_ids]  # [G]
        device_groups, host_groups = groups.select(on_device), groups.select(~on_device)
        borrowed = None
        if host_groups.num_groups and device.prefill_borrow and len(ids_host) >= BORROW_MIN_TOKENS:
            keep = self.borrow.plan(layer, host_groups, device.borrow_bytes_per_second,
                                    device_rows=len(device_groups.order),
                                    device_estimate=device.chunk_expert_flops(layer))  # [G_host]
            borrowed, host_groups = host_groups.select(~keep), host_groups.select(keep)
        num_borrowed, borrowed_rows = (0, 0) if borrowed is None else (borrowed.num_groups, len(borrowed.order))
        host_part, rows = None, device.fetch_rows(h) if host_groups.num_groups else None  # [T, H] queued
        if rows is not None and self.host_side.host_thread:  # the host starts first: queuing the device part takes time
            host_part = self.host_side.submit(layer, device.wait_rows(rows), ids_host, weights_host, host_groups)
        pending, queue_s, t_queue = None, 0.0, time.perf_counter()
        try:
            if device_groups.num_groups or num_borrowed:
                pending = device.submit(layer, h, ids, weights, device_groups, borrowed)
                queue_s = time.perf_counter() - t_queue
        finally:
            host_out, cpu_s = self.host_side.wait(host_part)
        if rows is not None and host_part is None:  # in this thread, after the device part is queued
            host_part = self.host_side.submit(layer, device.wait_rows(rows), ids_host, weights_host, host_groups)
            host_out, cpu_s = self.host_side.wait(host_part)
        out = self._combine(device, h, pending, host_out)
        if pending is not None:  # timed once the device is past it (the next chunk layer's routing): no wait here
            self._untimed = (device, layer, pending, num_borrowed * expert_bytes(layer), queue_s if num_borrowed else 0.0,
                             len(device_groups.order) + borrowed_rows)
        self._traced(device, layer, len(ids_host), t0, pending, cpu_s, queue_s, num_borrowed)
        return out

    def _run_resident_chunk(self, device, layer, h, ids, weights, usage):
        """A prompt chunk of a layer whose experts are all on the device: the device groups the pairs itself, so the
        calling thread only queues (no routing read back, no wait); the routing is recorded at finish_step."""
        t0 = time.perf_counter()
        if usage is not None:
            self._deferred.append((layer.index, device.queue_ids(ids, f"ids.{layer.index}")))
        pending = device.submit_resident_chunk(layer, h, ids, weights)
        self._traced(device, layer, len(h), t0, pending)
        return device.wait(pending)

    def _run_decode(self, device, layer, h, ids, weights, usage):
        """One token (or a small step's tokens in a fully resident layer): the device resolves which of its pairs
        are resident from the routing it holds, so the calling thread only queues; the host part fetches the
        routing and runs the rest."""
        t0, resident = time.perf_counter(), self.resident[layer.index]
        if resident.all():  # nothing for the host: no wait for the routing at all
            if usage is not None:
                self._deferred.append((layer.index, device.queue_ids(ids, f"ids.{layer.index}")))
            pending = device.submit(layer, h, ids, weights)
            self._traced(device, layer, len(h), t0, pending)
            return device.wait(pending)
        routing = device.queue_routing(ids, weights, h)
        pending, queue_s = None, 0.0
        if resident.any():  # queued first: its launches are one graph, and the host part
            t_queue = time.perf_counter()  # then runs without this thread contending for the GIL
            pending = device.submit(layer, h, ids, weights)
            queue_s = time.perf_counter() - t_queue
        ids_host, weights_host, x = device.wait_routing(routing)  # [1, K], [1, K], [1, H]
        if usage is not None:  # recorded at finish_step, off this layer's path
            self._deferred_host.append((layer.index, ids_host.astype(np.int64)))
        host_out, cpu_s = self.host_side.wait(self.host_side.submit(layer, x, ids_host, weights_host))
        out = self._combine(device, h, pending, host_out)
        self._traced(device, layer, 1, t0, pending, cpu_s, queue_s)
        return out

    def _time_last_part(self):
        """Fold the last chunk layer's device part, which its device is past, into the borrow model: its GPU time,
        borrowed copies included (the caller waiting for it would also count the host part and the upload)."""
        if self._untimed is None:
            return
        device, layer, pending, borrowed_bytes, gather_s, num_rows = self._untimed
        self._untimed = None
        seconds = device.chunk_part_seconds(pending)
        if seconds is not None:
            self.borrow.measure_device(layer, num_rows, seconds, borrowed_bytes, gather_s, device.borrow_bytes_per_second)

    @staticmethod
    def _combine(device, h, pending, host_out):
        """The device part's rows (zeros where it had no pairs) plus the host part's [T, H]."""
        out = device.wait(pending) if pending is not None else device.zeros_like(h)  # [T, H]
        return out if host_out is None else device.add_from_host(out, host_out)

    def _traced(self, device, layer, tokens, t0, pending, cpu_s=0.0, queue_s=0.0, borrowed=0):
        """With a trace on, append this layer's timings (after the device is done with it)."""
        if self.trace is None:
            return
        device.synchronize()
        gpu_s = device.expert_seconds(pending) if pending is not None and device.time_experts else 0.0
        self.trace.append(dict(layer=layer.index, tokens=tokens, cpu_s=cpu_s, gpu_s=gpu_s, queue_s=queue_s,
                               step_s=time.perf_counter() - t0, borrowed=borrowed))

    def begin_step(self):
        """Before a forward step's layers: drop routing copies a failed step left unrecorded and stop the relay
        jobs it left waiting; the step's number for the relay's flags."""
        self._deferred, self._deferred_host, self._deferred_step = [], [], []
        self.relay.begin_step()
        self._step += 1

    def wait_host(self):
        """Before a step's logits are read: sleep until the relay's worker has answered the step's layers."""
        self.relay.wait_idle()

    def finish_step(self, device, usage=None):
        """After a forward step's logits: the relayed layers' results (an error if any is missing); record the
        decode routings, those of fully resident layers (queued copies, never waited for) and the host part's."""
        self.relay.finish(device, usage, self.trace)
        if usage is not None:
            for layer_index, handle in self._deferred:
                usage.record(layer_index, device.wait_rows(handle))
            for layer_index, ids in self._deferred_host:
                usage.record(layer_index, ids)
            for handle, layers in self._deferred_step:
                rows = device.wait_rows(handle)  # [L, n, K]
                for row, layer_index in layers:
                    usage.record(layer_index, rows[row])
        self._deferred, self._deferred_host, self._deferred_step = [], [], []

    def defer_step_routing(self, handle, layers):
        """A step graph's routing ids [L, n, K] (a queued copy) of `layers` ((row, layer index) pairs), recorded at
        finish_step."""
        self._deferred_step.append((handle, layers))


def expert_mixture(backend, layer, h, ids, weights, split=None, usage=None):
    """The routed experts' weighted sum [T, H] for h [T, H]: through the split where there is one."""
    if split is not None:
        return split.run(backend, layer, h, ids, weights, usage)  # the split records from its host copy of ids
    if usage is not None:
        usage.record(layer.index, backend.to_host(ids))
    return backend.experts(h, ids, weights, layer.gate_exps, layer.up_exps, layer.down_exps, layer.expert_glu)
