"""The GPU backend: dense weights, KV and scratch in VRAM, resident experts in the expert cache.

Every op of the forward pass runs as a kernel of gpu_kernels on the backend's own stream, in
order and asynchronously to the host; activations are device arrays (the runtime's). Host <-> device
copies of the hot path go through pinned buffers (gpu_staging.Staging), so the host never waits for
queued kernels except where it reads their results (the routing of each layer). The backend holds
its parts, each in its own module: the KV and its attention (`kv`, gpu_kv.py), the device side of
the hybrid split (`device_experts`, gpu_experts.py: the Experts contract's submit / wait go there)
and of the decode relay (`relay`, gpu_relay.py); this module keeps the weights and the dense ops.
Shape legend: T tokens, H hidden, V vocab, R rows, C columns, nH heads, D head dim,
Hq / Hkv query / kv heads, L layers, E experts, K top-k.
"""
import logging
import time

import numpy as np

from gpu_kernels.expert_cache import MIB, ExpertCache, expert_bytes, plan
from gpu_kernels.gemm import gemm_fits
from gpu_kernels.gemm import gemm_math as gemm_math_setting
from gpu_kernels.kernels import Kernels, describe_act_quant
from gpu_kernels.sources import FORMAT_HEADERS

from ..errors import ModelError
from ..formats.weights import QuantTensor
from .. import kv_store
from ..kv_cache import BLOCK_TOKENS, KVPool
from .base import Capabilities
from .gpu_delta import GpuDeltaOps
from .gpu_experts import MAX_DECODE_PAIRS, GpuExperts
from .gpu_kv import KV_HOST_ATTENTION, DeviceSequenceKV, GpuKV
from .gpu_layer_graphs import LayerGraphs
from .gpu_page_lock import PageLocked, lock_experts
from .gpu_relay import GpuRelay
from .gpu_staging import Staging
from .gpu_step import StepCapture

__all__ = ["DEFAULT_RESERVE_MIB", "DeviceSequenceKV", "GpuBackend", "KV_HOST_ATTENTION"]

log = logging.getLogger(__name__)

DEFAULT_RESERVE_MIB = 512
PCIE_PROBE_BYTES = 64 << 20  # the pinned host -> device copy timed at start-up
CHUNK_FLOPS_GEMM = 1.5e13  # prompt-chunk expert matmuls through the tiled GEMM (H100: 15-30 TFLOPS, gpu_model.md)
CHUNK_FLOPS_TILES = 1e12  # through the 8-token tile kernels (H100, MXFP4 at 50 % resident: ~0.3 TFLOPS)


def check_gpu_formats(weights):
    """ModelError naming the first weight whose GGML type has no GPU kernels (gpu_kernels/src)."""
    for w in weights:
        if isinstance(w, QuantTensor) and w.qtype not in FORMAT_HEADERS:
            kinds = ", ".join(sorted(q.name for q in FORMAT_HEADERS))
            raise ModelError(f"tensor '{w.name}' has type {w.qtype.name}, which has no GPU kernels yet (the GPU "
                             f"runs {kinds}); run it with --device cpu")


