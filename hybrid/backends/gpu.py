"""The GPU backend: dense weights, KV and scratch in VRAM, resident experts in the expert cache.

Every op of the forward pass runs as a kernel of gpu_kernels on the current stream, in order
and asynchronously to the host; activations are device arrays (the runtime's). As the device side of an `ExpertSplit` it runs the resident
experts' pairs of a layer as one grouped launch per projection (`submit_experts`), while the
host runs the rest. Shape legend: T tokens, H hidden, V vocab, R rows, C columns, nH heads,
D head dim, Hq / Hkv query / kv heads, L layers, E experts, K top-k, N pairs, F expert width,
W work tiles.
"""
import logging

import numpy as np

from cpu_kernels.rope import inv_freq_f32
from gpu_kernels.expert_cache import MIB, ExpertCache, expert_bytes, plan
from gpu_kernels.kernels import TILE_TOKENS, Kernels

from ..formats.weights import QuantTensor
from ..kv_cache import SequenceKV

log = logging.getLogger(__name__)

DEFAULT_RESERVE_MIB = 512


class DeviceSequenceKV(SequenceKV):
    """SequenceKV whose K and V [L, S, Hkv, D] live in VRAM."""

    def __init__(self, runtime, *args):
        self.runtime = runtime
        super().__init__(*args)

    def _allocate(self, capacity):
        shape = (self.num_layers, capacity, self.num_kv_heads, self.head_dim)
        k, v = self.runtime.empty(shape, np.float32), self.runtime.empty(shape, np.float32)  # [L, S, Hkv, D]
        if self.k is not None:
            k[:, : self.length] = self.k[:, : self.length]
            v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k, v


class GpuBackend:
    """expert_cache_mib: None = all VRAM left ("auto"); resident: a placement's bool mask [L, E]
    (default: fill the cache layer by layer); kv_tokens: KV positions to budget for (all sequences)."""

    name = "gpu"

    def __init__(self, runtime, expert_cache_mib=None, vram_reserve_mib=DEFAULT_RESERVE_MIB, kv_tokens=4096,
                 chunk_tokens=512, resident=None):
        self.rt = runtime
        self.stream = None  # the current stream: CuPy's own array operations run there too
        self.kernels = Kernels(runtime, self.stream)
        self.cache_bytes = None if expert_cache_mib is None else int(expert_cache_mib * MIB)
        self.reserve = int(vram_reserve_mib * MIB)
        self.kv_tokens, self.chunk_tokens = kv_tokens, chunk_tokens
        self.requested_resident = resident
        self.resident = None  # bool [L, E], set by place()
        self.budget = None
        self._dev = {}  # id(host weight) -> (device copy, host weight)
        self._positions = (None, None)  # (host positions, device copy) of the last batch
        self._inv_freq = {}  # (theta, D) -> RoPE frequencies f32 [D/2] on the device

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
        self.cache = ExpertCache(self.rt, model.layers, self.resident)
        log.info("%s on %s (%s, warp %d): %s", self.name, self.rt.device_name, self.rt.name, self.rt.warp_size,
                 self.budget.describe())

    def new_kv(self, num_layers, num_kv_heads, head_dim, max_tokens):
        return DeviceSequenceKV(self.rt, num_layers, num_kv_heads, head_dim, max_tokens)

    def _weight(self, host):
        return self._dev[id(host)][0]

    # -- dense ops -------------------------------------------------------------------------

    def linear(self, weight, x):
        """x [T, C] @ weight[R, C].T -> [T, R]."""
        out = self.rt.empty((x.shape[0], weight.shape[0]), np.float32)
        self.kernels.matmul(self._weight(weight), weight.qtype, x, out)
        return out

    def embed(self, weight, token_ids):
        out = self.rt.empty((len(token_ids), weight.shape[-1]), np.float32)  # [T, H]
        ids = self.rt.to_device(np.ascontiguousarray(token_ids, dtype=np.int64), self.stream)
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
            self._positions = (positions, self.rt.to_device(np.ascontiguousarray(positions), self.stream))
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
        return x[self.rt.to_device(np.ascontiguousarray(rows, dtype=np.int64), self.stream)]

    def to_host(self, x):
        return self.rt.to_host(x, stream=self.stream)

    # -- the device side of an ExpertSplit ------------------------------------------------

    def submit_experts(self, layer, x, ids, weights, groups):
        """Queue the pairs of `groups` (resident experts of `layer`) on the stream: gather, gate/up,
        SwiGLU, down, weighted combine. x [T, H], weights [T, K] on the device. Returns out [T, H]."""
        num_tokens, k = ids.shape
        gate_slots, up_slots, down_slots = self.cache.layers[layer.index]
        slots = self.cache.slot_of[layer.index][groups.expert_ids]  # [G]
        tiles = _work_tiles(groups.row_starts, slots)  # [3, W]
        num_pairs, num_tiles = len(groups.order), tiles.shape[1]
        row_of_pair = np.full(num_tokens * k, -1, dtype=np.int32)  # [T*K]
        row_of_pair[groups.order] = np.arange(num_pairs, dtype=np.int32)
        packed = self.rt.to_device(np.concatenate([groups.order.astype(np.int32), row_of_pair, tiles.reshape(-1)]),
                                   self.stream)
        order, pair_rows = packed[:num_pairs], packed[num_pairs:num_pairs + num_tokens * k]
        tile_args = [packed[num_pairs + num_tokens * k + i * num_tiles:][:num_tiles] for i in range(3)]
        xs = self.rt.empty((num_pairs, x.shape[1]), np.float32)  # [N, H]
        self.kernels.gather_rows(x, order, k, xs)
        width = layer.gate_exps.shape[1]
        gate = self.rt.empty((num_pairs, width), np.float32)  # [N, F]
        up = self.rt.empty((num_pairs, width), np.float32)  # [N, F]
        self.kernels.moe_matmul(gate_slots, layer.gate_exps.qtype, xs, gate, *tile_args)
        self.kernels.moe_matmul(up_slots, layer.up_exps.qtype, xs, up, *tile_args)
        self.kernels.swiglu(gate, up, gate)
        down = self.rt.empty((num_pairs, x.shape[1]), np.float32)  # [N, H]
        self.kernels.moe_matmul(down_slots, layer.down_exps.qtype, gate, down, *tile_args)
        out = self.rt.empty(x.shape, np.float32)  # [T, H]
        self.kernels.combine_rows(down, pair_rows, weights, k, out)
        return out

    def wait_experts(self, pending):
        """The device part's result; stream order makes later device work see it, so no host wait."""
        return pending

    def zeros_like(self, x):
        return self.rt.zeros(x.shape, x.dtype)

    def add_from_host(self, out, host_part):
        """out [T, H] (device) += host_part [T, H] (host)."""
        out += self.rt.to_device(host_part, self.stream)
        return out


def _work_tiles(row_starts, slots):
    """Groups -> int32 [3, W]: (slot, first row, row count) of each tile of <= TILE_TOKENS rows."""
    sizes = np.diff(row_starts)  # [G]
    per_group = (sizes + TILE_TOKENS - 1) // TILE_TOKENS  # [G]
    group_of = np.repeat(np.arange(len(sizes)), per_group)  # [W]
    first = np.cumsum(per_group) - per_group  # [G]
    rows = row_starts[group_of] + (np.arange(len(group_of)) - first[group_of]) * TILE_TOKENS  # [W]
    counts = np.minimum(TILE_TOKENS, row_starts[group_of + 1] - rows)  # [W]
    return np.stack([slots[group_of], rows, counts]).astype(np.int32)
