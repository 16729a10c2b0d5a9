"""The CPU backend: every op of the forward pass as a Numba kernel over NumPy arrays.

With one thread, small ops (one decode token's norm, rope, routing, combine, its attention
projections) run as the serial twins of their kernels: no parallel region to open. With more
threads every op runs parallel: serial stretches between the regions let the pool's threads fall
asleep, and waking them costs more than the small ops gain. Tiny ops (a few thousand values: one
token's norms, rope, routing, combine) run serially at any thread count (cpu_thresholds.py says
why). A layer's experts run as two parallel regions, gate and up together, then down. Decode steps'
layers run as one compiled call each (the runner of cpu_layer.py).

The weights are read from copies in huge pages, not from the mapped file (`place`). The hot path
calls the format kernels directly: each weight's raw bytes are checked once (`_WeightKernels`,
cached per weight), the activations, groups and outputs are the backend's own, and the act_quant
setting becomes the kernels' code once per backend (at its first weight), so a call pays for the
Numba dispatch alone.

Shape legend: T tokens, H hidden, R output rows, C input columns, nH heads,
D head dim, E experts, K top-k, N (token, expert) pairs, F expert FFN width.
"""
import logging
import math
import os
import threading

import numba
import numpy as np
from tqdm import tqdm

from cpu_kernels import activation, attention, moe_combine, prefetch, rmsnorm, rope, routing
from cpu_kernels.formats import format_for, is_supported
from cpu_kernels.act_quant import FLOAT, INT16, act_quant_code
from cpu_kernels.tiles import DECODE_MAX_TOKENS, ONE_EXPERT, ONE_ROW, PROMPT_ITEMS, kernels_of

from ..host_memory import huge_page_copy
from ..kv_cache import KVPool, SequenceKV, blocks_for
from ..warm_up import compile_notice
from .base import Capabilities, separate_projections
from .cpu_delta import CpuDeltaOps
from .cpu_layer import compiled_runner
from .cpu_thresholds import (SERIAL_MAX_ATTENTION, SERIAL_MAX_ELEMENTS, SERIAL_MAX_WEIGHT_BYTES, TINY_MAX_ATTENTION,
                             TINY_MAX_ELEMENTS)

log = logging.getLogger(__name__)

COPY_MAX_FREE_SHARE = 0.5  # file-mapped weights are copied while they take at most this share of the free memory
PROGRESS_MIN_BYTES = 1 << 30  # copies of at least this many bytes show a progress bar


def _available_bytes():
    """Memory the system can hand out (free + reclaimable page cache: MemAvailable), else its free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _WeightKernels:
    """A weight's (parallel, serial) moe kernels and its raw as [E, R, B], checked once (per raw array)."""

    def __init__(self, weight):
        self.weight, self.raw = weight, weight.raw  # held: the cache's id() key stays this weight's
        self.raws = (weight.raw if weight.raw.ndim == 3 else weight.raw.reshape(1, *weight.raw.shape),)
        self.fmt = format_for(weight.qtype)
        self.parallel, self.serial, self.cols = kernels_of(self.fmt, self.raws[0])


class _Scratch:
    """Work arrays kept between calls, one set per thread. A prompt chunk's expert intermediates are tens
    of MB; fresh arrays meet their pages first inside the parallel kernels, and two threads faulting
    pages in at once took ~11 ms for a 16 MB array that a warm one fills in ~1 ms (512-token chunk,
    2 threads)."""

    def __init__(self):
        self.arrays = {}
        self.fused_work = {}  # (shapes, batch size, threads): cpu_decode_fused.new_work's arrays, newest last

    def get(self, name, shape):
        """float32 `shape`, contents undefined: a view of the named buffer, grown when too small."""
        size = math.prod(shape)
        buf = self.arrays.get(name)
        if buf is None or buf.size < size:
            buf = self.arrays[name] = np.empty(size, dtype=np.float32)
        return buf[:size].reshape(shape)


