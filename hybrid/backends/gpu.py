"""The GPU backend: dense weights, KV and scratch in VRAM, resident experts in the expert cache.

Every op of the forward pass runs as a kernel of gpu_kernels on the backend's own stream, in
order and asynchronously to the host; activations are device arrays (the runtime's). As the device
side of an `ExpertSplit` it runs the resident experts' pairs of a layer as one grouped launch per
projection (`submit_experts`), while the host runs the rest. Host <-> device copies of the hot
path go through pinned buffers (`_Staging`), so the host never waits for queued kernels except
where it reads their results (the routing of each layer). Prefill borrow: experts the host would
run are copied to staging slots in VRAM and run in the device part (`borrow_bytes_per_second`
is the measured copy speed the ExpertSplit's cost model reads).
Shape legend: T tokens, H hidden, V vocab, R rows, C columns, nH heads, D head dim,
Hq / Hkv query / kv heads, L layers, E experts, K top-k, N pairs, F expert width, W work tiles.
"""
import logging
import time
from dataclasses import dataclass

import numpy as np

from cpu_kernels.rope import inv_freq_f32
from gpu_kernels.expert_cache import MIB, ExpertCache, expert_bytes, plan
from gpu_kernels.kernels import TILE_TOKENS, Kernels

from ..formats.weights import QuantTensor
from ..kv_cache import SequenceKV

log = logging.getLogger(__name__)

DEFAULT_RESERVE_MIB = 512
PCIE_PROBE_BYTES = 64 << 20  # the pinned host -> device copy timed at start-up


@dataclass
class _Pending:
    """The device part of one layer, queued: its output [T, H] and, when timed, its two events."""

    out: object
    start: object = None
    stop: object = None


class _Staging:
    """Pinned host buffers by name, grown on demand. Each remembers the event after its last
    queued copy, and a new use first waits for it, so a buffer is never rewritten mid-copy."""

    def __init__(self, runtime):
        self.rt = runtime
        self.buffers = {}  # name -> (pinned uint8 array, event or None)

    def view(self, name, shape, dtype):
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        buffer, event = self.buffers.get(name, (None, None))
        if event is not None:
            event.synchronize()
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self.rt.pinned_empty((max(nbytes, 4096) * 2,), np.uint8)
        self.buffers[name] = (buffer, None)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def queued(self, name, stream):
        """Mark the last copy through buffer `name` as queued on `stream`; returns its event."""
        event = self.rt.event()
        event.record(stream)
        self.buffers[name] = (self.buffers[name][0], event)
        return event

    def upload(self, name, host, stream):
        """A device copy of the host array `host`, queued on `stream` through buffer `name`."""
        view = self.view(name, host.shape, host.dtype)
        np.copyto(view, host)
        dev = self.rt.empty(host.shape, host.dtype)
        self.rt.copy_from_host_async(dev, view, stream)
        self.queued(name, stream)
        return dev

    def download(self, name, dev, stream):
        """(pinned host view, event): a copy of the device array `dev` queued on `stream`; read the
        view after event.synchronize()."""
        view = self.view(name, dev.shape, dev.dtype)
        self.rt.copy_to_host_async(view, dev, stream)
        return view, self.queued(name, stream)


class DeviceSequenceKV(SequenceKV):
    """SequenceKV whose K and V [L, S, Hkv, D] live in VRAM; writes are copies queued on `stream`."""

    def __init__(self, runtime, stream, *args):
        self.runtime, self.stream = runtime, stream
        super().__init__(*args)

    def write(self, layer, start, k, v):
        """k, v: device float32 [n, Hkv, D] for positions [start, start + n): one queued copy each (a
        slice assignment would go through an elementwise kernel and cost more host time)."""
        n = k.shape[0]
        for cache, x in ((self.k, k), (self.v, v)):
            self.runtime.copy_on_device_async(cache[layer, start:start + n], x, self.stream)

    def _allocate(self, capacity):
        shape = (self.num_layers, capacity, self.num_kv_heads, self.head_dim)
        k, v = self.runtime.empty(shape, np.float32), self.runtime.empty(shape, np.float32)  # [L, S, Hkv, D]
        if self.k is not None:
            k[:, : self.length] = self.k[:, : self.length]
            v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k, v

    def export(self, n):
        """Positions [0, n) as host float32 (k, v) [L, n, Hkv, D] (the conversation cache parks them in RAM)."""
        return tuple(np.stack([self.runtime.to_host(layer[:n]) for layer in getattr(self, name)])
                     for name in ("k", "v"))

    def load(self, k, v):
        n = k.shape[1]
        self.reserve(n)
        for layer in range(self.num_layers):  # [n, Hkv, D] slices are contiguous on the device
            self.runtime.copy_from_host(self.k[layer, :n], np.ascontiguousarray(k[layer], dtype=np.float32))
            self.runtime.copy_from_host(self.v[layer, :n], np.ascontiguousarray(v[layer], dtype=np.float32))
        self.length = n


