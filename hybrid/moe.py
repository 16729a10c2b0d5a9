"""The MoE block, written once: route (top-k), run the chosen experts, combine.

With an `ExpertSplit`, each (token, expert) pair runs where its expert lives: pairs of resident
experts as one grouped launch on the device backend, the others on the host backend at the
same time: the host part starts in a worker thread, the device part is queued meanwhile, then
both are waited for and combined. A decode token (one row) never makes the calling thread wait
for the device part: the device finds its resident pairs from the routing it holds, so that part
is queued first (one graph launch) and the host part goes through the decode relay by default
(hybrid/relay.py: the device posts the routing to a host worker and waits on the device for its rows,
so the calling thread does not wait at all); with the relay off, the host part fetches the routing and
runs the others (in the calling thread, or in the worker with `decode_host_thread` on). Prefill borrow: for a large chunk, a
non-resident expert many tokens use may be cheaper to copy to the device and run there; a cost
model (`plan_borrow`) from the device's measured copy speed and the host's measured expert speed
decides per expert, balancing the two sides. STRATA_PREFILL_CPU_SHARE (0..1) instead keeps that
share of the non-resident pair rows (the least-used experts) on the host.
Shape legend: T tokens, H hidden, E experts, K experts per token, N pairs, G experts with pairs,
F expert width.
"""
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cpu_kernels.sync import LINE, ticks_per_second
from cpu_kernels.target import use_chosen_threads

from .relay import HostRelay, Mailbox

log = logging.getLogger(__name__)

BORROW_MIN_TOKENS = 32  # chunks of fewer tokens never borrow
HOST_FLOPS_DEFAULT = 2e11  # the host's expert FLOP/s until measured
HOST_FLOPS_MIN_ROWS = 256  # host calls of at least this many pair rows update the measured speed
# Python's thread switch interval while a split is alive. The host part's worker needs the GIL for
# a moment between its compiled calls while the calling thread queues the device part in Python;
# at the default 5 ms each such hand-over could wait for the whole queuing, serialising the two.
GIL_SWITCH_S = 5e-5
# The decode relay's default (STRATA_DECODE_RELAY=0 turns it off). On the H100 host (16-layer Q4_K_M, two runs) it
# met the overlap target (median step / max 1.01-1.03, inline 1.27-1.70) and decoded faster at 50 and 75 % resident
# (+2 to +34 %), slower with no expert resident (-9 and -14 %): bench/results/gpu_model.md, session 23.
RELAY_BY_DEFAULT = True


@dataclass
class PairGroups:
    """(token, expert) pairs sorted by expert: pair order[i] = t * K + j; group g holds rows
    row_starts[g]:row_starts[g+1], all of expert expert_ids[g]."""

    order: np.ndarray  # int64 [N]
    expert_ids: np.ndarray  # int64 [G]
    row_starts: np.ndarray  # int64 [G+1]

    def __iter__(self):
        return iter((self.order, self.expert_ids, self.row_starts))

    @property
    def num_groups(self):
        return len(self.expert_ids)

    def select(self, keep):
        """The groups where keep bool [G] is set, rows renumbered from 0."""
        sizes = np.diff(self.row_starts)[keep]  # [G']
        rows = np.repeat(keep, np.diff(self.row_starts))  # [N]
        return PairGroups(self.order[rows], self.expert_ids[keep], np.concatenate([[0], np.cumsum(sizes)]))