class GpuBackend(GpuDeltaOps):
    """expert_cache_mib: None = all VRAM left ("auto"); resident: a placement's bool mask [L, E]
    (default: fill the cache layer by layer); the KV pool in VRAM holds kv_sequences sequences of
    max_context positions in kv_dtype, or with kv_resident only their newest kv_resident positions (and a
    chunk), the rest in pinned RAM, attended by `kv_host_attention` (gpu_kv.py); prefill_borrow: let large
    chunks run non-resident experts here (copied in per chunk). decode_graphs: each layer's decode expert
    launches replayed as a graph; dense_graphs: a decode layer's dense launches replayed as two graphs
    (gpu_layer_graphs.py: much faster decode, bench/results/gpu_model.md); else one by one; step_graphs (with
    dense_graphs): a decode step whose experts are all resident captured whole, one graph (gpu_step.py). act_quant: how
    one-token matmuls take x (gpu_kernels.kernels.gpu_act_quant); gemm_math: how the prompt chunks' tiled GEMMs
    multiply (gpu_kernels.gemm.gemm_math). solo_chunk_tokens: prompt tokens a step may read while no slot decodes, where
    every expert is resident (place() keeps them where VRAM holds their activations; None: chunk_tokens)."""

    name = "gpu"
    capabilities = Capabilities(graphed_decode=True, step_graph=True, decode_experts=True,
                                max_decode_pairs=MAX_DECODE_PAIRS, decode_relay_device=True, expert_cache=True,
                                fused_norms=True, resident_chunks=True)

    def __init__(self, runtime, expert_cache_mib=None, vram_reserve_mib=DEFAULT_RESERVE_MIB, kv_sequences=1,
                 max_context=4096, chunk_tokens=512, resident=None, prefill_borrow=True, kv_dtype="f32",
                 kv_resident=None, kv_host_attention="gpu", decode_graphs=True, dense_graphs=True, step_graphs=True,
                 act_quant="auto", gemm_math=None, solo_chunk_tokens=None):
        self.kv = GpuKV(kv_dtype, max_context, chunk_tokens, kv_resident, kv_host_attention)
        self.rt = runtime
        self.stream = runtime.stream()  # made current at every embed: CuPy's own array operations run there too
        self.kernels = Kernels(runtime, self.stream, act_quant=act_quant)
        self.kernels.gemm_math = gemm_math_setting(gemm_math)
        self.staging = Staging(runtime)
        self.device_experts = GpuExperts(decode_graphs)
        self.relay = GpuRelay()
        self.prefill_borrow = prefill_borrow
        self.time_experts = False  # record timing events around each device part (ExpertSplit's trace)
        self.borrow_bytes_per_second = None  # measured at place()
        self.page_locked = PageLocked()  # the expert weights' pages locked in place at place() (gpu_page_lock.py)
        self.cache_bytes = None if expert_cache_mib is None else int(expert_cache_mib * MIB)
        self.reserve = int(vram_reserve_mib * MIB)
        self.kv_sequences, self.chunk_tokens = kv_sequences, chunk_tokens
        self.requested_solo = solo_chunk_tokens
        self.solo_chunk_tokens = None  # prompt tokens a step reads while no slot decodes, if more (set by place())
        self.kv_pool = None  # made by place()
        self.requested_resident = resident
        self.resident = None  # bool [L, E], set by place()
        self.budget = None
        self.cache = None  # the ExpertCache, made by place()
        self._dev = {}  # id(host weight) -> (device copy, host weight)
        self._positions = (None, None)  # (host positions, device copy) of the last batch
        self.layer_graphs = LayerGraphs() if dense_graphs else None
        self.step = StepCapture() if dense_graphs and step_graphs else None

    # -- placement -------------------------------------------------------------------------

    def place(self, model, host=None):
        """Upload the dense weights, size the VRAM budget, fill the expert cache; logs the budget. host: the host
        backend, which attends a RAM KV part with kv_host_attention "cpu"."""
        self.kv.host = host
        c = model.config
        dense = [w for w in (model.token_embd, model.output, model.output_norm) if w is not None]  # a stage's may not
        for layer in model.layers:  # resident: shared experts and dense FFNs run for every token
            dense += layer.dense_weights()
        unique = {id(w): w for w in dense}
        moe_layers = [layer for layer in model.layers if layer.gate_exps is not None]
        check_gpu_formats(list(unique.values()) + [w for layer in moe_layers
                                                   for w in (layer.gate_exps, layer.up_exps, layer.down_exps)])
        dense_bytes = sum(w.nbytes for w in unique.values())
        every_token = sum(w.nbytes for layer in model.layers for w in (layer.gate_shexp, layer.up_shexp, layer.down_shexp,
                                                                      layer.ffn_gate, layer.ffn_up, layer.ffn_down)
                          if w is not None)
        if every_token:
            log.info("dense weights %.0f MiB, of which shared experts and dense FFN layers %.0f MiB (resident: every "
                     "token runs them)", dense_bytes / MIB, every_token / MIB)
        per_block = kv_store.bytes_per_token(model.num_kv_layers, c.num_kv_heads, c.head_dim, self.kv.dtype) * BLOCK_TOKENS
        kv_blocks = self.kv_sequences * self.vram_blocks_per_sequence()
        kv = kv_blocks * per_block + self.kv.stage_bytes(c)
        if model.recurrent_shape is not None:  # the linear-attention layers' state of each sequence
            kv += self.kv_sequences * model.recurrent_shape.slot_bytes
        activations = 4 * (8 * c.hidden_size + 2 * c.num_heads * c.head_dim  # bytes a token of a chunk, less logits
                            + c.num_experts_per_tok * (3 * c.moe_intermediate_size + 2 * c.hidden_size)
                            + 3 * max(c.dense_intermediate_size, c.shared_intermediate_size))
        scratch = self.chunk_tokens * (4 * c.vocab_size + activations)
        free, total = self.rt.memory_info()
        self.budget, self.resident = plan(free, total, dense_bytes, kv, scratch, self.reserve,
                                          [expert_bytes(layer) if layer.gate_exps is not None else 0
                                           for layer in model.layers], c.num_experts,
                                          self.cache_bytes, self.requested_resident)
        self.solo_chunk_tokens = self._solo_chunk(moe_layers, free, activations)
        attention = [layer for layer in model.layers if layer.attn_q is not None]  # not linear-attention layers
        projections = [(layer.attn_q, layer.attn_k, layer.attn_v) for layer in attention]
        self._projections = {layer.index: self._upload_projections(p) for layer, p in zip(attention, projections)}
        uploaded = {id(w) for p in projections for w in p}
        for w in unique.values():
            if id(w) not in uploaded:
                self._dev[id(w)] = (self.rt.to_device(np.ascontiguousarray(w.raw if isinstance(w, QuantTensor) else w)),
                                    w)
        self.kv_pool = KVPool(model.num_kv_layers, c.num_kv_heads, c.head_dim, self.kv.dtype, num_blocks=kv_blocks,
                              max_blocks=kv_blocks, allocate=self.rt.empty, where="VRAM")
        self.resident[[layer.index for layer in model.layers if layer.gate_exps is None]] = False  # dense layers
        self.cache = ExpertCache(self.rt, model.layers, self.resident, self.stream)
        self.device_experts.width = max((layer.gate_exps.shape[1] for layer in moe_layers), default=0)
        self.borrow_bytes_per_second = self._measure_upload()
        self.page_locked = lock_experts(self.rt, moe_layers, self) if self.prefill_borrow and moe_layers \
            and not self.resident.all() else PageLocked()
        log.info("%s on %s (%s, warp %d): %s; host -> device copies %.1f GB/s; one-token matmuls take x as %s",
                 self.name, self.rt.device_name, self.rt.name, self.rt.warp_size,
                 self.budget.describe(), self.borrow_bytes_per_second / 1e9,
                 describe_act_quant(self.kernels.act_quant))


    def _solo_chunk(self, moe_layers, free, activations):
        """The requested solo_chunk_tokens where they exceed chunk_tokens, every expert of moe_layers is resident, the
        KV is all in VRAM (no resident window sized for chunk_tokens) and the VRAM the budget leaves holds the longer
        chunk's activations; else None."""
        solo = self.requested_solo
        if not solo or solo <= self.chunk_tokens or not moe_layers or self.kv.resident is not None \
                or not self.resident[[layer.index for layer in moe_layers]].all():
            return None
        b = self.budget
        left = free - (b.dense + b.kv + b.scratch + b.reserve + b.expert_cache)
        if (solo - self.chunk_tokens) * activations > left:
            log.info("prompt chunks of %d tokens while nobody decodes: not taken, their activations need %.0f MiB more "
                     "than the %.0f MiB VRAM left", solo, (solo - self.chunk_tokens) * activations / MIB, left / MIB)
            return None
        return solo

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


    # -- KV (gpu_kv.py) --------------------------------------------------------------------

    def vram_blocks_per_sequence(self):
        """KV blocks a sequence may hold in VRAM (hybrid.kv_cache.vram_blocks)."""
        return self.kv.vram_blocks_per_sequence()

    def new_kv_pool(self, num_layers, num_kv_heads, head_dim, dtype, num_tokens):
        """The pool place() made (its size comes from the VRAM budget, not from num_tokens)."""
        if dtype != self.kv.dtype:
            raise ValueError(f"KV dtype {dtype}: this GPU backend was made for {self.kv.dtype}")
        return self.kv_pool

    def new_kv(self, pool, max_tokens):
        return DeviceSequenceKV(self, pool, max_tokens, self.kv.resident)

    def describe_kv(self, pool, max_tokens):
        return self.kv.describe(pool, max_tokens)

    def attention(self, q, kv, layer, start, scale, out, window=0, sinks=None):
        """q [T, Hq, D] at positions [start, start + T) against the sequence's KV (layer `layer`) -> out [T, Hq, D];
        window > 0: each query's last `window` positions; sinks: a layer's attn_sinks [Hq] (uploaded at place)."""
        sinks_dev = None if sinks is None else self._weight(sinks)  # [Hq]
        self.kv.attention(self, q, kv, layer, start, scale, out, window, sinks_dev)


    def attend_step(self, kv_index, q, k, v, batch, scale, out, window=0, sinks=None):
        """Inside a step graph of several one-token chunks: every chunk's KV write and attention in one launch each
        (gpu_kv.GpuKV.attend_step), or False where the chunks need their own."""
        sinks_dev = None if sinks is None else self._weight(sinks)  # [Hq]
        return self.kv.attend_step(self, kv_index, q, k, v, batch.chunks, scale, out, window, sinks_dev)

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

    def linear(self, weight, x, exact=False, same_x=False):
        """x [T, C] @ weight[R, C].T -> [T, R]; exact: x as float32 also where one token's matmul would round it
        to int16 (act_quant); same_x: x unchanged since the last linear, whose rounding of it may be read again."""
        out = self.rt.empty((x.shape[0], weight.shape[0]), np.float32)
        self.kernels.matmul(self._weight(weight), weight.qtype, x, out, float_x=exact, same_x=same_x)
        return out

    def add_into(self, x, y):
        """x += y in place (the residual stream) with our add kernel rather than CuPy's `+=`, which costs several
        times one launch of ours in a decode layer's host time (bench/results/gpu_model.md)."""
        if x.shape != y.shape or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise ValueError(f"add_into: {x.shape} and {y.shape}: expected contiguous arrays of one shape")
        self.kernels.add_into(x, y)

    def add_rmsnorm(self, x, y, weight, eps):
        """x += y in place, then rmsnorm(x) as a new array: add_into and rmsnorm in one launch."""
        if x.shape != y.shape or not (x.flags.c_contiguous and y.flags.c_contiguous):
            raise ValueError(f"add_rmsnorm: {x.shape} and {y.shape}: expected contiguous arrays of one shape")
        out = self.rt.empty(x.shape, np.float32)
        self.kernels.add_rmsnorm(x, y, self._weight(weight), eps, out)
        return out

    def project_qkv(self, layer, h):
        """h [T, H] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], qk). One token: one launch for each run of
        the weights that share a device array (_upload_projections), and where q and k share one, qk is
        [1, Hq + Hkv, D] over both (one RoPE launch for the two); else None. h is rounded to int16 once for them all
        (Kernels.matmul's same_x) where their formats round it alike."""
        if h.shape[0] != 1:
            num_tokens, d = h.shape[0], layer.head_dim
            q, k, v = (self.linear(w, h, same_x=i > 0).reshape(num_tokens, -1, d)
                       for i, w in enumerate((layer.attn_q, layer.attn_k, layer.attn_v)))
            return q, k, v, None
        d, parts, qk = layer.head_dim, [], None
        for i, (raw, qtype, rows) in enumerate(self._projections[layer.index]):
            out = self.rt.empty((1, sum(rows)), np.float32)
            self.kernels.matmul(raw, qtype, h, out, same_x=i > 0)
            flat, start = out.reshape(-1), 0  # [R], contiguous: its slices are too
            for r in rows:
                parts.append(flat[start:start + r].reshape(1, r // d, d))
                start += r
            if i == 0 and len(rows) > 1:
                qk = flat[:rows[0] + rows[1]].reshape(1, (rows[0] + rows[1]) // d, d)
        q, k, v = parts
        return q, k, v, qk

    def empty(self, shape):
        """A float32 work array of `shape` on the device, contents undefined (through self.rt: a captured region's
        allocations are kept)."""
        return self.rt.empty(shape, np.float32)

    def begin_step(self):
        """Starts every forward pass (or a pipeline stage's part of it): this device and its stream current in the
        calling thread."""
        self.rt.use()
        if self.stream is not None:
            self.stream.use()
        self.device_experts.new_step()

    def embed(self, weight, token_ids):
        """Starts every forward pass (begin_step)."""
        self.begin_step()
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

    # -- a decode step as one graph (gpu_step.py; hybrid/runners.py GraphRunner) ---------------------

    def prepare_step_graph(self, chunks, num_layers, top_k):
        """The keys bound of a step graph over `chunks` (one token each), or None where the step needs the host."""
        return None if self.step is None else self.step.prepare(self, chunks, num_layers, top_k)

    def step_graph_key(self, chunks, bound):
        return self.step.graph_key(chunks, bound)

    def begin_step_graph(self, positions, bound, chunks):
        """Until end_step_graph, the KV writes and attention of `chunks` read their positions from `positions` (int64
        [n] on the device) and plan for `bound` keys, and the experts queue their launches into the step's graph."""
        self.step.begin(positions, bound, chunks)

    def end_step_graph(self):
        self.step.end()

    def keep_step_routing(self, layer_index, ids):
        self.step.keep_routing(self, layer_index, ids)

    def queue_step_routing(self, tokens=1):
        """A queued host copy of the `tokens`-chunk step graph's routing ids [L, n, K]; wait_rows(handle) returns
        it."""
        return self.step.queue_routing(self, tokens)

    def use_device_positions(self, positions, on_device):
        """rope() of a batch with these host positions reads `on_device` (int64, already uploaded) instead."""
        self._positions = (positions, on_device)

    def rope(self, x, positions, freqs, scale=1.0):
        """In place over x [T, nH, D]: its first 2 * len(freqs) dims rotated (freqs: a layer's rope_freqs, uploaded
        at place), cos and sin times scale; positions int64 [T] on the host."""
        self.kernels.rope_neox(x, self._device_positions(positions), self._weight(freqs), scale)

    def _device_positions(self, positions):
        """positions (int64 [T] on the host) on the device: uploaded once a batch, or use_device_positions' array."""
        if self._positions[0] is not positions:
            self._positions = (positions, self.staging.upload("positions", np.ascontiguousarray(positions),
                                                              self.stream))
        return self._positions[1]

    def qk_norm_rope(self, q, k, qk, layer, positions):
        """In place: each head of q [T, Hq, D] and k [T, Hkv, D] RMSNormed (layer.attn_q_norm, attn_k_norm), then
        RoPE over its first 2 * len(layer.rope_freqs) dims (as rmsnorm_heads then rope): one launch over qk (q and k
        as one view) where given, else one for each."""
        pos, freqs = self._device_positions(positions), self._weight(layer.rope_freqs)
        q_norm, k_norm = self._weight(layer.attn_q_norm), self._weight(layer.attn_k_norm)
        if qk is not None:
            self.kernels.qk_norm_rope(qk, q_norm, k_norm, q.shape[1], layer.eps, pos, freqs, layer.rope_scale)
            return
        for x, weight in ((q, q_norm), (k, k_norm)):
            self.kernels.qk_norm_rope(x, weight, weight, x.shape[1], layer.eps, pos, freqs, layer.rope_scale)

    def route_topk_softmax(self, router_logits, k):
        """router_logits [T, E] -> (ids [T, K], weights [T, K]): the top k, softmax over those k (gpt-oss)."""
        num_tokens = router_logits.shape[0]
        ids = self.rt.empty((num_tokens, k), np.int32)  # [T, K]
        weights = self.rt.empty((num_tokens, k), np.float32)  # [T, K]
        self.kernels.route_topk_softmax(router_logits, k, ids, weights)
        return ids, weights



    def route(self, router_logits, k, normalize):
        num_tokens = router_logits.shape[0]
        ids = self.rt.empty((num_tokens, k), np.int32)  # [T, K]
        weights = self.rt.empty((num_tokens, k), np.float32)  # [T, K]
        self.kernels.route_topk(router_logits, k, normalize, ids, weights)
        return ids, weights

    def route_sigmoid(self, router_logits, bias, k, num_groups, topk_groups, normalize, scale):
        """The SigmoidTopK router (routing.cu): router_logits [T, E], bias [E] -> (ids int32 [T, K], weights [T, K])."""
        num_tokens = router_logits.shape[0]
        ids = self.rt.empty((num_tokens, k), np.int32)  # [T, K]
        weights = self.rt.empty((num_tokens, k), np.float32)  # [T, K]
        self.kernels.route_sigmoid(router_logits, self._weight(bias), k, num_groups, topk_groups, normalize, scale,
                                   ids, weights)
        return ids, weights

    def add_bias(self, x, bias):
        """x [T, R] += bias [R] in place."""
        self.kernels.add_bias(x, self._weight(bias))

    def silu_mul(self, gate, up):
        """silu(gate) * up, a new [T, F]."""
        out = self.rt.empty(gate.shape, np.float32)
        self.kernels.swiglu(gate, up, out)
        return out

    def take_rows(self, x, rows):
        return x[self.staging.upload("rows", np.ascontiguousarray(rows, dtype=np.int64), self.stream)]

    def to_host(self, x):
        return self.rt.to_host(x, stream=self.stream)


    def synchronize(self):
        if self.stream is not None:
            self.stream.synchronize()

    # -- the device side of an ExpertSplit (the Experts contract, hybrid/backends/base.py; gpu_experts.py) ------

    def submit(self, layer, x, ids, weights, groups=None, borrowed=None):
        """Queue a layer's pairs of `groups` and `borrowed` (x [T, H], ids / weights [T, K] on the device), or with
        groups None a decode step's resident pairs, found on the device; wait(pending) gives the output [T, H]."""
        if groups is None:
            return self.device_experts.submit_decode(self, layer, x, ids, weights)
        return self.device_experts.submit_groups(self, layer, x, ids, weights, groups, borrowed)

    def submit_resident_chunk(self, layer, x, ids, weights):
        """Queue a prompt chunk's pairs of a layer whose experts are all resident, grouped here (nothing read back)."""
        return self.device_experts.submit_resident_chunk(self, layer, x, ids, weights)

    def wait(self, pending):
        """The device part's result; stream order makes later device work see it, so no host wait."""
        return pending.out

    def chunk_expert_flops(self, layer):
        """The FLOP/s a prompt chunk's expert matmuls of layer's weight formats are expected to reach here (the borrow
        cost model's estimate until it has timed them): the tiled GEMM's where each projection takes it."""
        hidden, width = layer.gate_exps.shape[2], layer.gate_exps.shape[1]
        projections = ((layer.gate_exps.qtype, hidden), (layer.up_exps.qtype, hidden), (layer.down_exps.qtype, width))
        return CHUNK_FLOPS_GEMM if all(gemm_fits(q, c) for q, c in projections) else CHUNK_FLOPS_TILES

    def fetch_routing(self, ids, weights):
        return self.device_experts.fetch_routing(self, ids, weights)

    def queue_routing(self, ids, weights, x):
        return self.device_experts.queue_routing(self, ids, weights, x)

    def wait_routing(self, handle):
        return self.device_experts.wait_routing(handle)

    def fetch_rows(self, x):
        """Queue a host copy of x [T, H]; wait_rows(handle) returns it."""
        return self.staging.download("rows_to_host", x, self.stream)

    def queue_ids(self, ids, tag):
        """Queue a host copy of routing ids [T, K] through pinned buffer `tag`; wait_rows(handle) returns it."""
        return self.staging.download(tag, ids, self.stream)

    @staticmethod
    def wait_rows(handle):
        view, done = handle
        done.synchronize()
        return view

    def expert_seconds(self, pending):
        """GPU time of a timed device part (waits for it)."""
        return self.rt.elapsed(pending.start, pending.stop)

    def chunk_part_seconds(self, pending):
        """GPU time of a prompt chunk's device part, borrowed copies included (waits for it)."""
        return self.expert_seconds(pending)

    def zeros_like(self, x):
        return self.rt.zeros(x.shape, x.dtype)

    def add_from_host(self, out, host_part):
        return self.relay.add_from_host(self, out, host_part)

    # -- the device side of the decode relay (hybrid/relay.py; gpu_relay.py) ------------------

    def decode_mailbox(self, num_layers, top_k, hidden, max_tokens=1):
        return self.relay.decode_mailbox(self, num_layers, top_k, hidden, max_tokens)

    def publish_decode(self, layer, x, ids, weights, mailbox, seq):
        self.relay.publish_decode(self, layer, x, ids, weights, mailbox, seq)

    def await_host_rows(self, out, layer, mailbox, seq, timeout_s, add=True):
        return self.relay.await_host_rows(self, out, layer, mailbox, seq, timeout_s, add)

    def relay_step(self, seq):
        """The relay kernels queued from now on (a step graph's launch) post and wait for step number seq."""
        self.relay.set_step(self, seq)
