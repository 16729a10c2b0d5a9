"""The GPU backend's KV: a sequence's KV in a VRAM pool (`DeviceSequenceKV`), with only its newest blocks
there where asked and the rest in pinned RAM, and attention over both parts (`GpuKV`).

A RAM part is attended by `host_attention`: "gpu" copies it to a stage in VRAM, layer by layer, and
attends it there with the rest (the default: much faster, bench/results/kv_resident.md); "cpu" has the
host backend attend it while the GPU attends the VRAM part, the two merged by their log-sum-exp.
Shape legend: T tokens, L layers, NB pool blocks, BT tokens a block, Hq / Hkv query / kv heads, D head dim,
nS stage blocks.
"""
import numpy as np

from gpu_kernels.attention_plan import slots_plan
from gpu_kernels.kernels import split_scratch_sizes

from .. import kv_store
from ..kv_cache import BLOCK_TOKENS, SequenceKV, blocks_for, vram_blocks

KV_HOST_ATTENTION = ("gpu", "cpu")  # who attends the RAM part of a --kv-resident sequence (the first: the default)


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
        self._table_dev = None  # the used part of _table_buf
        self._table_buf = None  # int32 [blocks of max_tokens] on the device, at one address (a step graph reads it)

    def table_changed(self):
        self._table_dev = None

    def device_table(self, start=None):
        """The block table on the device (uploaded, through the stream, when it changed); while a step graph is
        queued, the step graphs' own copy of it for this sequence's chunk at `start` (gpu_step.py)."""
        step = self.backend.step
        if step is not None and step.active is not None:
            return step.active.slot(self, start)[0]
        if self._table_dev is None:
            used = max(1, self.host_blocks + len(self.blocks))
            if self._table_buf is None or len(self._table_buf) < used:
                self._table_buf = self.backend.rt.empty((max(used, len(self.table)),), np.int32)
            self._table_dev = self.backend.staging.upload("kv_table", self.table[:used], self.backend.stream,
                                                          out=self._table_buf[:used])
        return self._table_dev

    def write(self, layer, start, k, v):
        """k, v: device float32 [n, Hkv, D] for positions [start, start + n) (all in pool blocks)."""
        kp, vp, ks, vs = self.pool.layer(layer)
        table = self.device_table(start)
        step = self.backend.step.active if self.backend.step is not None else None
        start_at = None if step is None else (step.slot(self, start)[1], None)
        self.backend.kernels.kv_write(self.dtype, k, kp, ks, table, start, start_at=start_at, second=(v, vp, vs))

    def commit(self, length):
        super().commit(length)
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
        rt, stream = self.backend.rt, self.backend.stream
        for name in self._names():
            pool = getattr(self.pool, name)
            held = self.host[name][:, :from_host] if from_host else np.empty((self.num_layers, 0) + pool.shape[2:],
                                                                                pool.dtype)
            fresh = rt.to_host(pool[:, rt.to_device(pool_blocks)], stream=stream) if len(pool_blocks) else held[:, :0]
            both = np.concatenate([held, fresh], axis=1) if from_host else fresh  # [L, blocks, BT, ...]
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