class ExpertSplit:
    """Runs each layer's pairs on `device` (resident and borrowed experts) and `host` (the rest) at once.

    resident: bool [L, E], the experts the device holds (updated in place by a dynamic cache).
    cpu_share: see the module note (None: STRATA_PREFILL_CPU_SHARE, unset = the cost model alone).
    trace: set to a list to record per layer {layer, tokens, cpu_s, gpu_s, queue_s, step_s, borrowed}
    (queue_s: host time spent queuing the device part).
    host_thread: run a prompt chunk's host part in a worker thread, while the calling thread queues the
    device part, rather than in the calling thread.
    decode_host_thread: the same for a decode token, off by default: its device part is queued first (one
    graph a layer), so the calling thread would only wait for the worker, and the hand-over cost more than
    it hid (H200, 50 % resident: 44.8 tok/s with the worker, 51.9 inline; bench/results/gpu_model.md).
    compiled_host_decode: a decode token's host part as one compiled call (CpuBackend.host_decode_experts: the pair
    selection and grouping too) rather than NumPy bookkeeping and grouped_experts; bit-identical, on where the host
    has it.
    decode_relay: a decode token's host part through the relay (hybrid/relay.py): the calling thread never waits
    inside the step; the device and a host worker hand the routing and the rows over through mapped memory.
    STRATA_DECODE_RELAY (RELAY_BY_DEFAULT), used where both sides have it. Its trace is read at finish_step, step_s
    from the device's clock (routing posted to host rows added).
    relay_tokens: the most tokens of a decode step (several users' tokens decoded together) that go through the
    relay, their resident pairs found by the device too (STRATA_DECODE_RELAY_TOKENS, 1 by default: a step of
    more tokens fetches its routing and runs as a prompt chunk does).
    relay_threads: Numba threads of the relay worker's experts (STRATA_RELAY_THREADS; None: set_threads' count).
    While the calling thread queues a step's first layers it takes a core, and a parallel region of every core
    then waits on the thread that shares one; fewer threads leave it a core.
    """

    def __init__(self, host, resident, cpu_share=None):
        self.host, self.resident = host, np.asarray(resident, dtype=bool)
        self.cpu_share = _cpu_share_from_env() if cpu_share is None else cpu_share
        self.host_flops = HOST_FLOPS_DEFAULT
        self.trace = None
        self.host_thread = True
        self.decode_host_thread = False
        self.compiled_host_decode = hasattr(host, "host_decode_experts")
        self._pool = _host_pool()
        self._deferred = []  # (layer, queued routing copy) to record at finish_step
        self._deferred_host = []  # (layer, routing ids [1, K] on the host) of decode layers, to record at finish_step
        self.decode_relay = _relay_from_env()
        self.relay_threads = relay_threads_from_env()
        self.relay_tokens = relay_tokens_from_env()
        self._relay, self._relay_ready = None, set()  # a HostRelay, made at the first relayed layer
        self._relayed = []  # (layer, pending device part, queuing seconds, tokens) of the relayed layers
        self._step = 0  # the step's number, posted on the relay's flags
        if sys.getswitchinterval() > GIL_SWITCH_S:
            sys.setswitchinterval(GIL_SWITCH_S)

    def close(self):
        """Stop the threads this split started (the host-experts pool, the relay's worker); a later layer starts
        them again."""
        if self._relay is not None:
            self._relay.close()
            self._relay, self._relay_ready = None, set()
        self._pool.shutdown(wait=True)
        self._pool = _host_pool()

    def run(self, device, layer, h, ids, weights, usage=None):
        """The layer's expert mixture [T, H]; `usage` (an ExpertUsage) records the routing."""
        batch = len(h) > 1 and self._relays_batch(device, len(h), ids.shape[1])
        if (len(h) == 1 or batch) and self._relays(device) and not self.resident[layer.index].all():
            relay = self._relay_for(device, layer, h.shape[1], ids.shape[1])
            if relay is not None:
                return self._run_relay(device, relay, layer, h, ids, weights)
        if self.trace is not None:
            device.synchronize()  # time this layer's expert work alone
        if hasattr(device, "submit_decode_experts") and (len(h) == 1 or batch and self.resident[layer.index].all()):
            return self._run_decode(device, layer, h, ids, weights, usage)
        t0 = time.perf_counter()
        ids_host, weights_host = device.fetch_routing(ids, weights)  # [T, K] each
        if usage is not None:
            usage.record(layer.index, ids_host)
        groups = PairGroups(*self.host.group_pairs(ids_host, self.resident.shape[1]))
        on_device = self.resident[layer.index][groups.expert_ids]  # [G]
        device_groups, host_groups = groups.select(on_device), groups.select(~on_device)
        borrowed = None
        if host_groups.num_groups and device.prefill_borrow and len(ids_host) >= BORROW_MIN_TOKENS:
            keep = self.plan_borrow(layer, host_groups, device.borrow_bytes_per_second)  # [G_host]
            borrowed, host_groups = host_groups.select(~keep), host_groups.select(keep)
        host_part, rows = None, device.fetch_rows(h) if host_groups.num_groups else None  # [T, H] queued
        if rows is not None and self.host_thread:  # the host starts first: queuing the device part takes time
            host_part = self._pool.submit(self._run_host, layer, device.wait_rows(rows), weights_host, host_groups)
        pending, queue_s = None, 0.0
        try:
            if device_groups.num_groups or (borrowed is not None and borrowed.num_groups):
                t_queue = time.perf_counter()
                pending = device.submit_experts(layer, h, ids, weights, device_groups, borrowed)
                queue_s = time.perf_counter() - t_queue
        finally:
            host_out, cpu_s = host_part.result() if host_part is not None else (None, 0.0)
        if rows is not None and not self.host_thread:
            host_out, cpu_s = self._run_host(layer, device.wait_rows(rows), weights_host, host_groups)
        out = device.wait_experts(pending) if pending is not None else device.zeros_like(h)  # [T, H]
        if host_out is not None:
            out = device.add_from_host(out, host_out)
        self._traced(device, layer, len(ids_host), t0, pending, cpu_s, queue_s,
                     0 if borrowed is None else borrowed.num_groups)
        return out

    def _run_decode(self, device, layer, h, ids, weights, usage):
        """One token (or a relayed step's tokens, in a fully resident layer): the device resolves which of its pairs
        are resident from the routing it holds, so the calling thread only queues; the worker fetches the routing
        and runs the rest."""
        t0 = time.perf_counter()
        if self.resident[layer.index].all():  # nothing for the host: no wait for the routing at all
            if usage is not None:
                self._deferred.append((layer.index, device.queue_ids(ids, f"ids.{layer.index}")))
            pending = device.submit_decode_experts(layer, h, ids, weights)
            self._traced(device, layer, len(h), t0, pending)
            return device.wait_experts(pending)
        routing = device.queue_routing(ids, weights, h)
        pending, queue_s = None, 0.0
        if self.resident[layer.index].any():  # queued first: its launches are one graph, and the worker
            t_queue = time.perf_counter()  # then runs without this thread contending for the GIL
            pending = device.submit_decode_experts(layer, h, ids, weights)
            queue_s = time.perf_counter() - t_queue
        if self.decode_host_thread:
            host_out, cpu_s = self._pool.submit(self._run_host_decode, device, layer, routing, usage).result()
        else:
            host_out, cpu_s = self._run_host_decode(device, layer, routing, usage)
        out = device.wait_experts(pending) if pending is not None else device.zeros_like(h)  # [1, H]
        if host_out is not None:
            out = device.add_from_host(out, host_out)
        self._traced(device, layer, 1, t0, pending, cpu_s, queue_s)
        return out

    def _relays(self, device):
        """Whether decode tokens go through the relay: asked for, and both sides have it."""
        return self.decode_relay and hasattr(device, "publish_decode") and hasattr(self.host, "relay_decode_experts")

    def _relays_batch(self, device, num_tokens, top_k):
        """Whether a step of num_tokens > 1 tokens goes the decode way (the relay, the device's own pair tiles):
        at most relay_tokens of them, and no more pairs than the device's tiles take."""
        return (num_tokens <= self.relay_tokens and self._relays(device)
                and num_tokens * top_k <= getattr(device, "max_decode_pairs", num_tokens * top_k))

    def _run_relay(self, device, relay, layer, h, ids, weights):
        """A decode step's n tokens (one, or up to relay_tokens) through the decode relay (hybrid/relay.py): the
        calling thread only queues. Usage and trace are read at finish_step, once the step's results are in."""
        t0 = time.perf_counter()
        device.publish_decode(layer, h, ids, weights, relay.mailbox, self._step)
        relay.submit(layer, self._step, self.resident[layer.index], len(h))
        pending = None
        if self.resident[layer.index].any():
            pending = device.submit_decode_experts(layer, h, ids, weights)
        out = device.wait_experts(pending) if pending is not None else device.zeros_like(h)  # [n, H]
        out = device.await_host_rows(out, layer, relay.mailbox, self._step, relay.timeout_s)
        self._relayed.append((layer, pending, time.perf_counter() - t0, len(h)))
        return out

    def _relay_for(self, device, layer, hidden, top_k):
        """The relay (made at the first relayed layer, again if the shapes change), its host side of `layer`
        compiled and run once on a scratch mailbox first: the device must not wait through a compilation.
        None (logged, the relay off) where the device has no mailbox."""
        num_layers, max_tokens = self.resident.shape[0], max(1, self.relay_tokens)
        if self._relay is None or not self._relay.mailbox.fits(num_layers, top_k, hidden, max_tokens):
            if self._relay is not None:
                self._relay.close()
            mailbox = device.decode_mailbox(num_layers, top_k, hidden, max_tokens)
            if mailbox is None:
                log.warning("decode relay off: the device cannot read and write host memory directly here")
                self.decode_relay, self._relay = False, None
                return None
            self._relay = HostRelay(self.host, mailbox)
            self._relay_ready = set()
        self._relay.threads = self.relay_threads
        if layer.index not in self._relay_ready:
            self._relay.wait_idle()  # the worker's compiled calls and these never run at once
            scratch = Mailbox.allocate(num_layers, top_k, hidden)
            scratch.inbox[layer.index, :top_k] = np.arange(top_k, dtype=np.int32).view(np.float32)
            scratch.flags_in[layer.index * LINE] = 1
            self.host.relay_decode_experts(layer, scratch, 1, np.zeros_like(self.resident[layer.index]),
                                           self._relay.limit_ticks)
            self._relay_ready.add(layer.index)
        return self._relay

    def _finish_relay(self, device, usage):
        """After a step's logits: the relayed layers' results; raises if any layer's host rows were missing."""
        relayed, self._relayed = self._relayed, []
        results = self._relay.collect()
        device.synchronize()
        mailbox = self._relay.mailbox
        problems = [r.problem() for r in results if r.problem() is not None]
        failed = mailbox.device_error()
        if failed is not None:
            mailbox.clear_error()
            problems.append(f"layer {failed[1]}: the device waited {self._relay.timeout_s:.0f} s for the host "
                            f"rows of step {failed[0]} and gave up")
        if problems:
            raise RuntimeError("decode relay: " + "; ".join(problems))
        if usage is not None:
            for layer, _, _, num_tokens in relayed:
                usage.record(layer.index, mailbox.routing_ids(layer.index, num_tokens))
        if self.trace is not None:
            rate = ticks_per_second() or 1.0
            for (layer, pending, queue_s, num_tokens), result in zip(relayed, results):
                start, stop = mailbox.times[layer.index]
                gpu_s = device.expert_seconds(pending) if pending is not None and device.time_experts else 0.0
                self.trace.append(dict(layer=layer.index, tokens=num_tokens, cpu_s=(result.posted - result.seen) / rate,
                                       gpu_s=gpu_s, queue_s=queue_s, step_s=(stop - start) * 1e-9, borrowed=0))

    def _traced(self, device, layer, tokens, t0, pending, cpu_s=0.0, queue_s=0.0, borrowed=0):
        """With a trace on, append this layer's timings (after the device is done with it)."""
        if self.trace is None:
            return
        device.synchronize()
        gpu_s = device.expert_seconds(pending) if pending is not None and device.time_experts else 0.0
        self.trace.append(dict(layer=layer.index, tokens=tokens, cpu_s=cpu_s, gpu_s=gpu_s, queue_s=queue_s,
                               step_s=time.perf_counter() - t0, borrowed=borrowed))

    def begin_step(self):
        """Before a forward step's layers: drop routing copies a failed step left unrecorded and stop the
        relay jobs it left waiting; the step's number for the relay's flags."""
        self._deferred, self._deferred_host, self._relayed = [], [], []
        if self._relay is not None:
            self._relay.abandon()
        self._step += 1

    def wait_host(self):
        """Before a step's logits are read: sleep until the relay's worker has answered the step's layers. A
        CUDA wait spins on a core, and while the worker's experts ran that cost them about half their speed
        (H100 host, 16 threads: 0.83 against 0.42 ms a layer at 0 % resident; bench/results/gpu_model.md)."""
        if self._relayed:
            self._relay.wait_idle()

    def finish_step(self, device, usage=None):
        """After a forward step's logits: the relayed layers' results (an error if any is missing); record
        the decode routings, those of fully resident layers (queued copies, never waited for) and those the
        host part read."""
        if self._relayed:
            self._finish_relay(device, usage)
        if usage is not None:
            for layer_index, handle in self._deferred:
                usage.record(layer_index, device.wait_rows(handle))
            for layer_index, ids in self._deferred_host:
                usage.record(layer_index, ids)
        self._deferred, self._deferred_host = [], []

    def _run_host_decode(self, device, layer, routing, usage):
        """(out [1, H] or None, seconds): the token's non-resident pairs, inline or in the worker thread."""
        ids_host, weights_host, x = device.wait_routing(routing)  # [1, K], [1, K], [1, H]
        if usage is not None:  # recorded at finish_step, off this layer's path
            self._deferred_host.append((layer.index, ids_host.astype(np.int64)))
        if self.compiled_host_decode:
            t0 = time.perf_counter()
            out, num_pairs = self.host.host_decode_experts(layer, x, ids_host, weights_host,
                                                           self.resident[layer.index])
            if num_pairs == 0:
                return None, 0.0
            seconds = time.perf_counter() - t0
            self._measure_host(layer, num_pairs, seconds)
            return out, seconds
        experts = ids_host[0].astype(np.int64)  # [K]
        slots = np.flatnonzero(~self.resident[layer.index][experts])  # pair slots j the host runs
        if len(slots) == 0:
            return None, 0.0
        order = slots[np.argsort(experts[slots], kind="stable")]  # [N], by expert; a token routes each expert once
        groups = PairGroups(order, experts[order], np.arange(len(order) + 1))
        return self._run_host(layer, x, weights_host, groups)

    def _run_host(self, layer, x, weights, groups):
        """(out [T, H], seconds): the host's pairs, in the split's worker thread (Numba releases the GIL)."""
        t0 = time.perf_counter()
        out = self.host.grouped_experts(x, weights, groups, layer.gate_exps, layer.up_exps, layer.down_exps)
        seconds = time.perf_counter() - t0
        self._measure_host(layer, len(groups.order), seconds)
        return out, seconds

    def plan_borrow(self, layer, groups, bytes_per_second):
        """keep bool [G]: True where a host group stays on the host, False where its expert is borrowed."""
        rows = np.diff(groups.row_starts)  # [G]
        if self.cpu_share is not None:
            order = np.argsort(rows, kind="stable")  # least-used first
            keep = np.zeros(len(rows), dtype=bool)
            keep[order[np.cumsum(rows[order]) <= self.cpu_share * rows.sum()]] = True
            return keep
        host_s = rows * _expert_flops_per_row(layer) / self.host_flops  # [G]
        copy_s = _expert_bytes(layer) / bytes_per_second
        keep = np.ones(len(rows), dtype=bool)
        host_total, device_total = host_s.sum(), 0.0
        for g in np.argsort(-rows, kind="stable"):  # most-used first: the largest gain per copy
            if max(host_total - host_s[g], device_total + copy_s) >= max(host_total, device_total):
                break
            keep[g] = False
            host_total, device_total = host_total - host_s[g], device_total + copy_s
        return keep

    def _measure_host(self, layer, num_rows, seconds):
        if num_rows >= HOST_FLOPS_MIN_ROWS and seconds > 0:
            self.host_flops = 0.5 * self.host_flops + 0.5 * num_rows * _expert_flops_per_row(layer) / seconds


