"""The GPU backend's side of the hybrid split: a layer's resident (and borrowed) experts' pairs as one grouped
launch per projection, a decode step's resident pairs found on the device and replayed as a graph, and the
routing copies the host part needs.

Prefill borrow: experts the host would run are copied to slots in VRAM and run in the device part (the
backend's `borrow_bytes_per_second` is the measured copy speed placement/borrow.py's cost model reads).
Shape legend: T tokens, H hidden, L layers, E experts, K top-k, N pairs, P = n * K a decode step's pair slots,
F expert width, R rows, B row bytes, G groups, W work tiles.
"""
import logging

import numpy as np

from gpu_kernels.gemm import group_tiles_bound, moe_tile_tokens
from gpu_kernels.kernels import MAX_THREADS, TILE_TOKENS, fuses_glu

from .gpu_staging import Pending

log = logging.getLogger(__name__)

MAX_DECODE_PAIRS = MAX_THREADS  # a decode step's pairs at most: decode_tiles runs one thread a pair in one block
# A decode step of at least this many tokens groups its pairs by expert on the device (moe_parts.cu decode_groups) and
# runs the tiled expert matmuls, each expert's rows read once for up to TILE_TOKENS of its pairs; fewer tokens run a
# pair a work tile (the one-row kernels). None: never (the default: the tiled expert kernels made every step of 2 to
# 16 users slower on an H100, bench/results/gpu_users.md).
GROUP_DECODE_TOKENS = None
_UNCAPTURED = object()  # a layer whose decode graph was not tried yet


