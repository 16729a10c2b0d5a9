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
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from cpu_kernels.rope import inv_freq_f32
from cpu_kernels.sync import LINE
from gpu_kernels.expert_cache import MIB, ExpertCache, expert_bytes, plan
from gpu_kernels.kernels import MAX_THREADS, TILE_TOKENS, Kernels, describe_act_quant

from ..formats.weights import QuantTensor
from .. import kv_store
from ..blocks import separate_projections
from ..kv_cache import BLOCK_TOKENS, KVPool, SequenceKV, blocks_for, vram_blocks
from ..relay import Mailbox
from .cpu import paged_attention as host_paged_attention
from .gpu_layer_graphs import LayerGraphs, decode_layer

log = logging.getLogger(__name__)

DEFAULT_RESERVE_MIB = 512
_UNCAPTURED = object()  # a layer whose decode graph was not tried yet
KV_HOST_ATTENTION = ("gpu", "cpu")  # who attends the RAM part of a --kv-resident sequence (the first: the default,
# 2.3-3.9x the decode speed and 12-41x the prompt speed of "cpu" on the H200 host: bench/results/kv_resident.md)
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
        self.events = {}  # name -> its event, recorded again at each use (a decode step makes hundreds)

    def view(self, name, shape, dtype):
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        buffer, event = self.buffers.get(name, (None, None))
        if event is not None:
            event.synchronize()
        if buffer is None or buffer.nbytes < nbytes:
            buffer = self.rt.pinned_empty((max(nbytes, 4096) * 2,), np.uint8)
        self.buffers[name] = (buffer, None)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def queued(self, name, stream):
        """Mark the last copy through buffer `name` as queued on `stream`; returns its event (the buffer's own: a
        wait on it after a later use of the buffer waits for that use too)."""
        event = self.events.get(name)
        if event is None:
            event = self.events[name] = self.rt.event()
        event.record(stream)
        self.buffers[name] = (self.buffers[name][0], event)
        return event

    def upload(self, name, host, stream, out=None):
        """A device copy of the host array `host`, queued on `stream` through buffer `name`: into the device array
        `out` (same shape and type) where given, else a new one."""
        view = self.view(name, host.shape, host.dtype)
        np.copyto(view, host)
        dev = self.rt.empty(host.shape, host.dtype) if out is None else out
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
    """SequenceKV in a VRAM pool, its block table mirrored on the device; writes are kernels queued on the
    backend's stream. With `resident_tokens` only the newest blocks stay in VRAM: after each step the
    blocks beyond resident_tokens (rounded up to blocks) plus the one being filled move, oldest first,
    to this sequence's part in pinned RAM (`host`: [L, cap, BT, Hkv, D] per array, position order), and
    their table entries become -1 (the kernels read such a block from the stage, block for block)."""

    def __init__(self, backend, pool, max_tokens, resident_tokens=None):
        self.backend = backend
        super().__init__(pool, max_tokens)
        self.resident_blocks = None if resident_tokens is None else blocks_for(resident_tokens, self.block_tokens)
        self.host = {}  # name -> pinned array [L, cap, BT, Hkv, D] (scales [L, cap, BT, Hkv])
        self._host_copied = None  # event after the last queued copy into `host`
        self._table_dev = None

    def table_changed(self):
        self._table_dev = None

    def device_table(self):
        """The block table on the device (uploaded, through the stream, when it changed)."""
        if self._table_dev is None:
            used = max(1, self.host_blocks + len(self.blocks))
            self._table_dev = self.backend.staging.upload("kv_table", self.table[:used], self.backend.stream)
        return self._table_dev

    def write(self, layer, start, k, v):
        """k, v: device float32 [n, Hkv, D] for positions [start, start + n) (all in pool blocks)."""
        kp, vp, ks, vs = self.pool.layer(layer)
        table = self.device_table()
        self.backend.kernels.kv_write(self.dtype, k, kp, ks, table, start)
        self.backend.kernels.kv_write(self.dtype, v, vp, vs, table, start)

    def commit(self, length):
        self.length = length
        if self.resident_blocks is not None and len(self.blocks) > self.resident_blocks:
            self._evict(len(self.blocks) - self.resident_blocks)

    def _names(self):
        return ("k", "v", "k_scale", "v_scale") if self.dtype == "int8" else ("k", "v")

    def _evict(self, count):
        """Queue copies of the oldest `count` pool blocks into the RAM part and give the blocks back (later
        writes to them are queued after these copies on the same stream)."""
        rt, stream, first = self.backend.rt, self.backend.stream, self.host_blocks
        self._host_room(first + count)
        moved = self.blocks[:count]
        for name in self._names():
            pool, host = getattr(self.pool, name), self.host[name]
            for layer in range(self.num_layers):
                for i, block in enumerate(moved):
                    rt.copy_to_host_async(host[layer, first + i], pool[layer, block], stream)
        self._host_copied = rt.event()
        self._host_copied.record(stream)
        del self.blocks[:count]
        self.pool.give(moved)
        self.table[first:first + count] = -1
        self.host_blocks += count
        self.table_changed()

    def _host_room(self, num_blocks):
        """Grow the pinned RAM part to at least num_blocks blocks (doubling), keeping what it holds."""
        have = next(iter(self.host.values())).shape[1] if self.host else 0
        if num_blocks <= have:
            return
        capacity = min(blocks_for(self.max_tokens, self.block_tokens), max(num_blocks, 2 * have, 16))
        self.backend.synchronize()  # queued copies into and out of the old arrays are done before they are freed
        for name in self._names():
            pool = getattr(self.pool, name)
            grown = self.backend.rt.pinned_empty((self.num_layers, capacity) + tuple(pool.shape[2:]), pool.dtype)
            if have:
                grown[:, :self.host_blocks] = self.host[name][:, :self.host_blocks]
            self.host[name] = grown

    def wait_host(self):
        """Wait until every queued copy into the RAM part has landed."""
        if self._host_copied is not None:
            self._host_copied.synchronize()

    def host_layer(self, layer):
        """(k, v, k_scale, v_scale) of `layer` in the RAM part: [cap, BT, Hkv, D] (scales [cap, BT, Hkv] or None)."""
        return tuple(self.host[name][layer] if name in self.host else None for name in ("k", "v", "k_scale", "v_scale"))

    def export(self, n):
        """Positions [0, n) as host float32 (k, v) [L, n, Hkv, D] (the conversation cache parks them in RAM)."""
        num_blocks = blocks_for(n, self.block_tokens)
        from_host = min(self.host_blocks, num_blocks)
        pool_blocks = np.asarray(self.blocks[:num_blocks - from_host], dtype=np.int64)
        self.wait_host()
        parts = {}
        for name in self._names():
            pool = getattr(self.pool, name)
            held = self.host[name][:, :from_host] if from_host else np.empty((self.num_layers, 0) + pool.shape[2:],
                                                                                pool.dtype)
            fresh = self.backend.rt.to_host(pool[:, self.backend.rt.to_device(pool_blocks)], stream=self.backend.stream) if len(pool_blocks) \
                else held[:, :0]
            both = np.concatenate([held, fresh], axis=1)  # [L, blocks, BT, ...]
            parts[name] = both.reshape((self.num_layers, -1) + both.shape[3:])[:, :n]
        return tuple(kv_store.decode(parts[name], parts.get(f"{name}_scale")) for name in ("k", "v"))

    def load(self, k, v):
        """Float32 (k, v) [L, n, Hkv, D] become positions [0, n); with a resident window, written a chunk at a
        time (older blocks leaving for RAM after each) so that VRAM never holds more than the window and a chunk."""
        n = k.shape[1]
        self.truncate(0)
        step = n if self.resident_blocks is None else self.backend.chunk_tokens
        rt = self.backend.rt
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            self.reserve(hi)
            for layer in range(self.num_layers):
                self.write(layer, lo, rt.to_device(np.ascontiguousarray(k[layer, lo:hi], dtype=np.float32)),
                           rt.to_device(np.ascontiguousarray(v[layer, lo:hi], dtype=np.float32)))
            self.commit(hi)