def _expert_flops_per_row(layer):
    hidden, width = layer.gate_exps.shape[2], layer.gate_exps.shape[1]
    return 6.0 * hidden * width  # gate, up: 2 H F each; down: 2 F H


def _expert_bytes(layer):
    return sum(t.raw.nbytes // t.raw.shape[0] for t in (layer.gate_exps, layer.up_exps, layer.down_exps))


def _host_pool():
    """The one-thread pool that runs a split's host experts beside the device part."""
    return ThreadPoolExecutor(1, thread_name_prefix="host-experts", initializer=use_chosen_threads)


def relay_tokens_from_env():
    """STRATA_DECODE_RELAY_TOKENS=N: decode steps of up to N tokens go through the relay (default 1)."""
    return _count("STRATA_DECODE_RELAY_TOKENS", os.environ.get("STRATA_DECODE_RELAY_TOKENS", "1"), "token")


def relay_threads_from_env():
    """STRATA_RELAY_THREADS=N: the relay worker's experts on N Numba threads (unset: set_threads' count)."""
    value = os.environ.get("STRATA_RELAY_THREADS", "")
    return _count("STRATA_RELAY_THREADS", value, "thread") if value else None


def _count(name, value, what):
    """The count >= 1 that environment variable `name` holds as `value`; ValueError naming it otherwise."""
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value}: expected a {what} count >= 1")
    return int(value)