class GpuExperts:
    """The expert state of one GPU backend: decode scratch, captured decode graphs, borrow slots. decode_graphs:
    each layer's decode expert launches replayed as a graph (else one by one). The backend comes with each call
    (no back-reference: see gpu_layer_graphs.LayerGraphs); it holds the expert cache (`be.cache`)."""

    def __init__(self, decode_graphs=True):
        self.decode_graphs = decode_graphs
        self.group_tokens = GROUP_DECODE_TOKENS  # a decode step of this many tokens or more groups its pairs
        self.width = None  # the widest expert F, set by GpuBackend.place
        self._borrow_slots = {}  # projection name -> device slots [n, R, B] of the borrowed experts
        self._decode = {}  # tokens -> (shape key, scratch of submit_decode), made at a first call
        self._staged = None  # (x, ids, weights) last copied into a decode scratch's input buffer
        self._graphs = {}  # (tokens, layer index) -> captured graph of its decode expert launches (None: failed)
        self._timers = {}  # layer index -> (start, stop) timing events of its decode expert part

    def new_step(self):
        """A step stages its own routing (a graphed layer's arrays are the same objects each step)."""
        self._staged = None

    # -- routing copies ---------------------------------------------------------------------

    @staticmethod
    def fetch_routing(be, ids, weights):
        """(ids int64 [T, K], weights [T, K]) on the host: one wait, for the routing only."""
        ids_host, _ = be.staging.download("ids", ids, be.stream)
        weights_host, done = be.staging.download("weights", weights, be.stream)
        done.synchronize()
        return ids_host.astype(np.int64), weights_host

    def queue_routing(self, be, ids, weights, x):
        """Queue host copies of one step's routing ids [T, K], weights [T, K] and rows x [T, H];
        wait_routing(handle) returns them (any thread may wait: the wait releases the GIL). A one-token
        step's three go through the decode scratch's input buffer in one copy, where its expert launches
        read them too."""
        if x.shape[0] == 1:
            k, hidden = ids.shape[1], x.shape[1]
            packed = self.stage_decode(be, x, ids, weights)["in"]  # [2K + H]
            view, done = be.staging.download("decode_in", packed, be.stream)
            return view[:k].view(np.int32).reshape(1, k), view[k:2 * k].reshape(1, k), \
                view[2 * k:].reshape(1, hidden), done
        ids_host, _ = be.staging.download("ids", ids, be.stream)
        weights_host, _ = be.staging.download("weights", weights, be.stream)
        rows, done = be.staging.download("rows_to_host", x, be.stream)
        return ids_host, weights_host, rows, done

    @staticmethod
    def wait_routing(handle):
        ids_host, weights_host, rows, done = handle
        done.synchronize()
        return ids_host, weights_host, rows

    # -- grouped pairs (a prompt chunk) -----------------------------------------------------

    def submit_groups(self, be, layer, x, ids, weights, groups, borrowed=None):
        """Queue the pairs of `groups` (resident experts of `layer`) and of `borrowed` (groups of
        experts to copy in first, or None) on the stream: gather, gate/up, SwiGLU, down, weighted
        combine. x [T, H], weights [T, K] on the device. Returns a Pending."""
        num_tokens, k = ids.shape
        pending = Pending(None)  # always timed: the borrow model reads a chunk's device time (chunk_part_seconds)
        pending.start = be.rt.event(timing=True)
        pending.start.record(be.stream)
        parts = []  # (device slots (gate, up, down), slot of each group [G], groups)
        if groups.num_groups:
            parts.append((be.cache.layers[layer.index], be.cache.slot_of[layer.index][groups.expert_ids], groups))
        if borrowed is not None and borrowed.num_groups:
            parts.append((self._borrow(be, layer, borrowed.expert_ids), np.arange(borrowed.num_groups), borrowed))
        hidden, width = x.shape[1], layer.gate_exps.shape[1]
        projections = ((layer.gate_exps.qtype, hidden), (layer.up_exps.qtype, hidden), (layer.down_exps.qtype, width))
        tile_tokens = 1 if num_tokens == 1 else moe_tile_tokens(
            projections, sum(len(g.order) for *_, g in parts), sum(g.num_groups for *_, g in parts), TILE_TOKENS)
        order, pair_rows, tile_args = _pair_layout(be, parts, num_tokens * k, tile_tokens)
        pending.out = _queue_pairs(be, layer, x, ids, weights, order, pair_rows,
                                   [(slabs, args) for (slabs, _, _), args in zip(parts, tile_args)], tile_tokens)
        pending.stop = be.rt.event(timing=True)
        pending.stop.record(be.stream)
        return pending

    def submit_resident_chunk(self, be, layer, x, ids, weights):
        """Queue a prompt chunk's pairs where every expert of `layer` is resident (x [T, H], ids int32 / weights [T, K]
        on the device): grouped by expert on the device (prompt_groups), so nothing is read back and the host runs
        ahead; the launches as submit_groups'. Returns a Pending."""
        num_tokens, k = ids.shape
        num_pairs, num_experts = num_tokens * k, be.cache.slot_map.shape[1]
        pending = Pending(None)
        if be.time_experts:
            pending.start, pending.stop = be.rt.event(timing=True), be.rt.event(timing=True)
            pending.start.record(be.stream)
        hidden, width = x.shape[1], layer.gate_exps.shape[1]
        projections = ((layer.gate_exps.qtype, hidden), (layer.up_exps.qtype, hidden), (layer.down_exps.qtype, width))
        tile_tokens = moe_tile_tokens(projections, num_pairs, min(num_experts, num_pairs), TILE_TOKENS)
        order = be.rt.empty((num_pairs,), np.int32)  # [N]
        row_of_pair = be.rt.empty((num_pairs,), np.int32)  # [T*K]
        tiles = be.rt.empty((3, group_tiles_bound(num_pairs, num_experts, tile_tokens)), np.int32)  # [3, W]
        be.kernels.prompt_groups(ids, be.cache.slot_map[layer.index], tile_tokens, order, row_of_pair, tiles)
        pending.out = _queue_pairs(be, layer, x, ids, weights, order, row_of_pair,
                                   [(be.cache.layers[layer.index], tiles)], tile_tokens)
        if be.time_experts:
            pending.stop.record(be.stream)
        return pending

    def _borrow(self, be, layer, experts):
        """Device slots (gate, up, down) [n, R, B] holding `experts` of `layer`, copied in now on the stream."""
        slabs = []
        for name, tensor in (("gate_exps", layer.gate_exps), ("up_exps", layer.up_exps),
                             ("down_exps", layer.down_exps)):
            shape = (len(experts),) + tensor.raw.shape[1:]
            slots = self._borrow_slots.get(name)
            if slots is None or slots.shape[0] < len(experts) or slots.shape[1:] != shape[1:]:
                slots = self._borrow_slots[name] = be.rt.empty(shape, np.uint8)
            if be.page_locked.holds(tensor.raw):  # straight from the model's pages, an expert a transfer
                for slot, expert in enumerate(experts):
                    be.rt.copy_from_host_async(slots[slot], tensor.raw[expert], be.stream)
            else:
                view = be.staging.view(f"borrow_{name}", shape, np.uint8)
                np.take(tensor.raw, experts, axis=0, out=view)
                be.rt.copy_from_host_async(slots[: len(experts)], view, be.stream)
                be.staging.queued(f"borrow_{name}", be.stream)
            slabs.append(slots)
        return slabs

    # -- a decode step's resident pairs ------------------------------------------------------

    def submit_decode(self, be, layer, x, ids, weights):
        """Queue a decode step's resident pairs (x [n, H], ids int32 [n, K], weights [n, K] on the device; n = 1, or
        a relayed step's n * K <= MAX_DECODE_PAIRS): a kernel finds them from the routing and the cache's slot
        map, so nothing is read back. The launches read fixed scratch (the inputs are copied in), so each
        layer's are captured once a token count as a graph and replayed with one call. Returns a Pending."""
        in_step_graph = be.step is not None and be.step.active is not None  # its launches go into the step's graph
        if in_step_graph and all(a.flags.c_contiguous for a in (x, ids, weights)):
            # the step's graph keeps its own arrays: the launches read them where they are (no pack_decode)
            s = dict(self._decode_scratch(be, ids.shape[0], ids.shape[1], x.shape[1]), ids=ids,
                     ids_flat=ids.reshape(1, -1), weights=weights, x=x)
        else:
            s = self.stage_decode(be, x, ids, weights)
        self._staged = None  # a later step's arrays may reuse these objects' memory
        pending = Pending(s["out"][layer.index])  # [n, H], this layer's own: read by later kernels only
        if be.time_experts:  # the layer's own pair of timing events, read before its next step
            pending.start, pending.stop = self._timing_events(be, layer.index)
            pending.start.record(be.stream)
        key = (x.shape[0], layer.index)
        graph = self._graphs.get(key, _UNCAPTURED) if self.decode_graphs and not in_step_graph else None
        grouped = self.group_tokens is not None and x.shape[0] >= self.group_tokens
        queue = _queue_grouped_experts if grouped else _queue_decode_experts
        if graph is _UNCAPTURED:
            graph = self._graphs[key] = self._capture(be, lambda: queue(be, layer, s))
        if graph is None:
            queue(be, layer, s)
        else:
            graph.launch(be.stream)
        if be.time_experts:
            pending.stop.record(be.stream)
        return pending

    def _timing_events(self, be, layer_index):
        events = self._timers.get(layer_index)
        if events is None:
            events = self._timers[layer_index] = (be.rt.event(timing=True), be.rt.event(timing=True))
        return events

    def _capture(self, be, queue):
        """The graph of `queue`'s launches, or None (logged once) where this runtime cannot capture them."""
        try:
            return be.rt.capture(be.stream, queue)
        except Exception as exc:  # CuPy raises its own runtime errors; ROCm builds may lack graphs
            if self.decode_graphs:
                log.warning("decode expert launches run one by one: graph capture failed (%s)", exc)
            self.decode_graphs = False
            return None

    def stage_decode(self, be, x, ids, weights):
        """The decode scratch of n = len(x) tokens, with ids int32 [n, K], weights [n, K] and x [n, H] packed into
        its input buffer by one kernel (once per layer: queue_routing, the relay's publish and submit_decode
        share it)."""
        s = self._decode_scratch(be, ids.shape[0], ids.shape[1], x.shape[1])
        if self._staged is None or any(a is not b for a, b in zip(self._staged, (x, ids, weights))):
            be.kernels.pack_decode(ids.reshape(1, -1), weights.reshape(1, -1), x.reshape(1, -1), s["in"])
            self._staged = (x, ids, weights)
        return s

    def _decode_scratch(self, be, tokens, k, hidden):
        """Device arrays of a decode step's expert pairs (n = tokens, P = n * K pairs, pair p = t * K + j), kept
        between calls (fixed addresses, as the graphs need): the input buffer `in` f32 [n * (2K + H)] holding ids
        int32 [n, K] (ids_flat: [1, P]), weights [n, K] and the rows x [n, H] one after another; pair order [P],
        tiles int32 [4, P], xs / down [P, H], gate / up [P, F]; out [L, n, H], each layer's result. Zeroed
        once: the rows of non-resident pairs are skipped by the matmuls and keep finite values for the SwiGLU."""
        width, num_layers = self.width, len(be.cache.layers)
        key = (k, hidden, width, num_layers)
        held = self._decode.get(tokens)
        if held is None or held[0] != key:
            e, pairs = be.rt.zeros, tokens * k
            packed = e((tokens * (2 * k + hidden),), np.float32)
            scratch = dict(**{"in": packed}, ids=packed[:pairs].view(np.int32).reshape(tokens, k),
                           ids_flat=packed[:pairs].view(np.int32).reshape(1, pairs),
                           weights=packed[pairs:2 * pairs].reshape(tokens, k),
                           x=packed[2 * pairs:].reshape(tokens, hidden),
                           order=be.rt.to_device(np.arange(pairs, dtype=np.int32)), tiles=e((4, pairs), np.int32),
                           group_order=e((pairs,), np.int32),
                           xs=e((pairs, hidden), np.float32), gate=e((pairs, width), np.float32),
                           up=e((pairs, width), np.float32), down=e((pairs, hidden), np.float32),
                           out=e((num_layers, tokens, hidden), np.float32))
            self._decode[tokens] = held = (key, scratch)
            self._graphs = {g: graph for g, graph in self._graphs.items() if g[0] != tokens}
            self._staged = None
        return held[1]