class GpuBackend:
    """expert_cache_mib: None = all VRAM left ("auto"); resident: a placement's bool mask [L, E]
    (default: fill the cache layer by layer); the KV pool in VRAM holds kv_sequences sequences of
    max_context positions in kv_dtype, or with kv_resident only their newest kv_resident positions (and a
    chunk), the rest in pinned RAM, attended by `kv_host_attention` ("gpu": it is copied to a stage in
    VRAM, layer by layer, and attended there with the rest; "cpu": the host attends it while the GPU
    attends the VRAM part, the parts merged by log-sum-exp); prefill_borrow: let large chunks run non-resident
    experts here (copied in per chunk)."""

    name = "gpu"
    max_decode_pairs = MAX_THREADS  # a decode step's pairs at most: decode_tiles runs one thread a pair in one block

    def __init__(self, runtime, expert_cache_mib=None, vram_reserve_mib=DEFAULT_RESERVE_MIB, kv_sequences=1,
                 max_context=4096, chunk_tokens=512, resident=None, prefill_borrow=True, kv_dtype="f32",
                 kv_resident=None, kv_host_attention="gpu"):
        if kv_dtype not in kv_store.KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(kv_store.KV_DTYPES)}, got {kv_dtype!r}")
        if kv_host_attention not in KV_HOST_ATTENTION:
            raise ValueError(f"kv_host_attention must be one of {', '.join(KV_HOST_ATTENTION)}, got {kv_host_attention!r}")
        if kv_resident is not None and kv_resident < 1:
            raise ValueError(f"--kv-resident {kv_resident}: keep at least one token in VRAM")
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
        self.kv_sequences, self.max_context, self.chunk_tokens = kv_sequences, max_context, chunk_tokens
        self.kv_dtype, self.kv_resident, self.kv_host_attention = kv_dtype, kv_resident, kv_host_attention
        self.kv_pool = None  # made by place()
        self._stage = {}  # name -> device array [nS, BT, Hkv, D]: RAM parts copied in ("gpu" host attention)
        self._identity = np.arange(1, dtype=np.int32)  # the table of a RAM part: block b at b
        self.requested_resident = resident
        self.resident = None  # bool [L, E], set by place()
        self.budget = None
        self._dev = {}  # id(host weight) -> (device copy, host weight)
        self._positions = (None, None)  # (host positions, device copy) of the last batch
        self._inv_freq = {}  # (theta, D) -> RoPE frequencies f32 [D/2] on the device
        self._decode = {}  # tokens -> (shape key, scratch of submit_decode_experts), made at a first call
        self._staged = None  # (x, ids, weights) last copied into a decode scratch's input buffer
        # STRATA_DECODE_GRAPHS=0: each layer's decode expert launches one by one rather than replayed as a graph
        self.decode_graphs = _env_switch("STRATA_DECODE_GRAPHS", "1")
        self._graphs = {}  # (tokens, layer index) -> captured graph of its decode expert launches (None: failed)
        self._mapped = {}  # host address of a pinned buffer -> its device address (0: not mapped)
        self._timers = {}  # layer index -> (start, stop) timing events of its decode expert part
        # STRATA_DENSE_GRAPHS=0: a decode layer's dense launches one by one rather than as two graphs
        # (gpu_layer_graphs.py; 1.4x to 2.4x faster decode on an H100, bench/results/gpu_model.md, session 29)
        self.layer_graphs = LayerGraphs() if _env_switch("STRATA_DENSE_GRAPHS", "1") else None

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
        per_block = kv_store.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype) * BLOCK_TOKENS
        kv_blocks = self.kv_sequences * self.vram_blocks_per_sequence()
        kv = kv_blocks * per_block + self._stage_bytes(c)
        scratch = self.chunk_tokens * 4 * (c.vocab_size + 8 * c.hidden_size + 2 * c.num_heads * c.head_dim
                                           + c.num_experts_per_tok * (3 * c.moe_intermediate_size + 2 * c.hidden_size))
        free, total = self.rt.memory_info()
        self.budget, self.resident = plan(free, total, dense_bytes, kv, scratch, self.reserve,
                                          [expert_bytes(layer) for layer in model.layers], c.num_experts,
                                          self.cache_bytes, self.requested_resident)
        projections = [(layer.attn_q, layer.attn_k, layer.attn_v) for layer in model.layers]
        self._projections = {layer.index: self._upload_projections(p) for layer, p in zip(model.layers, projections)}
        uploaded = {id(w) for p in projections for w in p}
        for w in unique.values():
            if id(w) not in uploaded:
                self._dev[id(w)] = (self.rt.to_device(np.ascontiguousarray(w.raw if isinstance(w, QuantTensor) else w)),
                                    w)
        self.kv_pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype, num_blocks=kv_blocks,
                              max_blocks=kv_blocks, allocate=self.rt.empty, where="VRAM")
        self.cache = ExpertCache(self.rt, model.layers, self.resident, self.stream)
        self._expert_width = max(layer.gate_exps.shape[1] for layer in model.layers)
        self.borrow_bytes_per_second = self._measure_upload()
        log.info("%s on %s (%s, warp %d): %s; host -> device copies %.1f GB/s; one-token matmuls take x as %s "
                 "(STRATA_ACT_QUANT)", self.name, self.rt.device_name, self.rt.name, self.rt.warp_size,
                 self.budget.describe(), self.borrow_bytes_per_second / 1e9,
                 describe_act_quant(self.kernels.act_quant))

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

    def vram_blocks_per_sequence(self):
        """KV blocks a sequence may hold in VRAM (hybrid.kv_cache.vram_blocks)."""
        return vram_blocks(self.max_context, self.kv_resident, self.chunk_tokens)

    def _stage_bytes(self, c):
        """VRAM for one layer's RAM part of the longest sequence, when the GPU attends RAM parts."""
        if self.kv_resident is None or self.kv_host_attention != "gpu":
            return 0
        per_layer = kv_store.bytes_per_token(1, c.num_kv_heads, c.head_dim, self.kv_dtype)
        return blocks_for(self.max_context) * BLOCK_TOKENS * per_layer

    def new_kv_pool(self, num_layers, num_kv_heads, head_dim, dtype, num_tokens):
        """The pool place() made (its size comes from the VRAM budget, not from num_tokens)."""
        if dtype != self.kv_dtype:
            raise ValueError(f"KV dtype {dtype}: this GPU backend was made for {self.kv_dtype}")
        return self.kv_pool

    def new_kv(self, pool, max_tokens):
        return DeviceSequenceKV(self, pool, max_tokens, self.kv_resident)

    def describe_kv(self, pool, max_tokens):
        per_block = pool.bytes_per_block
        text = (f"KV {pool.dtype} in VRAM: {self.vram_blocks_per_sequence() * per_block / 2**20:.1f} MiB per slot, "
                f"pool {pool.num_blocks} blocks of {pool.block_tokens} tokens ({pool.nbytes / 2**20:.0f} MiB)")
        if self.kv_resident is not None:
            ram = max(0, blocks_for(max_tokens) - blocks_for(self.kv_resident)) * per_block
            text += (f"; newest {self.kv_resident} tokens resident, the rest in pinned RAM: up to {ram / 2**20:.1f} MiB "
                     f"per slot at {max_tokens} tokens, attended on the {self.kv_host_attention}")
        return text

    def _weight(self, host):
        return self._dev[id(host)][0]

    def _upload_projections(self, weights):
        """Device copies of a layer's q, k and v weights: each run of them with one type and row size is one array,
        their rows one after another (each weight's copy is its rows' view), so that a one-token step projects
        the run with one launch. [(device raw [R, B], qtype, rows of each weight)] in q, k, v order."""
        runs = [[weights[0]]]
        for w in weights[1:]:
            last = runs[-1][-1]
            if (w.qtype, w.raw.shape[1:], w.raw.dtype) == (last.qtype, last.raw.shape[1:], last.raw.dtype):
                runs[-1].append(w)
            else:
                runs.append([w])
        out = []
        for run in runs:
            dev = self.rt.to_device(np.ascontiguousarray(np.concatenate([w.raw for w in run])))  # [R, B]
            start = 0
            for w in run:
                self._dev[id(w)] = (dev[start:start + w.raw.shape[0]], w)
                start += w.raw.shape[0]
            out.append((dev, run[0].qtype, [w.raw.shape[0] for w in run]))
        return out

    # -- dense ops -------------------------------------------------------------------------

    def linear(self, weight, x):
        """x [T, C] @ weight[R, C].T -> [T, R]."""
        out = self.rt.empty((x.shape[0], weight.shape[0]), np.float32)
        self.kernels.matmul(self._weight(weight), weight.qtype, x, out)
        return out

    def add_into(self, x, y):
        """x += y in place (the residual stream) with our add kernel rather than CuPy's `+=`: in a cProfile of a
        100 %-resident decode on an H100 host (bench/results/gpu_model.md, session 25) the layer loop's own time,
        mostly its two `+=`, was ~65 us a layer, against ~12 us for one launch of ours. Not yet timed after."""
        if x.shape != y.shape or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise ValueError(f"add_into: {x.shape} and {y.shape}: expected contiguous arrays of one shape")
        self.kernels.add_into(x, y)

    def project_qkv(self, layer, h):
        """h [T, H] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], qk). One token: one launch for each run of
        the weights that share a device array (_upload_projections), and where q and k share one, qk is
        [1, Hq + Hkv, D] over both (one RoPE launch for the two); else None."""
        if h.shape[0] != 1:
            return separate_projections(self, layer, h)
        d, parts, qk = layer.head_dim, [], None
        for i, (raw, qtype, rows) in enumerate(self._projections[layer.index]):
            out = self.rt.empty((1, sum(rows)), np.float32)
            self.kernels.matmul(raw, qtype, h, out)
            flat, start = out.reshape(-1), 0  # [R], contiguous: its slices are too
            for r in rows:
                parts.append(flat[start:start + r].reshape(1, r // d, d))
                start += r
            if i == 0 and len(rows) > 1:
                qk = flat[:rows[0] + rows[1]].reshape(1, (rows[0] + rows[1]) // d, d)
        q, k, v = parts
        return q, k, v, qk

    def graphs_decode(self, batch):
        """Whether this step's layers go through graphed_decode_layer: not turned off (STRATA_DENSE_GRAPHS=0),
        capture not failed, and one sequence's one token."""
        return (self.layer_graphs is not None and self.layer_graphs.enabled and len(batch.chunks) == 1
                and len(batch.token_ids) == 1)

    def begin_graphed_step(self, x, positions):
        """x [1, H] copied into the fixed residual stream the layers' graphs read, which is returned."""
        return self.layer_graphs.begin_step(self, x, positions)

    def graphed_decode_layer(self, spec, layer, x, batch, eps, split=None, usage=None):
        decode_layer(self, self.layer_graphs, spec, layer, x, batch, eps, split, usage)

    def embed(self, weight, token_ids):
        """Starts every forward pass: makes the backend's stream current in the calling thread."""
        if self.stream is not None:
            self.stream.use()
        self._staged = None  # a step stages its own routing (a graphed layer's arrays are the same objects each step)
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

    def use_device_positions(self, positions, on_device):
        """rope() of a batch with these host positions reads `on_device` (int64, already uploaded) instead."""
        self._positions = (positions, on_device)

    def rope(self, x, positions, theta):
        """In place over x [T, nH, D]; positions int64 [T] on the host."""
        if self._positions[0] is not positions:
            self._positions = (positions, self.staging.upload("positions", np.ascontiguousarray(positions),
                                                              self.stream))
        key = (theta, x.shape[-1])
        if key not in self._inv_freq:
            self._inv_freq[key] = self.rt.to_device(inv_freq_f32(theta, x.shape[-1]))  # [D/2]
        self.kernels.rope_neox(x, self._positions[1], self._inv_freq[key])

    def attention(self, q, kv, layer, start, scale, out):
        """q [T, Hq, D] at positions [start, start + T) against the sequence's KV (layer `layer`) -> out [T, Hq, D]."""
        pool = kv.pool.layer(layer)  # (k, v, k_scale, v_scale)
        table, ram_keys = kv.device_table(), kv.host_blocks * kv.block_tokens
        if ram_keys == 0:
            self.kernels.paged_attention(kv.dtype, q, *pool, table, start, 0, scale, out)
        elif self.kv_host_attention == "gpu":
            self.kernels.paged_attention(kv.dtype, q, *pool, table, start, 0, scale, out,
                                         stage=self._stage_ram_part(kv, layer))
        else:
            self._attention_split(q, kv, layer, pool, table, start, scale, out, ram_keys)

    def _stage_ram_part(self, kv, layer):
        """(k, v, k_scale, v_scale) stage arrays [nS, BT, Hkv, D] holding the sequence's RAM part of `layer`,
        copied in on the stream (scales None unless int8)."""
        used = kv.host_blocks
        stage = []
        for name, host in zip(("k", "v", "k_scale", "v_scale"), kv.host_layer(layer)):
            if host is None:
                stage.append(None)
                continue
            buf = self._stage.get(name)
            if buf is None or buf.shape[0] < used or buf.shape[1:] != host.shape[1:]:
                buf = self._stage[name] = self.rt.empty((max(used, blocks_for(self.max_context)),) + host.shape[1:],
                                                        host.dtype)
            self.rt.copy_from_host_async(buf[:used], host[:used], self.stream)
            stage.append(buf)
        return tuple(stage)

    def _attention_split(self, q, kv, layer, pool, table, start, scale, out, ram_keys):
        """The GPU attends the VRAM part (pool: the layer's (k, v, k_scale, v_scale), through the device
        table) while the host attends the RAM part of q's keys; the two partial results are merged on the
        GPU by their log-sum-exp."""
        num_tokens, num_heads = q.shape[:2]
        q_host, q_copied = self.staging.download("attn_q", q, self.stream)
        out_dev = self.rt.empty(q.shape, np.float32)  # [T, Hq, D]
        lse_dev = self.rt.empty((num_tokens, num_heads), np.float32)  # [T, Hq]
        self.kernels.paged_attention(kv.dtype, q, *pool, table, start, ram_keys, scale, out_dev, lse=lse_dev)
        q_copied.synchronize()  # after the RAM part's copies too: they were queued before
        if len(self._identity) < kv.host_blocks:
            self._identity = np.arange(max(kv.host_blocks, 2 * len(self._identity)), dtype=np.int32)
        out_host = np.empty(q.shape, np.float32)
        lse_host = np.empty((num_tokens, num_heads), np.float32)
        host_paged_attention(q_host, *kv.host_layer(layer), self._identity, start, 0, ram_keys, scale, out_host,
                             lse_host)
        self.kernels.attn_merge(out_dev, lse_dev, self.staging.upload("attn_out_host", out_host, self.stream),
                                self.staging.upload("attn_lse_host", lse_host, self.stream), out)

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
        wait_routing(handle) returns them (any thread may wait: the wait releases the GIL). A one-token
        step's three go through the decode scratch's input buffer in one copy, where its expert launches
        read them too."""
        if x.shape[0] == 1:
            k, hidden = ids.shape[1], x.shape[1]
            packed = self._stage_decode(x, ids, weights)["in"]  # [2K + H]
            view, done = self.staging.download("decode_in", packed, self.stream)
            return view[:k].view(np.int32).reshape(1, k), view[k:2 * k].reshape(1, k), \
                view[2 * k:].reshape(1, hidden), done
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
        """Queue a decode step's resident pairs (x [n, H], ids int32 [n, K], weights [n, K] on the device; n = 1, or
        a relayed step's n * K <= max_decode_pairs): a kernel finds them from the routing and the cache's slot
        map, so nothing is read back. The launches read fixed scratch (the inputs are copied in), so each
        layer's are captured once a token count as a graph and replayed with one call. Returns a pending part
        for wait_experts."""
        s = self._stage_decode(x, ids, weights)
        self._staged = None  # a later step's arrays may reuse these objects' memory
        pending = _Pending(s["out"][layer.index])  # [n, H], this layer's own: read by later kernels only
        if self.time_experts:  # the layer's own pair of timing events, read before its next step
            pending.start, pending.stop = self._timing_events(layer.index)
            pending.start.record(self.stream)
        key = (x.shape[0], layer.index)
        graph = self._graphs.get(key, _UNCAPTURED) if self.decode_graphs else None
        if graph is _UNCAPTURED:
            graph = self._graphs[key] = self._capture(lambda: self._queue_decode_experts(layer, s))
        if graph is None:
            self._queue_decode_experts(layer, s)
        else:
            graph.launch(self.stream)
        if self.time_experts:
            pending.stop.record(self.stream)
        return pending

    def _timing_events(self, layer_index):
        events = self._timers.get(layer_index)
        if events is None:
            events = self._timers[layer_index] = (self.rt.event(timing=True), self.rt.event(timing=True))
        return events

    def _queue_decode_experts(self, layer, s):
        k = s["ids"].shape[1]
        kn, tiles = self.kernels, s["tiles"]
        kn.decode_tiles(s["ids_flat"], self.cache.slot_map[layer.index], tiles)
        kn.gather_rows(s["x"], s["order"], k, s["xs"])
        slabs = self.cache.layers[layer.index]
        kn.moe_matmul(slabs[0], layer.gate_exps.qtype, s["xs"], s["gate"], tiles[0], tiles[1], tiles[2], 1)
        kn.moe_matmul(slabs[1], layer.up_exps.qtype, s["xs"], s["up"], tiles[0], tiles[1], tiles[2], 1)
        kn.swiglu(s["gate"], s["up"], s["gate"])
        kn.moe_matmul(slabs[2], layer.down_exps.qtype, s["gate"], s["down"], tiles[0], tiles[1], tiles[2], 1)
        kn.combine_rows(s["down"], tiles[3], s["weights"], k, s["out"][layer.index])

    def _capture(self, queue):
        """The graph of `queue`'s launches, or None (logged once) where this runtime cannot capture them."""
        try:
            return self.rt.capture(self.stream, queue)
        except Exception as exc:  # CuPy raises its own runtime errors; ROCm builds may lack graphs
            if self.decode_graphs:
                log.warning("decode expert launches run one by one: graph capture failed (%s)", exc)
            self.decode_graphs = False
            return None

    def _stage_decode(self, x, ids, weights):
        """The decode scratch of n = len(x) tokens, with ids int32 [n, K], weights [n, K] and x [n, H] packed into
        its input buffer by one kernel (once per layer: queue_routing, publish_decode and submit_decode_experts
        share it)."""
        s = self._decode_scratch(ids.shape[0], ids.shape[1], x.shape[1])
        if self._staged is None or any(a is not b for a, b in zip(self._staged, (x, ids, weights))):
            self.kernels.pack_decode(ids.reshape(1, -1), weights.reshape(1, -1), x.reshape(1, -1), s["in"])
            self._staged = (x, ids, weights)
        return s

    def _decode_scratch(self, tokens, k, hidden):
        """Device arrays of a decode step's expert pairs (n = tokens, P = n * K pairs, pair p = t * K + j), kept
        between calls (fixed addresses, as the graphs need): the input buffer `in` f32 [n * (2K + H)] holding ids
        int32 [n, K] (ids_flat: [1, P]), weights [n, K] and the rows x [n, H] one after another; pair order [P],
        tiles int32 [4, P], xs / down [P, H], gate / up [P, F]; out [L, n, H], each layer's result. Zeroed
        once: the rows of non-resident pairs are skipped by the matmuls and keep finite values for the SwiGLU."""
        width, num_layers = self._expert_width, len(self.cache.layers)
        key = (k, hidden, width, num_layers)
        held = self._decode.get(tokens)
        if held is None or held[0] != key:
            e, pairs = self.rt.zeros, tokens * k
            packed = e((tokens * (2 * k + hidden),), np.float32)
            scratch = dict(**{"in": packed}, ids=packed[:pairs].view(np.int32).reshape(tokens, k),
                           ids_flat=packed[:pairs].view(np.int32).reshape(1, pairs),
                           weights=packed[pairs:2 * pairs].reshape(tokens, k),
                           x=packed[2 * pairs:].reshape(tokens, hidden),
                           order=self.rt.to_device(np.arange(pairs, dtype=np.int32)), tiles=e((4, pairs), np.int32),
                           xs=e((pairs, hidden), np.float32), gate=e((pairs, width), np.float32),
                           up=e((pairs, width), np.float32), down=e((pairs, hidden), np.float32),
                           out=e((num_layers, tokens, hidden), np.float32))
            self._decode[tokens] = held = (key, scratch)
            self._graphs = {g: graph for g, graph in self._graphs.items() if g[0] != tokens}
            self._staged = None
        return held[1]

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

    # -- the device side of the decode relay (hybrid/relay.py) ---------------------------------------

    def decode_mailbox(self, num_layers, top_k, hidden, max_tokens=1):
        """A relay Mailbox (steps of up to max_tokens tokens) in pinned host memory with its arrays' device addresses
        (mailbox.addresses), or None where this runtime does not map pinned memory into the device."""
        mailbox = Mailbox.allocate(num_layers, top_k, hidden, empty=self.rt.pinned_empty, max_tokens=max_tokens)
        mapped = getattr(self.rt, "mapped_address", lambda _: None)
        addresses = {name: mapped(getattr(mailbox, name))
                     for name in ("inbox", "outbox", "flags_in", "flags_out", "error", "times")}
        if not all(addresses.values()):
            return None
        mailbox.addresses = {name: np.uint64(a) for name, a in addresses.items()}
        return mailbox

    def publish_decode(self, layer, x, ids, weights, mailbox, seq):
        """Queue the post of a decode step's routing (ids [n, K], weights [n, K]) and rows x [n, H] to the mailbox's
        inbox[layer] (ids, weights, rows one after another), flagged with step number seq."""
        s = self._stage_decode(x, ids, weights)
        a, i = mailbox.addresses, layer.index
        self.kernels.publish_decode(s["in"], a["inbox"] + np.uint64(i * mailbox.inbox[0].nbytes),
                                    a["flags_in"] + np.uint64(i * LINE * 8), seq, a["times"] + np.uint64(i * 16))

    def await_host_rows(self, out, layer, mailbox, seq, timeout_s):
        """Queue out [n, H] += the host rows of step seq in outbox[layer], once the host posts them; returns out."""
        a, i = mailbox.addresses, layer.index
        self.kernels.await_host_add(out, a["outbox"] + np.uint64(i * mailbox.outbox[0].nbytes),
                                    a["flags_out"] + np.uint64(i * LINE * 8), seq, int(timeout_s * 1e9),
                                    a["error"], i, a["times"] + np.uint64(i * 16))
        return out

    def wait_experts(self, pending):
        """The device part's result; stream order makes later device work see it, so no host wait."""
        return pending.out

    def expert_seconds(self, pending):
        """GPU time of a timed device part (waits for it)."""
        return self.rt.elapsed(pending.start, pending.stop)

    def zeros_like(self, x):
        return self.rt.zeros(x.shape, x.dtype)

    def add_from_host(self, out, host_part):
        """out [T, H] (device) += host_part [T, H] (host). One token's row is read by the add kernel straight from
        a pinned buffer where the runtime maps pinned memory (one launch, no copy); else it is copied through one."""
        if host_part.shape[0] == 1:
            view = self.staging.view("host_row", host_part.shape, host_part.dtype)
            address = self._mapped.get(view.ctypes.data)
            if address is None:
                address = self._mapped[view.ctypes.data] = getattr(self.rt, "mapped_address", lambda _: 0)(view) or 0
            if address:
                np.copyto(view, host_part)
                self.kernels.add_into(out, np.uint64(address))
                self.staging.queued("host_row", self.stream)  # the buffer is not rewritten before the add ran
                return out
        self.kernels.add_into(out, self.staging.upload("host_part", host_part, self.stream))
        return out


def _env_switch(name, default):
    """The 0 / 1 environment variable `name` (default when unset) as a bool."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value}: expected 0 or 1")
    return value == "1"


def _work_tiles(row_starts, slots, tile_tokens=TILE_TOKENS):
    """Groups -> int32 [3, W]: (slot, first row, row count) of each tile of <= tile_tokens rows."""
    sizes = np.diff(row_starts)  # [G]
    per_group = (sizes + tile_tokens - 1) // tile_tokens  # [G]
    group_of = np.repeat(np.arange(len(sizes)), per_group)  # [W]
    first = np.cumsum(per_group) - per_group  # [G]
    rows = row_starts[group_of] + (np.arange(len(group_of)) - first[group_of]) * tile_tokens  # [W]
    counts = np.minimum(tile_tokens, row_starts[group_of + 1] - rows)  # [W]
    return np.stack([slots[group_of], rows, counts]).astype(np.int32)