def _relay_from_env():
    """STRATA_DECODE_RELAY=1 hands decode tokens' host experts over through the relay (hybrid/relay.py)."""
    value = os.environ.get("STRATA_DECODE_RELAY", "1" if RELAY_BY_DEFAULT else "0")
    if value not in ("0", "1"):
        raise ValueError(f"STRATA_DECODE_RELAY={value}: expected 0 or 1")
    return value == "1"


def _cpu_share_from_env():
    value = os.environ.get("STRATA_PREFILL_CPU_SHARE")
    if value is None or value == "":
        return None
    share = float(value)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"STRATA_PREFILL_CPU_SHARE={value}: expected a number from 0 to 1")
    return share


def moe_block(backend, spec, layer, h, split=None, usage=None):
    """h [T, H] (normed hidden) -> expert mixture [T, H]; `usage`: an ExpertUsage that records the routing."""
    ids, weights = moe_routing(backend, layer, h)
    return expert_mixture(backend, layer, h, ids, weights, split, usage)


def moe_routing(backend, layer, h):
    """h [T, H] (normed hidden) -> (ids [T, K], weights [T, K]) of the experts each token uses."""
    router_logits = backend.linear(layer.router, h)  # [T, E]
    return backend.route(router_logits, layer.num_experts_per_tok, layer.norm_topk_prob)


def expert_mixture(backend, layer, h, ids, weights, split=None, usage=None):
    """The routed experts' weighted sum [T, H] for h [T, H]: through the split where there is one."""
    if split is not None:
        return split.run(backend, layer, h, ids, weights, usage)  # the split records from its host copy of ids
    if usage is not None:
        usage.record(layer.index, backend.to_host(ids))
    return backend.experts(h, ids, weights, layer.gate_exps, layer.up_exps, layer.down_exps)  # [T, H]
