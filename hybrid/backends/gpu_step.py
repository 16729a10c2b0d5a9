"""A whole decode step of one-token chunks as one graph (hybrid/runners.py GraphRunner), where nothing in it needs the
host: one sequence's next token, or several users' at once (the serving engine's decode batch, one chunk a slot).

With every expert of every layer resident, a decode step's launches take no number the host must
supply once the positions are on the device: the KV writes and the attention read each chunk's there
(gpu_kernels/src/kv.cu start_at), RoPE already does, and the experts find their pairs from the
routing the device holds. So the step is captured once and replayed with one launch, instead of a
few graphs and single launches a layer with the host in between. The attention's key splits are
planned for a bound on the positions (a power of two from KEYS_MIN), so a graph serves every step of
its token count until a sequence passes it, and is then captured again. The graphs read each chunk's block table
from a buffer of their own (one a chunk, the i-th chunk's i-th), copied in before each step, so a graph serves every
set of sequences (a new request does not capture again) unless the sequence has state of its own that the graph
reads in place (a recurrent state: such a step has one chunk).
Shape legend: L layers, n chunks (one token each), K top-k.
"""
import numpy as np

from ..step_graph import MAX_STEP_TOKENS

KEYS_MIN = 256  # the smallest bound a step graph's attention is planned for


def keys_bound(start):
    """The bound, a power of two from KEYS_MIN, on the keys a one-token step at position `start` attends."""
    bound = KEYS_MIN
    while bound <= start:
        bound *= 2
    return bound


class StepSlots:
    """The step being queued: the chunks' positions int64 [n] on the device, the keys bound, the block tables int32
    [MAX_STEP_TOKENS, nb] (the i-th chunk's in row i), and where a chunk (its sequence and start) finds its row and
    its position (a view of positions [1])."""

    def __init__(self, positions, bound, chunks, tables):
        self.positions, self.bound, self.tables = positions, bound, tables
        self._slot = {(id(chunk.kv), chunk.start): i for i, chunk in enumerate(chunks)}

    def slot(self, kv, start):
        """(block table int32 [nb], position int64 [1]) on the device of the chunk of `kv` at `start`."""
        i = self._slot[(id(kv), start)]
        return self.tables[i], self.positions[i:i + 1]


class StepCapture:
    """The GPU backend's state for step graphs: while a step is queued for capture, `active` is its StepSlots;
    `routing[n]` int32 [L, n, K] gets each layer's routing ids inside the n-chunk graphs, read back once a step for
    the usage record. The backend comes with each call (no back-reference: see gpu_layer_graphs.LayerGraphs)."""

    def __init__(self):
        self.active = None
        self.routing = {}  # n -> int32 [L, n, K] on the device
        self.tables = None  # int32 [MAX_STEP_TOKENS, nb] on the device: the i-th chunk's block table in row i
        self.version = 0  # bumped when `tables` is replaced: graphs of an older one are never launched again

    def graph_key(self, chunks, bound):
        """The key of the step graph that serves `chunks` at `bound` keys: shared by every set of sequences of that
        size, except one with a recurrent state of its own."""
        kv = chunks[0].kv
        return ("step", len(chunks), bound, self.version, None if kv.recurrent is None else id(kv))

    def prepare(self, be, chunks, num_layers, top_k):
        """The keys bound of a step graph over `chunks` (one token each), or None where this step needs the host
        (timed experts, a KV with a part in RAM, several chunks with a recurrent state). Queues the copies of the
        chunks' block tables into `tables`, which the graphs read (a longer table gets a new array, and so new
        graphs)."""
        if be.time_experts or any(c.kv.host_blocks or c.kv.resident_blocks is not None for c in chunks):
            return None
        if len(chunks) > 1 and any(c.kv.recurrent is not None for c in chunks):
            return None
        n, longest = len(chunks), max(len(c.kv.table) for c in chunks)
        if self.tables is None or self.tables.shape[1] < longest:
            self.tables, self.version = be.rt.empty((MAX_STEP_TOKENS, longest), np.int32), self.version + 1
        host = be.staging.view("step_tables", (n, self.tables.shape[1]), np.int32)  # [n, nb], one copy for all
        for i, chunk in enumerate(chunks):
            host[i, :len(chunk.kv.table)] = chunk.kv.table  # entries past a table's end: never read
        be.rt.copy_from_host_async(self.tables[:n], host, be.stream)
        be.staging.queued("step_tables", be.stream)
        if n not in self.routing or self.routing[n].shape != (num_layers, n, top_k):
            self.routing[n] = be.rt.zeros((num_layers, n, top_k), np.int32)
        return keys_bound(max(chunk.start for chunk in chunks))

    def begin(self, positions, bound, chunks):
        """Until end(), the KV writes and attention of `chunks` read their positions from `positions` (int64 [n] on
        the device) and plan for `bound` keys, and the experts queue their launches into the step's graph."""
        self.active = StepSlots(positions, bound, chunks, self.tables)

    def end(self):
        self.active = None

    def keep_routing(self, be, layer_index, ids):
        """Queue a copy of a layer's routing ids int32 [n, K] into its row of `routing[n]`."""
        be.rt.copy_on_device_async(self.routing[ids.shape[0]][layer_index], ids, be.stream)

    def queue_routing(self, be, n):
        """A queued host copy of `routing[n]` [L, n, K]: (pinned view, event), as GpuBackend.queue_ids gives."""
        return be.staging.download(f"ids.step.{n}", self.routing[n], be.stream)