class GpuKV:
    """The KV settings and the attention state of one GPU backend. The pool in VRAM holds its sequences' max_context
    positions in `dtype`, or with `resident` only their newest `resident` positions (and a chunk of chunk_tokens),
    the rest in pinned RAM, attended by `host_attention` (KV_HOST_ATTENTION). host: the backend that attends a RAM
    part with host_attention "cpu" (set by GpuBackend.place). The backend comes with each call (no back-reference:
    see gpu_layer_graphs.LayerGraphs)."""

    def __init__(self, dtype="f32", max_context=4096, chunk_tokens=512, resident=None, host_attention="gpu"):
        if dtype not in kv_store.KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(kv_store.KV_DTYPES)}, got {dtype!r}")
        if host_attention not in KV_HOST_ATTENTION:
            raise ValueError(f"kv_host_attention must be one of {', '.join(KV_HOST_ATTENTION)}, got {host_attention!r}")
        if resident is not None and resident < 1:
            raise ValueError(f"--kv-resident {resident}: keep at least one token in VRAM")
        self.dtype, self.max_context, self.chunk_tokens = dtype, max_context, chunk_tokens
        self.resident, self.host_attention = resident, host_attention
        self.host = None
        self._stage = {}  # name -> device array [nS, BT, Hkv, D]: RAM parts copied in ("gpu" host attention)
        self._identity = np.arange(1, dtype=np.int32)  # the table of a RAM part: block b at b

    def vram_blocks_per_sequence(self):
        """KV blocks a sequence may hold in VRAM (hybrid.kv_cache.vram_blocks)."""
        return vram_blocks(self.max_context, self.resident, self.chunk_tokens)

    def stage_bytes(self, c):
        """VRAM for one layer's RAM part of the longest sequence, when the GPU attends RAM parts (c: a model config)."""
        if self.resident is None or self.host_attention != "gpu":
            return 0
        per_layer = kv_store.bytes_per_token(1, c.num_kv_heads, c.head_dim, self.dtype)
        return blocks_for(self.max_context) * BLOCK_TOKENS * per_layer

    def describe(self, pool, max_tokens):
        per_block = pool.bytes_per_block
        text = (f"KV {pool.dtype} in VRAM: {self.vram_blocks_per_sequence() * per_block / 2**20:.1f} MiB per slot, "
                f"pool {pool.num_blocks} blocks of {pool.block_tokens} tokens ({pool.nbytes / 2**20:.0f} MiB)")
        if self.resident is not None:
            ram = max(0, blocks_for(max_tokens) - blocks_for(self.resident)) * per_block
            text += (f"; newest {self.resident} tokens resident, the rest in pinned RAM: up to {ram / 2**20:.1f} MiB "
                     f"per slot at {max_tokens} tokens, attended on the {self.host_attention}")
        return text

    def attention(self, be, q, kv, layer, start, scale, out, window=0, sinks=None):
        """q [T, Hq, D] at positions [start, start + T) against the sequence's KV (layer `layer`) -> out [T, Hq, D];
        window > 0: each query's last `window` positions; sinks: each head's sink logit [Hq] on the device, joined
        to the softmax once the key ranges are merged (kernels.attn_sinks)."""
        pool = kv.pool.layer(layer)  # (k, v, k_scale, v_scale)
        table, ram_keys = kv.device_table(start), kv.host_blocks * kv.block_tokens
        step = be.step.active if be.step is not None else None
        lse = None if sinks is None else be.rt.empty(q.shape[:2], np.float32)  # [T, Hq]
        if step is not None:  # a step graph's: the position on the device, splits planned for its bound
            self._step_attention(be, q, kv.dtype, pool, table, step.slot(kv, start)[1], step.bound, scale, out,
                                 window, lse)
        elif ram_keys == 0:
            be.kernels.paged_attention(kv.dtype, q, *pool, table, start, 0, scale, out, lse=lse, window=window)
        elif self.host_attention == "gpu":
            be.kernels.paged_attention(kv.dtype, q, *pool, table, start, 0, scale, out, lse=lse,
                                       stage=self._stage_ram_part(be, kv, layer), window=window)
        else:
            self._attention_split(be, q, kv, layer, pool, table, start, scale, out, ram_keys, window, sinks)
            return
        if sinks is not None:
            be.kernels.attn_sinks(out, lse, sinks)

    @staticmethod
    def attend_step(be, kv_index, q, k, v, chunks, scale, out, window=0, sinks=None):
        """Inside a step graph of several one-token chunks: k, v [n, Hkv, D] written, each into its chunk's sequence
        at the chunk's position, and q [n, Hq, D]'s attention over them into out [n, Hq, D], one launch each, where
        the chunks share one pool and one token takes a one-token kernel (attention_plan.slots_plan; its key splits,
        if any, merged by one more); else False (nothing queued)."""
        step = be.step.active if be.step is not None else None
        pools = {id(chunk.kv.pool) for chunk in chunks}
        kn = be.kernels
        if step is None or len(chunks) < 2 or len(pools) > 1 or slots_plan(
                q.shape[1], k.shape[1], q.shape[2], step.bound, kn.warp, kn.max_splits, kn.attention_rows,
                kn.short_attention_keys) is None:
            return False
        values, rows = split_scratch_sizes(1, q.shape[1], k.shape[1], q.shape[2], step.bound, kn.warp, kn.max_splits,
                                           kn.attention_rows, kn.short_attention_keys)  # a slot's
        n = len(chunks)
        scratch = None if values == 0 else (be.rt.empty((n * values,), np.float32), be.rt.empty((n * rows,), np.float32))
        kv = chunks[0].kv
        kp, vp, ks, vs = kv.pool.layer(kv_index)
        tables = step.tables[:len(chunks)]  # [n, nb]
        be.kernels.kv_write(kv.dtype, k, kp, ks, tables, 0, start_at=(step.positions, None), second=(v, vp, vs),
                            slot_table=tables.shape[1])
        lse = None if sinks is None else be.rt.empty(q.shape[:2], np.float32)  # [n, Hq]
        be.kernels.paged_attention_slots(kv.dtype, q, kp, vp, ks, vs, tables, step.positions, step.bound, scale, out,
                                         lse=lse, window=window, scratch=scratch)
        if sinks is not None:
            be.kernels.attn_sinks(out, lse, sinks)
        return True

    @staticmethod
    def _step_attention(be, q, kv_dtype, pool, table, position, bound, scale, out, window=0, lse=None):
        """One token's attention inside a step graph (position int64 [1] on the device, below the keys bound); its
        split scratch comes through be.rt, so the capture keeps it."""
        num_tokens, num_q_heads, head_dim = q.shape
        values, rows = split_scratch_sizes(num_tokens, num_q_heads, pool[0].shape[2], head_dim, bound, be.kernels.warp,
                                           be.kernels.max_splits, be.kernels.attention_rows,
                                           be.kernels.short_attention_keys)
        scratch = None if values == 0 else (be.rt.empty((values,), np.float32), be.rt.empty((rows,), np.float32))
        be.kernels.paged_attention(kv_dtype, q, *pool, table, bound - num_tokens, 0, scale, out, lse=lse,
                                   start_at=(position, scratch), window=window)

    def _stage_ram_part(self, be, kv, layer):
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
                buf = self._stage[name] = be.rt.empty((max(used, blocks_for(self.max_context)),) + host.shape[1:],
                                                      host.dtype)
            be.rt.copy_from_host_async(buf[:used], host[:used], be.stream)
            stage.append(buf)
        return tuple(stage)

    def _attention_split(self, be, q, kv, layer, pool, table, start, scale, out, ram_keys, window=0, sinks=None):
        """The GPU attends the VRAM part (pool: the layer's (k, v, k_scale, v_scale), through the device
        table) while the host attends the RAM part of q's keys; the two partial results are merged on the
        GPU by their log-sum-exp (the sinks, when given, join the VRAM part's before the merge)."""
        if self.host is None:
            raise ValueError("kv_host_attention 'cpu': the GPU backend was placed without a host backend to attend "
                             "the KV's RAM part")
        num_tokens, num_heads = q.shape[:2]
        q_host, q_copied = be.staging.download("attn_q", q, be.stream)
        out_dev = be.rt.empty(q.shape, np.float32)  # [T, Hq, D]
        lse_dev = be.rt.empty((num_tokens, num_heads), np.float32)  # [T, Hq]
        be.kernels.paged_attention(kv.dtype, q, *pool, table, start, ram_keys, scale, out_dev, lse=lse_dev,
                                   window=window)
        if sinks is not None:
            be.kernels.attn_sinks(out_dev, lse_dev, sinks)
        q_copied.synchronize()  # after the RAM part's copies too: they were queued before
        if len(self._identity) < kv.host_blocks:
            self._identity = np.arange(max(kv.host_blocks, 2 * len(self._identity)), dtype=np.int32)
        out_host = np.empty(q.shape, np.float32)
        lse_host = np.empty((num_tokens, num_heads), np.float32)
        self.host.paged_attention(q_host, *kv.host_layer(layer), self._identity, start, 0, ram_keys, scale, out_host,
                                  lse_host, window)
        be.kernels.attn_merge(out_dev, lse_dev, be.staging.upload("attn_out_host", out_host, be.stream),
                              be.staging.upload("attn_lse_host", lse_host, be.stream), out)