def _queue_decode_experts(be, layer, s):
    k = s["ids"].shape[1]
    kn, tiles = be.kernels, s["tiles"]
    kn.decode_pairs(s["ids_flat"], be.cache.slot_map[layer.index], k, tiles, s["x"], s["xs"])  # order: every pair
    slabs = be.cache.layers[layer.index]
    if layer.gate_exps.qtype == layer.up_exps.qtype and slabs[0].shape == slabs[1].shape:
        kn.moe_matmul2(slabs[0], slabs[1], layer.gate_exps.qtype, s["xs"], s["gate"], s["up"], *tiles[:3])
    else:
        kn.moe_matmul(slabs[0], layer.gate_exps.qtype, s["xs"], s["gate"], tiles[0], tiles[1], tiles[2], 1)
        kn.moe_matmul(slabs[1], layer.up_exps.qtype, s["xs"], s["up"], tiles[0], tiles[1], tiles[2], 1)
    down_qtype = layer.down_exps.qtype
    if layer.expert_glu is None and fuses_glu(kn.act_quant, down_qtype, s["gate"].shape[1]):
        kn.moe_matmul_glu(slabs[2], down_qtype, s["gate"], s["up"], s["down"], tiles[0], tiles[1], tiles[2])
    else:
        activate(be, layer, s["gate"], s["up"], s["order"], s["ids_flat"])
        kn.moe_matmul(slabs[2], down_qtype, s["gate"], s["down"], tiles[0], tiles[1], tiles[2], 1)
    add_down_bias(be, layer, s["down"], s["order"], s["ids_flat"])
    kn.combine_rows(s["down"], tiles[3], s["weights"], k, s["out"][layer.index])


