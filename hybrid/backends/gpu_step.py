"""A whole one-token decode step as one graph (hybrid/runners.py GraphRunner), where nothing in it needs the host.

With every expert of every layer resident, a decode step's launches take no number the host must
supply once the position is on the device: the KV writes and the attention read it there
(gpu_kernels/src/kv.cu start_at), RoPE already does, and the experts find their pairs from the
routing the device holds. So the step is captured once and replayed with one launch, instead of a
few graphs and single launches a layer with the host in between. The attention's key splits are
planned for a bound on the position (a power of two from KEYS_MIN), so a graph serves every step
until the sequence passes it, and is then captured again. The graphs read the stepped sequence's block table
from one buffer of their own, copied in before each step, so a graph serves every sequence (a new request
does not capture again) unless the sequence has state of its own that the graph reads in place (a recurrent
state).
Shape legend: L layers, K top-k.
"""
import numpy as np

KEYS_MIN = 256  # the smallest bound a step graph's attention is planned for


def keys_bound(start):
    """The bound, a power of two from KEYS_MIN, on the keys a one-token step at position `start` attends."""
    bound = KEYS_MIN
    while bound <= start:
        bound *= 2
    return bound


class StepCapture:
    """The GPU backend's state for step graphs: while a step is queued for capture, `active` = (position int64 [1]
    on the device, keys bound); `routing` int32 [L, K] gets each layer's routing ids inside the graph, read back
    once a step for the usage record. The backend comes with each call (no back-reference: see
    gpu_layer_graphs.LayerGraphs)."""

    def __init__(self):
        self.active = None
        self.routing = None
        self.table = None  # int32 [blocks] on the device: the stepped sequence's block table, copied in a step
        self.tables = 0  # how many `table` buffers there were: graphs of an older one are never launched again

    def graph_key(self, kv, bound):
        """The key of the step graph that serves `kv` at `bound` keys: shared by every sequence, except one with a
        recurrent state of its own."""
        return ("step", bound, self.tables, None if kv.recurrent is None else id(kv))

    def prepare(self, be, kv, start, num_layers, top_k):
        """The keys bound of a step graph at position `start` over `kv`, or None where this step needs the host
        (timed experts, a KV with a part in RAM). Queues the copy of the KV's block table into `table`, which the
        graphs read (a larger table gets a new buffer, and so new graphs)."""
        if be.time_experts or kv.host_blocks or kv.resident_blocks is not None:
            return None
        table = kv.device_table()
        if self.table is None or len(self.table) < len(kv.table):
            self.table, self.tables = be.rt.empty((len(kv.table),), np.int32), self.tables + 1
        be.rt.copy_on_device_async(self.table[:len(table)], table, be.stream)
        if self.routing is None or self.routing.shape != (num_layers, top_k):
            self.routing = be.rt.zeros((num_layers, top_k), np.int32)
        return keys_bound(start)

    def keep_routing(self, be, layer_index, ids):
        """Queue a copy of a layer's routing ids int32 [1, K] into its row of `routing`."""
        be.rt.copy_on_device_async(self.routing[layer_index:layer_index + 1], ids, be.stream)

    def queue_routing(self, be):
        """A queued host copy of `routing` [L, K]: (pinned view, event), as GpuBackend.queue_ids gives."""
        return be.staging.download("ids.step", self.routing, be.stream)
