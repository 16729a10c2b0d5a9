"""The split's side of the decode relay (hybrid/relay.py): when a decode step's layers go through it, the
relay made and warmed per layer, each relayed layer queued, and the step's results read once its logits are.
Shape legend: T tokens, H hidden, K experts per token, n a relayed step's tokens."""
import logging
import time

import numpy as np

from cpu_kernels.sync import LINE, ticks_per_second

from .relay import HostRelay, Mailbox

log = logging.getLogger(__name__)


class DecodeRelay:
    """host: the split's host backend. enabled: decode tokens' host parts go through the relay, where both sides
    have it (hybrid/split_settings.py decode_relay); tokens: the most tokens of a relayed step (relay_tokens);
    threads: the worker's Numba threads (relay_threads); graphs: a decode step with relayed layers may be one device
    graph (relay_graphs: hybrid/step_graph.py). worker: the HostRelay, made at the first relayed layer."""

    def __init__(self, host, enabled=True, tokens=1, threads=None, graphs=False):
        self.host, self.enabled, self.tokens, self.threads, self.graphs = host, enabled, tokens, threads, graphs
        self.worker, self._ready = None, set()  # the layers whose host side ran once on a scratch mailbox
        self.version = 0  # bumped with each new mailbox: a graph that posts to an older one is not launched again
        self._relayed = []  # (layer, pending device part, queuing seconds, tokens) of this step's relayed layers
        self._ahead = False  # the step's host jobs were submitted before its layers were queued (a step graph)
        self._graphed = False  # this step's relayed layers ran in a step graph (submit_step)

    def close(self):
        if self.worker is not None:
            self.worker.close()
            self.worker, self._ready = None, set()

    def takes(self, device, num_tokens, top_k):
        """Whether a decode step of num_tokens tokens goes through the relay: asked for, both sides have it, at most
        `tokens` of them, and (more than one) no more pairs than the device's decode tiles take."""
        caps = device.capabilities
        if not (self.enabled and caps.decode_relay_device and self.host.capabilities.decode_relay_host):
            return False
        limit = caps.max_decode_pairs or num_tokens * top_k
        return num_tokens == 1 or (num_tokens <= self.tokens and num_tokens * top_k <= limit)

    def graph_layers(self, device, layers, resident, num_tokens, hidden, top_k):
        """The layers a decode step of num_tokens tokens relays (those with experts not all resident), where that step
        may be one device graph: graphs on, the relay taking the step, every relayed layer's experts plain SwiGLU,
        the worker alive and each layer's host side compiled (a graph must never wait through a compilation). None
        where it may not."""
        if resident.all():
            return []
        if not (self.graphs and self.takes(device, num_tokens, top_k)):  # one check a step where graphs are off
            return None
        relayed = [layer for layer in layers if layer.gate_exps is not None and not resident[layer.index].all()]
        if any(layer.expert_glu is not None for layer in relayed):
            return None
        if any(self._worker_for(device, layer, resident, hidden, top_k) is None for layer in relayed):
            return None
        return relayed if not relayed or self.worker.alive else None

    def submit_step(self, device, relayed, resident, step, num_tokens):
        """Before a step graph that relays `relayed` (graph_layers') is launched, or queued for its first run: the
        step number where the device's relay kernels read it, then every layer's host job, so that each wait the
        graph makes on the host will be answered. The layers' run() calls until end_step only queue device work."""
        device.relay_step(step)
        for layer in relayed:
            self.worker.submit(layer, step, resident[layer.index], num_tokens)
            self._relayed.append((layer, None, 0.0, num_tokens))
        self._ahead = self._graphed = True

    def end_step(self):
        """After a step graph's launch (or its failure): run() submits its own jobs again."""
        self._ahead = False

    def run(self, device, layer, h, ids, weights, resident, step):
        """A decode step's n tokens through the relay (resident: the split's bool [L, E]): the calling thread only
        queues; usage and trace are read at finish. None (the relay turned off) where the device has no mailbox.
        Inside a step graph's queuing (submit_step) the layer's host job is already submitted."""
        worker = self.worker if self._ahead else self._worker_for(device, layer, resident, h.shape[1], ids.shape[1])
        if worker is None:
            return None
        t0 = time.perf_counter()
        device.publish_decode(layer, h, ids, weights, worker.mailbox, step)
        if not self._ahead:
            worker.submit(layer, step, resident[layer.index], len(h))
        pending = device.submit(layer, h, ids, weights) if resident[layer.index].any() else None
        out = device.wait(pending) if pending is not None else device.empty(h.shape)  # [n, H]
        out = device.await_host_rows(out, layer, worker.mailbox, step, worker.timeout_s, add=pending is not None)
        if not self._ahead:
            self._relayed.append((layer, pending, time.perf_counter() - t0, len(h)))
        return out

    def _worker_for(self, device, layer, resident, hidden, top_k):
        """The worker (made again if the shapes change), its host side of `layer` compiled and run once on a
        scratch mailbox first: the device must not wait through a compilation. None (logged, the relay off)
        where the device has no mailbox."""
        num_layers, max_tokens = resident.shape[0], max(1, self.tokens)
        if self.worker is None or not self.worker.mailbox.fits(num_layers, top_k, hidden, max_tokens):
            if self.worker is not None:
                self.worker.close()
            mailbox = device.decode_mailbox(num_layers, top_k, hidden, max_tokens)
            if mailbox is None:
                log.warning("decode relay off: the device cannot read and write host memory directly here")
                self.enabled, self.worker = False, None
                return None
            self.worker, self._ready = HostRelay(self.host, mailbox), set()
            self.version += 1
        self.worker.threads = self.threads
        if layer.index not in self._ready:
            self.worker.wait_idle()  # the worker's compiled calls and these never run at once
            scratch = Mailbox.allocate(num_layers, top_k, hidden)
            scratch.inbox[layer.index, :top_k] = np.arange(top_k, dtype=np.int32).view(np.float32)
            scratch.flags_in[layer.index * LINE] = 1
            self.host.relay_decode_experts(layer, scratch, 1, np.zeros_like(resident[layer.index]),
                                           self.worker.limit_ticks)
            self._ready.add(layer.index)
        return self.worker

    def begin_step(self):
        """Before a step's layers: stop the jobs a failed step left waiting."""
        self._relayed, self._ahead, self._graphed = [], False, False
        if self.worker is not None:
            self.worker.abandon()

    def wait_idle(self):
        """Sleep until the worker has answered the step's layers: a device wait spins on a core, and while the
        worker's experts ran that cost them about half their speed (bench/results/gpu_model.md)."""
        if self._relayed:
            self.worker.wait_idle()

    def finish(self, device, usage, trace):
        """After a step's logits: the relayed layers' results, their routing recorded in usage and timings appended
        to trace (where given); RuntimeError if any layer's host rows were missing."""
        if not self._relayed:
            return
        relayed, self._relayed, graphed, self._graphed = self._relayed, [], self._graphed, False
        results = self.worker.collect()
        device.synchronize()
        mailbox = self.worker.mailbox
        problems = [r.problem() for r in results if r.problem() is not None]
        failed = mailbox.device_error()
        if failed is not None:
            mailbox.clear_error()
            problems.append(f"layer {failed[1]}: the device waited {self.worker.timeout_s:.0f} s for the host "
                            f"rows of step {failed[0]} and gave up")
        if problems:
            raise RuntimeError("decode relay: " + "; ".join(problems))
        if usage is not None and not graphed:  # a step graph keeps every layer's routing itself (step_graph.py)
            for layer, _, _, num_tokens in relayed:
                usage.record(layer.index, mailbox.routing_ids(layer.index, num_tokens))
        if trace is not None:
            rate = ticks_per_second() or 1.0
            last_posted = None
            for (layer, pending, queue_s, num_tokens), result in zip(relayed, results):
                start, stop = mailbox.times[layer.index]
                gpu_s = device.expert_seconds(pending) if pending is not None and device.time_experts else 0.0
                # wait_s: the worker's spin before the routing came (~0: it came first, the worker was late);
                # gap_s: the worker's time between the last layer's rows posted and this layer's wait
                gap_s = (result.entered - last_posted) / rate if last_posted is not None else float("nan")
                trace.append(dict(layer=layer.index, tokens=num_tokens, cpu_s=(result.posted - result.seen) / rate,
                                  gpu_s=gpu_s, queue_s=queue_s, step_s=(stop - start) * 1e-9, borrowed=0,
                                  wait_s=(result.seen - result.entered) / rate, gap_s=gap_s))
                last_posted = result.posted