def _queue_grouped_experts(be, layer, s):
    """_queue_decode_experts with the pairs grouped by expert on the device (decode_groups): rows gathered in that
    order, each expert's rows read once for up to TILE_TOKENS of its pairs by the tiled matmuls."""
    k = s["ids"].shape[1]
    kn, tiles, order = be.kernels, s["tiles"], s["group_order"]
    kn.decode_groups(s["ids_flat"], be.cache.slot_map[layer.index], TILE_TOKENS, order, tiles)
    kn.gather_rows(s["x"], order, k, s["xs"])
    slabs = be.cache.layers[layer.index]
    kn.moe_matmul(slabs[0], layer.gate_exps.qtype, s["xs"], s["gate"], tiles[0], tiles[1], tiles[2], TILE_TOKENS)
    kn.moe_matmul(slabs[1], layer.up_exps.qtype, s["xs"], s["up"], tiles[0], tiles[1], tiles[2], TILE_TOKENS)
    activate(be, layer, s["gate"], s["up"], order, s["ids_flat"])
    kn.moe_matmul(slabs[2], layer.down_exps.qtype, s["gate"], s["down"], tiles[0], tiles[1], tiles[2], TILE_TOKENS)
    add_down_bias(be, layer, s["down"], order, s["ids_flat"])
    kn.combine_rows(s["down"], tiles[3], s["weights"], k, s["out"][layer.index])