def expert_work_bytes(num_tokens, top_k, hidden, width):
    """Bytes of one thread's reused expert work arrays (_Scratch) after a step of num_tokens tokens: xs [N, H] (then
    the activation [N, F]: the larger), down [N, H], gate and up [N, F] float32, N = num_tokens * top_k pairs."""
    return 4 * num_tokens * top_k * (max(hidden, width) + hidden + 2 * width)


class CpuBackend(CpuDeltaOps):
    """fused_decode: compiled decode layers as one parallel region each (cpu_decode_fused.py): True / False
    forces it on / off, None: from cpu_layer.FUSED_MIN_THREADS threads on. act_quant: how decode dots round
    the activations (cpu_kernels.act_quant's names; None: its default)."""

    name = "cpu"
    capabilities = Capabilities(compiled_decode_layer=True, decode_relay_host=True, host_decode_experts=True,
                                parallel_min_tokens=True)

    fused_decode = None
    act_quant_name = None
    prefetch_rows = None
    act_quant = None  # the kernels' act_quant code, from act_quant_name at the first weight's use
    _kernels = None  # id(weight): _WeightKernels, made at first use (subclasses need not call an __init__)
    _local = None  # per thread: the _Scratch of grouped_experts
    _host_plans = None  # layer index: cpu_host_experts.HostExpertsPlan, made at the layer's first hybrid decode step
    # a hybrid decode step's host experts with their gate+up and down items claimed by the threads (a thread slowed
    # by a core it shares holds up only what it took), not in static shares (cpu_host_experts.claimed_matmul_template;
    # bit-identical)
    claimed_host_experts = True
    # int64 [W, cpu_decode_fused.TRACE_COLUMNS]: ticks each worker of a fused decode layer spends per stage,
    # summed over calls (cpu_decode_fused.fused_layer; bench/fused_stages.py sets it); zero rows: not profiled
    stage_trace = np.zeros((0, 0), dtype=np.int64)

    def __init__(self, fused_decode=None, act_quant=None, prefetch_rows=None):
        self.fused_decode, self.act_quant_name = fused_decode, act_quant
        self.prefetch_rows = prefetch_rows  # the decode prefetch distance; None: timed at place()

    def _scratch(self):
        """The calling thread's work arrays (see _Scratch)."""
        if self._local is None:
            self._local = threading.local()
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = _Scratch()
        return scratch

    def _kernels_of(self, weight):
        if self._kernels is None:
            self._kernels, self.act_quant = {}, act_quant_code(self.act_quant_name)
        found = self._kernels.get(id(weight))
        if found is None or found.weight is not weight or found.raw is not weight.raw:  # new, or raw replaced
            found = self._kernels[id(weight)] = _WeightKernels(weight)
        return found

    def place(self, model, host=None, keep=None):
        """Copy the file-mapped (read-only) weights into anonymous memory advised for transparent huge pages
        (hybrid/host_memory.py): a 1-thread decode read its experts at ~7 GB/s from 4 KiB file pages, ~23 GB/s
        from 2 MiB pages (TLB misses; bench/results/cpu_decode_profile.md). Left mapped where the copies would take over
        COPY_MAX_FREE_SHARE of the free memory. Then the decode prefetch distance is chosen for this host from
        timed dots over the experts, in the model's order (cpu_kernels/prefetch.py)."""
        mapped = [t for name, t in model.weights.tensors.items()
                  if not t.raw.flags.writeable and (keep is None or keep(name))]  # keep: trimmed stage weights
        size = sum(t.raw.nbytes for t in mapped)
        free = _available_bytes()
        if size > COPY_MAX_FREE_SHARE * free:
            log.info("weights stay memory-mapped (%.0f MiB, %.0f MiB available): decode reads them through 4 KiB "
                     "pages", size / 2**20, free / 2**20)
        else:
            with tqdm(total=size, unit="B", unit_scale=True, desc="weights into RAM",
                      disable=size < PROGRESS_MIN_BYTES, leave=False) as bar:
                for tensor in mapped:
                    tensor.raw = huge_page_copy(tensor.raw)
                    bar.update(tensor.raw.nbytes)
        experts = [t for name, t in model.weights.tensors.items() if name.endswith("_exps.weight")]
        with compile_notice("timing the decode prefetch distance"):
            prefetch.calibrate([t for t in experts if is_supported(t.qtype)], rows=self.prefetch_rows)

    def parallel_min_tokens(self, config):
        """The fewest tokens of a prompt chunk with which every op of a step takes its parallel kernel
        (hybrid/warm_up.py compiles both variants): the smallest op a token (routing logits, or a pair's
        row) past its serial threshold, and attention's T * T * Hq * D past its own."""
        elementwise = SERIAL_MAX_ELEMENTS if _one_thread() else TINY_MAX_ELEMENTS
        attention_max = SERIAL_MAX_ATTENTION if _one_thread() else TINY_MAX_ATTENTION
        per_token = min(config.hidden_size, config.num_kv_heads * config.head_dim, config.num_experts,
                        config.num_experts_per_tok * max(config.hidden_size, config.moe_intermediate_size))
        by_attention = math.isqrt(attention_max // (config.num_heads * config.head_dim)) + 1
        return max(elementwise // per_token + 1, by_attention)

    def new_kv_pool(self, num_layers, num_kv_heads, head_dim, dtype, num_tokens):
        """The model's KV pool in RAM: room for num_tokens positions reserved (committed as written); it
        grows if more sequences than planned are alive at once."""
        return KVPool(num_layers, num_kv_heads, head_dim, dtype, num_blocks=blocks_for(num_tokens))

    def new_kv(self, pool, max_tokens):
        return SequenceKV(pool, max_tokens)

    def describe_kv(self, pool, max_tokens):
        per_slot = pool.bytes_per_block * blocks_for(max_tokens, pool.block_tokens)
        return f"KV {pool.dtype} in RAM: {per_slot / 2**20:.1f} MiB per slot at {max_tokens} tokens"

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[rows])

    def to_host(self, x):
        return x

    def linear(self, weight, x, exact=False):
        """x [T, C] @ weight[R, C].T -> [T, R]; exact: x multiplied as float32 whatever act_quant rounds it to."""
        kernels = self._kernels_of(weight)
        num_tokens = x.shape[0]
        if x.ndim != 2 or x.shape[1] != kernels.cols or x.dtype != np.float32:
            raise ValueError(f"linear {weight.name}: x {x.dtype} {x.shape} should be float32 [T, {kernels.cols}]")
        out = np.empty((num_tokens, weight.shape[0]), dtype=np.float32)  # [T, R]
        serial = num_tokens == 1 and weight.raw.nbytes <= SERIAL_MAX_WEIGHT_BYTES and _one_thread()
        row_starts = ONE_ROW if num_tokens == 1 else np.array([0, num_tokens], dtype=np.int64)
        act_quant = FLOAT if exact else self.act_quant
        split = self._exact_dot(weight, num_tokens) if exact else None  # cpu_delta.py: x as int16 hi + lo
        if split is not None:
            split.matmul(weight.raw, np.ascontiguousarray(x), out, _one_thread())
            return out
        (kernels.serial if serial else kernels.parallel)(
            kernels.raws, np.ascontiguousarray(x), ONE_EXPERT, row_starts, (out,), act_quant)
        return out

    def layer_runner(self, recipes, plain):
        """The compiled decode layers' runner (cpu_layer.py) for recipes (one per layer, or one for all), or `plain`
        where they implement no block of them."""
        return compiled_runner(self, recipes, plain)

    def empty(self, shape):
        """A float32 work array of `shape`, contents undefined."""
        return np.empty(shape, dtype=np.float32)

    def embed(self, weight, token_ids):
        rows = np.ascontiguousarray(weight.raw[token_ids])  # [T, B]
        out = np.empty((len(token_ids), weight.shape[-1]), dtype=np.float32)  # [T, H]
        format_for(weight.qtype).dequantize(rows, out)
        return out

    def rmsnorm(self, x, weight, eps):
        out = np.empty_like(x)
        _small_or_parallel(x.size, rmsnorm.rmsnorm_serial, rmsnorm.rmsnorm)(x, weight, eps, out)
        return out

    def rmsnorm_heads(self, x, weight, eps):
        """In place over x [T, nH, D]."""
        rows = x.reshape(-1, x.shape[-1])  # [T*nH, D], a view
        _small_or_parallel(x.size, rmsnorm.rmsnorm_serial, rmsnorm.rmsnorm)(rows, weight, eps, rows)

    def add_into(self, x, y):
        """x += y in place (the residual stream)."""
        x += y

    def project_qkv(self, layer, h):
        """h [T, H] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], None)."""
        return separate_projections(self, layer, h)

    def rope(self, x, positions, freqs, scale=1.0):
        """In place over x [T, nH, D]: its first R = 2 * len(freqs) dims rotated, cos and sin times scale."""
        _small_or_parallel(x.size, rope.rope_neox_freqs_serial, rope.rope_neox_freqs)(x, positions, freqs, scale, x)

    def attention(self, q, kv, layer, start, scale, out, window=0, sinks=None):
        """q [T, Hq, D] at positions [start, start + T) against the sequence's KV (layer `layer`) -> out [T, Hq, D];
        window > 0: the last `window` positions only; sinks [Hq]: each head's sink logit in the softmax."""
        k, v, k_scale, v_scale = kv.pool.layer(layer)
        lse = None if sinks is None else np.empty(q.shape[:2], dtype=np.float32)  # [T, Hq]
        paged_attention(q, k, v, k_scale, v_scale, kv.table, start, 0, start + q.shape[0], scale, out, lse, window)
        if sinks is not None:
            attention.apply_sinks(out, lse, sinks)

    def route_topk_softmax(self, router_logits, k):
        """router_logits [T, E] -> (ids [T, K], weights [T, K]): the top k, softmax over those k (gpt-oss)."""
        num_tokens = router_logits.shape[0]
        ids = np.empty((num_tokens, k), dtype=np.int64)  # [T, K]
        weights = np.empty((num_tokens, k), dtype=np.float32)  # [T, K]
        kernel = _small_or_parallel(router_logits.size, routing.route_topk_softmax_serial, routing.route_topk_softmax)
        kernel(router_logits, k, ids, weights)
        return ids, weights

    def route(self, router_logits, k, normalize):
        num_tokens = router_logits.shape[0]
        ids = np.empty((num_tokens, k), dtype=np.int64)  # [T, K]
        weights = np.empty((num_tokens, k), dtype=np.float32)  # [T, K]
        kernel = _small_or_parallel(router_logits.size, routing.route_softmax_topk_serial, routing.route_softmax_topk)
        kernel(router_logits, k, normalize, ids, weights)
        return ids, weights

    def route_sigmoid(self, router_logits, bias, k, num_groups, topk_groups, normalize, scale):
        """router_logits [T, E], bias [E] -> (ids [T, K], weights [T, K]) (cpu_kernels.routing.route_sigmoid_topk)."""
        num_tokens = router_logits.shape[0]
        ids = np.empty((num_tokens, k), dtype=np.int64)  # [T, K]
        weights = np.empty((num_tokens, k), dtype=np.float32)  # [T, K]
        kernel = _small_or_parallel(router_logits.size, routing.route_sigmoid_topk_serial, routing.route_sigmoid_topk)
        kernel(router_logits, bias, k, num_groups, topk_groups, bool(normalize), float(scale), ids, weights)
        return ids, weights

    def add_bias(self, x, bias):
        """x [T, R] += bias [R] in place."""
        x += bias

    def silu_mul(self, gate, up):
        """silu(gate) * up [T, F], a new array."""
        out = np.empty_like(gate)
        (activation.swiglu_serial if _small(gate.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS)
         else activation.swiglu)(gate, up, out)
        return out

    def experts(self, x, ids, weights, gate_exps, up_exps, down_exps, glu=None):
        """SwiGLU experts (glu: an ExpertGLU's clamp and biases, or None) for every (token, expert) pair, combined
        per token: x [T, H] -> [T, H]."""
        groups = self.group_pairs(ids, gate_exps.shape[0])
        return self.grouped_experts(x, weights, groups, gate_exps, up_exps, down_exps, glu)

    def group_pairs(self, ids, num_experts):
        """ids int64 [T, K] -> (order [N], expert_ids [G], row_starts [G+1]): pairs sorted by expert."""
        return routing.group_by_expert(ids, num_experts)

    def host_decode_experts(self, layer, x, ids, weights, resident):
        """A decode step's pairs whose experts are not resident (bool [E]), as one compiled call
        (cpu_host_experts): (out [n, H], pairs run) for x [n, H], ids [n, K], weights [n, K]."""
        plan = self._host_plan(layer)
        return plan.fn(x, ids, weights, resident, plan.gu_raws, plan.d_raws, _one_thread(), self.act_quant)

    def relay_decode_experts(self, layer, mailbox, seq, resident, limit_ticks, num_tokens=1):
        """The host side of the decode relay for one layer of step `seq` (num_tokens tokens; hybrid/relay.py), as
        one compiled call that waits for the routing in `mailbox`: (status, pairs run, time-stamp counter ticks at the
        wait's start, at the routing seen, at the rows posted)."""
        plan = self._host_plan(layer)
        mb = mailbox
        return plan.relay(mb.inbox, mb.inbox.view(np.int32), mb.outbox, mb.flags_in, mb.flags_out, mb.abort,
                          layer.index, seq, limit_ticks, resident, plan.gu_raws, plan.d_raws, _one_thread(),
                          self.act_quant, num_tokens, mb.top_k, mb.hidden)

    def _host_plan(self, layer):
        if self._host_plans is None:
            self._host_plans = {}
        plan = self._host_plans.get(layer.index)
        if plan is None or not plan.current(layer, self.claimed_host_experts):
            from .cpu_host_experts import HostExpertsPlan

            plan = self._host_plans[layer.index] = HostExpertsPlan(self, layer, self.claimed_host_experts)  # (sets
            # act_quant)
        return plan

    def paged_attention(self, q, k, v, k_scale, v_scale, table, start, key_lo, key_hi, scale, out, lse=None,
                        window=0):
        """paged_attention below, for a device backend that has this backend attend its KV's RAM part."""
        paged_attention(q, k, v, k_scale, v_scale, table, start, key_lo, key_hi, scale, out, lse, window)

    def grouped_experts(self, x, weights, groups, gate_exps, up_exps, down_exps, glu=None):
        """The pairs of `groups` (order, expert_ids, row_starts; a subset of the [T, K] pairs), combined
        per token with weights [T, K]: x [T, H] -> [T, H] (zero for tokens with no pair here). glu: an
        ExpertGLU (gpt-oss: biases and the clamped activation) or None (plain SwiGLU)."""
        order, expert_ids, row_starts = groups
        num_tokens, k = weights.shape
        num_pairs, hidden, width = len(order), x.shape[1], gate_exps.shape[1]
        small = _small(num_pairs * max(hidden, width), TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS)
        scratch = self._scratch()
        xs = scratch.get("xs", (num_pairs, hidden))  # [N, H]
        (moe_combine.gather_rows_serial if small else moe_combine.gather_rows)(x, order, k, xs)
        gate = scratch.get("gate", (num_pairs, width))  # [N, F]
        up = scratch.get("up", (num_pairs, width))  # [N, F]
        gate_k, up_k, down_k = (self._kernels_of(w) for w in (gate_exps, up_exps, down_exps))
        if x.dtype != np.float32 or (gate_k.cols, up_k.cols, down_k.cols) != (hidden, hidden, width) \
                or up_exps.shape[1] != width or down_exps.shape[1] != hidden:
            raise ValueError(f"experts: x {x.dtype} {x.shape} and {gate_exps.name} {gate_exps.shape}, "
                             f"{up_exps.name} {up_exps.shape}, {down_exps.name} {down_exps.shape} do not fit")
        # a prompt's few-token groups as several-token items (tiles.PROMPT_ITEMS); a verification step's stay
        # one-token dots, bit for bit a decode step's
        act_quant = self.act_quant + (PROMPT_ITEMS if self.act_quant == INT16 and num_tokens > DECODE_MAX_TOKENS else 0)
        if up_exps.qtype == gate_exps.qtype and up_exps.raw.shape == gate_exps.raw.shape \
                and up_exps.raw.flags.writeable == gate_exps.raw.flags.writeable:  # one type: one tuple
            gate_k.parallel(gate_k.raws + up_k.raws, xs, expert_ids, row_starts, (gate, up), act_quant)
        else:
            gate_k.parallel(gate_k.raws, xs, expert_ids, row_starts, (gate,), act_quant)
            up_k.parallel(up_k.raws, xs, expert_ids, row_starts, (up,), act_quant)
        # the activation into xs's buffer (read by gate and up only, done): written over gate in place, its loop
        # runs scalar (the vector loop's overlap check fails)
        act = scratch.get("xs", (num_pairs, width))  # [N, F]
        if glu is None:
            (activation.swiglu_serial if small else activation.swiglu)(gate, up, act)
        else:
            pair_expert = np.repeat(np.asarray(expert_ids, dtype=np.int64), np.diff(row_starts))  # [N]
            (activation.clamped_swiglu_serial if small else activation.clamped_swiglu)(
                gate, up, pair_expert, glu.gate_bias, glu.up_bias, glu.alpha, glu.limit, act)
        down = scratch.get("down", (num_pairs, hidden))  # [N, H]
        down_k.parallel(down_k.raws, act, expert_ids, row_starts, (down,), act_quant)
        if glu is not None:
            (activation.add_pair_bias_serial if small else activation.add_pair_bias)(down, pair_expert, glu.down_bias)
        out = np.zeros((num_tokens, hidden), dtype=np.float32)
        scatter = moe_combine.scatter_add_weighted_serial if small else moe_combine.scatter_add_weighted
        scatter(down, order, np.ascontiguousarray(weights).reshape(-1), k, out)
        return out


def paged_attention(q, k, v, k_scale, v_scale, table, start, key_lo, key_hi, scale, out, lse=None, window=0):
    """cpu_kernels.attention over pool arrays k, v [NB, BT, Hkv, D] (scales [NB, BT, Hkv] or None), keys
    [key_lo, key_hi) of the causal range (each query's last `window` only, where > 0); serial when the work is
    small."""
    num_tokens, num_heads, head_dim = q.shape
    work = num_tokens * max(min(start + num_tokens, key_hi) - key_lo, 0) * num_heads * head_dim
    kernel = attention.attention_serial if _small(work, TINY_MAX_ATTENTION, SERIAL_MAX_ATTENTION) else attention.attention
    if k_scale is None:
        k_scale = v_scale = attention.NO_SCALES
    lse = attention.NO_LSE if lse is None else lse
    kernel(q, k, v, table, start, key_lo, key_hi, scale, out, lse, k_scale, v_scale, window)


def _small_or_parallel(num_elements, serial, parallel):
    return serial if _small(num_elements, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS) else parallel


def _small(work, tiny_max, one_thread_max):
    """Whether an op of `work` runs as its serial twin: when tiny, or small and on one thread."""
    return work <= tiny_max or (work <= one_thread_max and _one_thread())


def _one_thread():
    """Whether the calling thread runs kernels on one Numba thread (the serial twins' case)."""
    return numba.get_num_threads() == 1