class GpuBackend:
    """expert_cache_mib: None = all VRAM left ("auto"); resident: a placement's bool mask [L, E]
    (default: fill the cache layer by layer); kv_tokens: KV positions to budget for (all sequences);
    prefill_borrow: let large chunks run non-resident experts here (copied in per chunk)."""

    name = "gpu"

    def __init__(self, runtime, expert_cache_mib=None, vram_reserve_mib=DEFAULT_RESERVE_MIB, kv_tokens=4096,
                 chunk_tokens=512, resident=None, prefill_borrow=True):
        self.rt = runtime
        self.stream = runtime.stream()  # made current at every embed: CuPy's own array operations run there too
        self.kernels = Kernels(runtime, self.stream)
        self.staging = _Staging(runtime)
        self.prefill_borrow = prefill_borrow
        self.time_experts = False  # record timing events around each device part (ExpertSplit's trace)
        self.borrow_bytes_per_second = None  # measured at place()
        self._borrow_slots = {}  # projection name -> device slots [n, R, B] of the borrowed experts
        self.cache_bytes = None if expert_cache_mib is None else int(expert_cache_mib * MIB)
        self.reserve = int(vram_reserve_mib * MIB)
        self.kv_tokens, self.chunk_tokens = kv_tokens, chunk_tokens
        self.requested_resident = resident
        self.resident = None  # bool [L, E], set by place()
        self.budget = None
        self._dev = {}  # id(host weight) -> (device copy, host weight)
        self._positions = (None, None)  # (host positions, device copy) of the last batch
        self._inv_freq = {}  # (theta, D) -> RoPE frequencies f32 [D/2] on the device
        self._decode = None  # scratch of submit_decode_experts, made at its first call

    # -- placement -------------------------------------------------------------------------

    def place(self, model):
        """Upload the dense weights, size the VRAM budget, fill the expert cache; logs the budget."""
        c = model.config
        dense = [model.token_embd, model.output, model.output_norm]
        for layer in model.layers:
            dense += [layer.attn_norm, layer.ffn_norm, layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_output,
                      layer.router] + [v for v in (layer.attn_q_norm, layer.attn_k_norm) if v is not None]
        unique = {id(w): w for w in dense}
        dense_bytes = sum(w.nbytes for w in unique.values())
        kv = 2 * c.num_layers * self.kv_tokens * c.num_kv_heads * c.head_dim * 4
        scratch = self.chunk_tokens * 4 * (c.vocab_size + 8 * c.hidden_size + 2 * c.num_heads * c.head_dim
                                           + c.num_experts_per_tok * (3 * c.moe_intermediate_size + 2 * c.hidden_size))
        free, total = self.rt.memory_info()
        self.budget, self.resident = plan(free, total, dense_bytes, kv, scratch, self.reserve,
                                          [expert_bytes(layer) for layer in model.layers], c.num_experts,
                                          self.cache_bytes, self.requested_resident)
        for w in unique.values():
            self._dev[id(w)] = (self.rt.to_device(np.ascontiguousarray(w.raw if isinstance(w, QuantTensor) else w)), w)
        self.cache = ExpertCache(self.rt, model.layers, self.resident, self.stream)
        self.borrow_bytes_per_second = self._measure_upload()
        log.info("%s on %s (%s, warp %d): %s; host -> device copies %.1f GB/s", self.name, self.rt.device_name,
                 self.rt.name, self.rt.warp_size, self.budget.describe(), self.borrow_bytes_per_second / 1e9)

    def _measure_upload(self):
        """Bytes per second of a pinned host -> device copy (PCIE_PROBE_BYTES, best of three)."""
        host = self.rt.pinned_empty((PCIE_PROBE_BYTES,), np.uint8)
        dev = self.rt.empty((PCIE_PROBE_BYTES,), np.uint8)
        best = float("inf")
        for _ in range(3):
            done = self.rt.event()
            t0 = time.perf_counter()
            self.rt.copy_from_host_async(dev, host, self.stream)
            done.record(self.stream)
            done.synchronize()
            best = min(best, time.perf_counter() - t0)
        return PCIE_PROBE_BYTES / best

    def new_kv(self, num_layers, num_kv_heads, head_dim, max_tokens, dtype="f32"):
        if dtype != "f32":
            raise ValueError(f"KV dtype {dtype} is not available on the GPU yet (only f32)")
        return DeviceSequenceKV(self.rt, self.stream, num_layers, num_kv_heads, head_dim, max_tokens)

    def _weight(self, host):
        return self._dev[id(host)][0]

    # -- dense ops -------------------------------------------------------------------------

    def linear(self, weight, x):
        """x [T, C] @ weight[R, C].T -> [T, R]."""
        out = self.rt.empty((x.shape[0], weight.shape[0]), np.float32)
        self.kernels.matmul(self._weight(weight), weight.qtype, x, out)
        return out

    def embed(self, weight, token_ids):
        """Starts every forward pass: makes the backend's stream current in the calling thread."""
        if self.stream is not None:
            self.stream.use()
        out = self.rt.empty((len(token_ids), weight.shape[-1]), np.float32)  # [T, H]
        ids = self.staging.upload("token_ids", np.ascontiguousarray(token_ids, dtype=np.int64), self.stream)
        self.kernels.dequant_rows(self._weight(weight), weight.qtype, ids, out)
        return out

    def rmsnorm(self, x, weight, eps):
        out = self.rt.empty(x.shape, np.float32)
        self.kernels.rmsnorm(x, self._weight(weight), eps, out)
        return out

    def rmsnorm_heads(self, x, weight, eps):
        """In place over x [T, nH, D]."""
        rows = x.reshape(-1, x.shape[-1])  # [T*nH, D]
        self.kernels.rmsnorm(rows, self._weight(weight), eps, rows)

    def rope(self, x, positions, theta):
        """In place over x [T, nH, D]; positions int64 [T] on the host."""
        if self._positions[0] is not positions:
            self._positions = (positions, self.staging.upload("positions", np.ascontiguousarray(positions),
                                                              self.stream))
        key = (theta, x.shape[-1])
        if key not in self._inv_freq:
            self._inv_freq[key] = self.rt.to_device(inv_freq_f32(theta, x.shape[-1]))  # [D/2]
        self.kernels.rope_neox(x, self._positions[1], self._inv_freq[key])

    def attention(self, q, k_cache, v_cache, start, scale, out):
        self.kernels.attention(q, k_cache, v_cache, start, scale, out)

    def route(self, router_logits, k, normalize):
        num_tokens = router_logits.shape[0]
        ids = self.rt.empty((num_tokens, k), np.int32)  # [T, K]
        weights = self.rt.empty((num_tokens, k), np.float32)  # [T, K]
        self.kernels.route_topk(router_logits, k, normalize, ids, weights)
        return ids, weights

    def take_rows(self, x, rows):
        return x[self.staging.upload("rows", np.ascontiguousarray(rows, dtype=np.int64), self.stream)]

    def to_host(self, x):
        return self.rt.to_host(x, stream=self.stream)

    # -- the device side of an ExpertSplit ------------------------------------------------

    def fetch_routing(self, ids, weights):
        """(ids int64 [T, K], weights [T, K]) on the host: one wait, for the routing only."""
        ids_host, _ = self.staging.download("ids", ids, self.stream)
        weights_host, done = self.staging.download("weights", weights, self.stream)
        done.synchronize()
        return ids_host.astype(np.int64), weights_host

    def fetch_rows(self, x):
        """Queue a host copy of x [T, H]; wait_rows(handle) returns it."""
        return self.staging.download("rows_to_host", x, self.stream)

    def wait_rows(self, handle):
        view, done = handle
        done.synchronize()
        return view

    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()

    def submit_experts(self, layer, x, ids, weights, groups, borrowed=None):
        """Queue the pairs of `groups` (resident experts of `layer`) and of `borrowed` (groups of
        experts to copy in first, or None) on the stream: gather, gate/up, SwiGLU, down, weighted
        combine. x [T, H], weights [T, K] on the device. Returns a pending part for wait_experts."""
        num_tokens, k = ids.shape
        pending = _Pending(None)
        if self.time_experts:
            pending.start = self.rt.event(timing=True)
            pending.start.record(self.stream)
        parts = []  # (device slots (gate, up, down), slot of each group [G], groups)
        if groups.num_groups:
            parts.append((self.cache.layers[layer.index], self.cache.slot_of[layer.index][groups.expert_ids], groups))
        if borrowed is not None and borrowed.num_groups:
            parts.append((self._borrow(layer, borrowed.expert_ids), np.arange(borrowed.num_groups), borrowed))
        tile_tokens = 1 if num_tokens == 1 else TILE_TOKENS
        order, pair_rows, tile_args = self._pair_layout(parts, num_tokens * k, tile_tokens)
        num_pairs, width = len(order), layer.gate_exps.shape[1]
        xs = self.rt.empty((num_pairs, x.shape[1]), np.float32)  # [N, H]
        self.kernels.gather_rows(x, order, k, xs)
        gate = self.rt.empty((num_pairs, width), np.float32)  # [N, F]
        up = self.rt.empty((num_pairs, width), np.float32)  # [N, F]
        down = self.rt.empty((num_pairs, x.shape[1]), np.float32)  # [N, H]
        for (slabs, _, _), args in zip(parts, tile_args):
            self.kernels.moe_matmul(slabs[0], layer.gate_exps.qtype, xs, gate, *args, tile_tokens)
            self.kernels.moe_matmul(slabs[1], layer.up_exps.qtype, xs, up, *args, tile_tokens)
        self.kernels.swiglu(gate, up, gate)
        for (slabs, _, _), args in zip(parts, tile_args):
            self.kernels.moe_matmul(slabs[2], layer.down_exps.qtype, gate, down, *args, tile_tokens)
        pending.out = self.rt.empty(x.shape, np.float32)  # [T, H]
        self.kernels.combine_rows(down, pair_rows, weights, k, pending.out)
        if self.time_experts:
            pending.stop = self.rt.event(timing=True)
            pending.stop.record(self.stream)
        return pending

    def queue_routing(self, ids, weights, x):
        """Queue host copies of one step's routing ids [T, K], weights [T, K] and rows x [T, H];
        wait_routing(handle) returns them (any thread may wait: the wait releases the GIL)."""
        ids_host, _ = self.staging.download("ids", ids, self.stream)
        weights_host, _ = self.staging.download("weights", weights, self.stream)
        rows, done = self.staging.download("rows_to_host", x, self.stream)
        return ids_host, weights_host, rows, done

    def queue_ids(self, ids, tag):
        """Queue a host copy of routing ids [T, K] through pinned buffer `tag`; wait_rows(handle) returns it."""
        return self.staging.download(tag, ids, self.stream)

    def wait_routing(self, handle):
        ids_host, weights_host, rows, done = handle
        done.synchronize()
        return ids_host, weights_host, rows

    def submit_decode_experts(self, layer, x, ids, weights):
        """Queue one token's resident pairs (x [1, H], ids int32 [1, K], weights [1, K] on the device):
        a kernel finds them from the routing and the cache's slot map, so nothing is read back and
        the launches reuse fixed scratch. Returns a pending part for wait_experts."""
        k, hidden, width = ids.shape[1], x.shape[1], layer.gate_exps.shape[1]
        s = self._decode_scratch(k, hidden, width)
        pending = _Pending(None)
        if self.time_experts:
            pending.start = self.rt.event(timing=True)
            pending.start.record(self.stream)
        kn = self.kernels
        kn.decode_tiles(ids, self.cache.slot_map[layer.index], s["tiles"])
        tile_args = (s["tiles"][0], s["tiles"][1], s["tiles"][2])
        kn.gather_rows(x, s["order"], k, s["xs"])
        slabs = self.cache.layers[layer.index]
        kn.moe_matmul(slabs[0], layer.gate_exps.qtype, s["xs"], s["gate"], *tile_args, 1)
        kn.moe_matmul(slabs[1], layer.up_exps.qtype, s["xs"], s["up"], *tile_args, 1)
        kn.swiglu(s["gate"], s["up"], s["gate"])
        kn.moe_matmul(slabs[2], layer.down_exps.qtype, s["gate"], s["down"], *tile_args, 1)
        pending.out = self.rt.empty(x.shape, np.float32)  # [1, H]
        kn.combine_rows(s["down"], s["tiles"][3], weights, k, pending.out)
        if self.time_experts:
            pending.stop = self.rt.event(timing=True)
            pending.stop.record(self.stream)
        return pending

    def _decode_scratch(self, k, hidden, width):
        """Device arrays of one decode token's expert pairs, kept between calls: pair order [K]
        (all rows of token 0), tiles int32 [4, K], xs / down [K, H], gate / up [K, F]. Zeroed once: the rows
        of non-resident pairs are skipped by the matmuls and keep finite values for the SwiGLU."""
        key = (k, hidden, width)
        if self._decode is None or self._decode[0] != key:
            e = self.rt.zeros
            scratch = dict(order=self.rt.to_device(np.arange(k, dtype=np.int32)), tiles=e((4, k), np.int32),
                           xs=e((k, hidden), np.float32), gate=e((k, width), np.float32),
                           up=e((k, width), np.float32), down=e((k, hidden), np.float32))
            self._decode = (key, scratch)
        return self._decode[1]

    def _pair_layout(self, parts, num_pair_slots, tile_tokens):
        """Device int32 arrays, one upload: pair order [N] (the parts' pairs one after another),
        row of each of the T*K pairs [T*K] (-1: not here), and per part its tiles (slot, row, count)."""
        order = np.concatenate([g.order for _, _, g in parts]).astype(np.int32)  # [N]
        row_of_pair = np.full(num_pair_slots, -1, dtype=np.int32)  # [T*K]
        row_of_pair[order] = np.arange(len(order), dtype=np.int32)
        tiles, first = [], 0
        for _, slots, g in parts:
            tiles.append(_work_tiles(g.row_starts + first, slots, tile_tokens))  # [3, W_p]
            first += len(g.order)
        packed = self.staging.upload("expert_args", np.concatenate([order, row_of_pair] + [t.reshape(-1) for t in tiles]),
                                     self.stream)
        offset, tile_args = len(order) + num_pair_slots, []
        for t in tiles:
            num_tiles = t.shape[1]
            tile_args.append([packed[offset + i * num_tiles:offset + (i + 1) * num_tiles] for i in range(3)])
            offset += 3 * num_tiles
        return packed[:len(order)], packed[len(order):len(order) + num_pair_slots], tile_args

    def _borrow(self, layer, experts):
        """Device slots (gate, up, down) [n, R, B] holding `experts` of `layer`, copied in now on the stream."""
        slabs = []
        for name in ("gate_exps", "up_exps", "down_exps"):
            tensor = getattr(layer, name)
            shape = (len(experts),) + tensor.raw.shape[1:]
            slots = self._borrow_slots.get(name)
            if slots is None or slots.shape[0] < len(experts) or slots.shape[1:] != shape[1:]:
                slots = self._borrow_slots[name] = self.rt.empty(shape, np.uint8)
            view = self.staging.view(f"borrow_{name}", shape, np.uint8)
            np.take(tensor.raw, experts, axis=0, out=view)
            self.rt.copy_from_host_async(slots[: len(experts)], view, self.stream)
            self.staging.queued(f"borrow_{name}", self.stream)
            slabs.append(slots)
        return slabs

    def wait_experts(self, pending):
        """The device part's result; stream order makes later device work see it, so no host wait."""
        return pending.out

    def expert_seconds(self, pending):
        """GPU time of a timed device part (waits for it)."""
        return self.rt.elapsed(pending.start, pending.stop)

    def zeros_like(self, x):
        return self.rt.zeros(x.shape, x.dtype)

    def add_from_host(self, out, host_part):
        """out [T, H] (device) += host_part [T, H] (host), queued through a pinned buffer."""
        self.kernels.add_into(out, self.staging.upload("host_part", host_part, self.stream))
        return out


def _work_tiles(row_starts, slots, tile_tokens=TILE_TOKENS):
    """Groups -> int32 [3, W]: (slot, first row, row count) of each tile of <= tile_tokens rows."""
    sizes = np.diff(row_starts)  # [G]
    per_group = (sizes + tile_tokens - 1) // tile_tokens  # [G]
    group_of = np.repeat(np.arange(len(sizes)), per_group)  # [W]
    first = np.cumsum(per_group) - per_group  # [G]
    rows = row_starts[group_of] + (np.arange(len(group_of)) - first[group_of]) * tile_tokens  # [W]
    counts = np.minimum(tile_tokens, row_starts[group_of + 1] - rows)  # [W]
    return np.stack([slots[group_of], rows, counts]).astype(np.int32)