def activate(be, layer, gate, up, order, ids):
    """gate [N, F] = the experts' activation of pair rows gate, up: SwiGLU, or with the layer's ExpertGLU its biases
    (each row's expert: ids.flat[order[row]]) and clamp (gpt-oss)."""
    glu = layer.expert_glu
    if glu is None:
        be.kernels.swiglu(gate, up, gate)
    else:
        be.kernels.clamped_swiglu(gate, up, order, ids, be._weight(glu.gate_bias), be._weight(glu.up_bias), glu.alpha,
                                  glu.limit, gate)


def add_down_bias(be, layer, down, order, ids):
    """down [N, H] += the down projection's bias of each pair row's expert, where the layer has an ExpertGLU."""
    if layer.expert_glu is not None:
        be.kernels.add_pair_bias(down, order, ids, be._weight(layer.expert_glu.down_bias))


def _queue_pairs(be, layer, x, ids, weights, order, pair_rows, parts, tile_tokens):
    """Queue a chunk's grouped pairs on the stream: gather, gate/up, SwiGLU, down, weighted combine. x [T, H],
    ids / weights [T, K]; order [N] (the token of each pair row), pair_rows [T*K] (each pair's row); parts: (device
    slots (gate, up, down), tile arguments) of each run of expert tiles. Returns the combined rows [T, H]."""
    k, num_pairs, hidden, width = ids.shape[1], len(order), x.shape[1], layer.gate_exps.shape[1]
    xs = be.rt.empty((num_pairs, hidden), np.float32)  # [N, H]
    be.kernels.gather_rows(x, order, k, xs)
    gate = be.rt.empty((num_pairs, width), np.float32)  # [N, F]
    up = be.rt.empty((num_pairs, width), np.float32)  # [N, F]
    down = be.rt.empty((num_pairs, hidden), np.float32)  # [N, H]
    for slabs, tiles in parts:
        be.kernels.moe_matmul(slabs[0], layer.gate_exps.qtype, xs, gate, *tiles, tile_tokens)
        be.kernels.moe_matmul(slabs[1], layer.up_exps.qtype, xs, up, *tiles, tile_tokens)
    activate(be, layer, gate, up, order, ids)
    for slabs, tiles in parts:
        be.kernels.moe_matmul(slabs[2], layer.down_exps.qtype, gate, down, *tiles, tile_tokens)
    add_down_bias(be, layer, down, order, ids)
    out = be.rt.empty(x.shape, np.float32)  # [T, H]
    be.kernels.combine_rows(down, pair_rows, weights, k, out)
    return out


def _pair_layout(be, parts, num_pair_slots, tile_tokens):
    """Device int32 arrays, one upload: pair order [N] (the parts' pairs one after another),
    row of each of the T*K pairs [T*K] (-1: not here), and per part its tiles (slot, row, count)."""
    order = np.concatenate([g.order for _, _, g in parts]).astype(np.int32)  # [N]
    row_of_pair = np.full(num_pair_slots, -1, dtype=np.int32)  # [T*K]
    row_of_pair[order] = np.arange(len(order), dtype=np.int32)
    tiles, first = [], 0
    for _, slots, g in parts:
        tiles.append(work_tiles(g.row_starts + first, slots, tile_tokens))  # [3, W_p]
        first += len(g.order)
    packed = be.staging.upload("expert_args", np.concatenate([order, row_of_pair] + [t.reshape(-1) for t in tiles]),
                               be.stream)
    offset, tile_args = len(order) + num_pair_slots, []
    for t in tiles:
        num_tiles = t.shape[1]
        tile_args.append([packed[offset + i * num_tiles:offset + (i + 1) * num_tiles] for i in range(3)])
        offset += 3 * num_tiles
    return packed[:len(order)], packed[len(order):len(order) + num_pair_slots], tile_args


def work_tiles(row_starts, slots, tile_tokens=TILE_TOKENS):
    """Groups -> int32 [3, W]: (slot, first row, row count) of each tile of <= tile_tokens rows."""
    sizes = np.diff(row_starts)  # [G]
    per_group = (sizes + tile_tokens - 1) // tile_tokens  # [G]
    group_of = np.repeat(np.arange(len(sizes)), per_group)  # [W]
    first = np.cumsum(per_group) - per_group  # [G]
    rows = row_starts[group_of] + (np.arange(len(group_of)) - first[group_of]) * tile_tokens  # [W]
    counts = np.minimum(tile_tokens, row_starts[group_of + 1] - rows)  # [W]
    return np.stack([slots[group_of], rows, counts]).astype(np.int32)
