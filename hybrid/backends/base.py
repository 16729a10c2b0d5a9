"""What every backend does (`Backend`), the expert contract of the hybrid split (`Experts`), and what a
backend can do beyond that, declared as data (`Capabilities`) rather than found by probing its members.

A backend runs the ops of the forward pass on its own arrays (NumPy for the CPU, device arrays for a
GPU); the model, the blocks and the MoE block call only these. The hybrid MoE step (hybrid/moe.py)
meets its two sides through `Experts`: the device part (resident and borrowed experts) is submitted,
the host part runs meanwhile, and both are waited for and combined.
Shape legend: T tokens, H hidden, V vocab, R rows, C columns, nH heads, D head dim, Hq / Hkv query /
kv heads, E experts, K top-k.
"""
from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond `Backend`; every field off by default.

    compiled_decode_layer: `layer_runner(recipe, plain)` gives a runner of decode layers as compiled calls
    (the CPU's hybrid/backends/cpu_layer.py), or `plain` for a recipe it cannot compile.
    graphed_decode: `layer_graphs` (a gpu_layer_graphs.LayerGraphs, or None when turned off) captures and
    replays a one-token decode layer's graph regions (hybrid/runners.py GraphRunner; the GPU's).
    step_graph: with graphed_decode, a whole step of one-token chunks (one sequence's, or several users') may be one
    graph: `prepare_step_graph(chunks, num_layers, top_k)` (a keys bound, or None), `step_graph_key(chunks, bound)`
    (which captured graph serves the step), `begin_step_graph(positions, bound, chunks)` / `end_step_graph()` around
    its queuing, `keep_step_routing(layer_index, ids)`, `queue_step_routing(tokens)` and, inside it, `attend_step(
    kv_index, q, k, v, batch, scale, out, window, sinks)` (every chunk's KV write and attention at once, or False)
    (gpu_step.py).
    decode_experts: as a split's device, `submit(layer, h, ids, weights)` (no groups) finds a decode step's
    resident pairs from the routing it holds (nothing read back).
    max_decode_pairs: the most (token, expert) pairs of such a step (None: no limit).
    resident_chunks: as a split's device, `submit_resident_chunk(layer, h, ids, weights)` runs a prompt chunk's pairs
    of a layer whose experts it all holds, grouping them itself (nothing read back, no host wait).
    decode_relay_device: as a split's device, the device side of the decode relay (hybrid/relay.py):
    `decode_mailbox`, `publish_decode`, `await_host_rows`.
    decode_relay_host: as a split's host, `relay_decode_experts(...)`, the relay's host side.
    host_decode_experts: as a split's host, `host_decode_experts(layer, x, ids, weights, resident)` runs a
    decode step's non-resident pairs as one compiled call.
    expert_cache: the backend holds a device expert cache (`backend.cache`) that a dynamic residency
    (placement/dynamic.py) may swap experts in and out of.
    parallel_min_tokens: `parallel_min_tokens(config)` gives the fewest tokens of a prompt chunk with which
    every op takes its parallel kernel (hybrid/warm_up.py).
    fused_norms: `qk_norm_rope(q, k, qk, layer, positions)` does rmsnorm_heads of q and k (layer.attn_q_norm,
    attn_k_norm) and their rope (layer.rope_freqs, rope_scale) in one launch where qk (project_qkv's) is given, and
    `add_rmsnorm(x, y, weight, eps)` does add_into(x, y) and returns rmsnorm(x) in one.
    """

    compiled_decode_layer: bool = False
    graphed_decode: bool = False
    step_graph: bool = False
    decode_experts: bool = False
    max_decode_pairs: Optional[int] = None
    resident_chunks: bool = False
    decode_relay_device: bool = False
    decode_relay_host: bool = False
    host_decode_experts: bool = False
    expert_cache: bool = False
    parallel_min_tokens: bool = False
    fused_norms: bool = False


@dataclass(frozen=True, eq=False)
class ExpertGLU:
    """gpt-oss's expert activation (ClampedSwiGLU) with a layer's per-expert biases, as the expert ops take it:
    g = min(gate + gate_bias[e], limit), u = clip(up + up_bias[e], -limit, limit), act = (u + 1) * g * sigmoid(alpha
    * g), then down + down_bias[e]. gate_bias, up_bias float32 [E, F], down_bias [E, H] (host arrays)."""

    alpha: float
    limit: float
    gate_bias: Any
    up_bias: Any
    down_bias: Any


@runtime_checkable
class Backend(Protocol):
    """The ops of the forward pass (hybrid/model.py, hybrid/blocks.py, hybrid/moe.py)."""

    name: str
    capabilities: Capabilities

    def place(self, model, host=None) -> None:
        """Take the model's weights where this backend runs them (copies, uploads). host: the HostExperts backend
        beside a device backend (its weight copies are what the device uploads from; it attends a device KV's
        RAM part where asked), None alone."""

    def new_kv_pool(self, num_layers, num_kv_heads, head_dim, dtype, num_tokens) -> Any:
        """The model's KV pool (hybrid/kv_cache.py KVPool)."""

    def new_kv(self, pool, max_tokens) -> Any:
        """A sequence's KV (SequenceKV) in `pool`, for up to max_tokens positions."""

    def describe_kv(self, pool, max_tokens) -> str:
        """One line on where the KV lives and what a slot of max_tokens takes."""

    def embed(self, weight, token_ids) -> Any:
        """token_ids int64 [T] -> rows [T, H]; starts every forward pass."""

    def linear(self, weight, x, exact=False) -> Any:
        """x [T, C] @ weight[R, C].T -> [T, R]; exact: x multiplied as float32 whatever act_quant rounds it to."""

    def rmsnorm(self, x, weight, eps) -> Any:
        """RMSNorm of x [T, H] -> a new [T, H]."""

    def rmsnorm_heads(self, x, weight, eps) -> None:
        """RMSNorm in place over x [T, nH, D], per head."""

    def project_qkv(self, layer, h) -> tuple:
        """h [T, H] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], qk: q and k as one view, or None)."""

    def rope(self, x, positions, freqs, scale=1.0) -> None:
        """NeoX RoPE in place over x [T, nH, D]: its first R = 2 * len(freqs) dims rotated by positions (int64 [T] on
        the host) times freqs (float32 [R/2] on the host: hybrid/rope_freqs.py), cos and sin times scale."""

    def attention(self, q, kv, layer, start, scale, out, window=0, sinks=None) -> None:
        """q [T, Hq, D] at positions [start, start + T) against kv's layer `layer` -> out [T, Hq, D]; window > 0: each
        query's last `window` positions only; sinks [Hq] (host float32): each head's sink logit in the softmax."""

    def route_topk_softmax(self, router_logits, k) -> tuple:
        """router_logits [T, E] -> (ids [T, K], weights [T, K]): the top k, softmax over those k (TopKSoftmax)."""

    def route(self, router_logits, k, normalize) -> tuple:
        """router_logits [T, E] -> (ids [T, K], weights [T, K])."""

    def route_sigmoid(self, router_logits, bias, k, num_groups, topk_groups, normalize, scale) -> tuple:
        """router_logits [T, E], choice bias [E] -> (ids [T, K], weights [T, K]): the SigmoidTopK router
        (hybrid/arch/recipe.py)."""

    def add_bias(self, x, bias) -> None:
        """x [T, R] += bias [R] in place (a contiguous x)."""

    def silu_mul(self, gate, up) -> Any:
        """silu(gate) * up, a new [T, F] (a dense SwiGLU's middle)."""

    def experts(self, x, ids, weights, gate_exps, up_exps, down_exps, glu=None) -> Any:
        """Every (token, expert) pair's SwiGLU expert (glu: an ExpertGLU, or None), combined per token: x [T, H] ->
        [T, H]. A device backend,
        which holds only some experts, runs them through the split instead (it is given a host backend)."""

    def add_into(self, x, y) -> None:
        """x += y in place (the residual stream)."""

    def empty(self, shape) -> Any:
        """A float32 work array of `shape` where this backend computes, contents undefined."""

    def take_rows(self, x, rows) -> Any:
        """x[rows] as a new array."""

    def to_host(self, x) -> Any:
        """x as a NumPy array."""


class Pending(Protocol):
    """A submitted part of one layer's experts; its `Experts.wait` gives the output."""


@runtime_checkable
class Experts(Protocol):
    """One side of the hybrid split (hybrid/moe.py ExpertSplit). The device side (resident and borrowed experts:
    the device backend itself) and the host side (the rest: hybrid/moe_host.py HostSide over the host backend) are
    each submitted, run at once, and waited for; the split adds the two."""

    def submit(self, layer, hidden, ids, weights, groups=None, borrowed=None) -> Pending:
        """Queue a layer's pairs: those of `groups` (hybrid/pair_groups.py PairGroups; and of `borrowed`, experts
        copied in first), or with groups None a decode step's resident pairs, found from the routing where it is
        (capabilities.decode_experts). hidden [T, H], ids / weights [T, K] as route() gave them."""

    def wait(self, pending) -> Any:
        """The submitted part's output [T, H]."""


class DeviceExperts(Experts, Protocol):
    """The device side of the split: its experts, and the copies between it and the host that the split needs.

    resident: bool [L, E], the experts the device holds (set at place; a dynamic cache updates it in place);
    prefill_borrow: large chunks may run non-resident experts here; borrow_bytes_per_second: the measured
    host -> device copy speed (placement/borrow.py's cost model); time_experts: time each submitted part."""

    resident: Any
    prefill_borrow: bool
    borrow_bytes_per_second: float
    time_experts: bool

    def chunk_expert_flops(self, layer) -> float:
        """The FLOP/s this device's prompt-chunk expert matmuls of layer's weight formats are expected to reach:
        the borrow cost model's estimate until it has timed them."""

    def fetch_routing(self, ids, weights) -> tuple:
        """(ids int64 [T, K], weights [T, K]) on the host: waits for the routing only."""

    def fetch_rows(self, x) -> Any:
        """Queue a host copy of x [T, H]; wait_rows(handle) returns it."""

    def wait_rows(self, handle) -> Any:
        """The host array a queued copy (fetch_rows, queue_ids) gives."""

    def queue_routing(self, ids, weights, x) -> Any:
        """Queue host copies of a step's ids [T, K], weights [T, K] and rows x [T, H]; wait_routing gives them."""

    def wait_routing(self, handle) -> tuple:
        """(ids, weights, x) on the host, from queue_routing."""

    def queue_ids(self, ids, tag) -> Any:
        """Queue a host copy of ids [T, K] (buffer `tag`); wait_rows(handle) returns it."""

    def zeros_like(self, x) -> Any:
        """A zero array of x's shape and type on the device."""

    def add_from_host(self, out, host_part) -> Any:
        """out [T, H] += host_part [T, H] (a host array); returns out."""

    def synchronize(self) -> None:
        """Wait until the device has run everything queued."""

    def expert_seconds(self, pending) -> float:
        """Device time of a part submitted with time_experts on."""

    def chunk_part_seconds(self, pending) -> float:
        """Device time of a prompt chunk's submitted part (groups given), borrowed copies included; None where the
        device does not time it."""


class RelayDevice(Protocol):
    """The device side of the decode relay (hybrid/relay.py; capabilities.decode_relay_device)."""

    def decode_mailbox(self, num_layers, top_k, hidden, max_tokens=1) -> Any:
        """A relay Mailbox the device reads and writes directly, or None where it cannot."""

    def publish_decode(self, layer, x, ids, weights, mailbox, seq) -> None:
        """Queue the post of a step's routing and rows x [n, H] to the mailbox, flagged with step number seq."""

    def relay_step(self, seq) -> None:
        """With a step graph (capabilities.step_graph): the relay kernels queued or launched from now on post and
        wait for step number seq (read from the device, so one captured graph serves every step)."""

    def await_host_rows(self, out, layer, mailbox, seq, timeout_s, add=True) -> Any:
        """Queue out [n, H] += the host rows of step seq (add False: out = those rows), once the host posts them;
        returns out."""


class HostExperts(Protocol):
    """What the split's host backend runs: the pairs of experts the device does not hold."""

    def group_pairs(self, ids, num_experts) -> tuple:
        """ids int64 [T, K] -> (order [N], expert_ids [G], row_starts [G+1]): pairs sorted by expert."""

    def grouped_experts(self, x, weights, groups, gate_exps, up_exps, down_exps, glu=None) -> Any:
        """The pairs of `groups` combined per token with weights [T, K]: x [T, H] -> [T, H] (glu: an ExpertGLU)."""

    def host_decode_experts(self, layer, x, ids, weights, resident) -> tuple:
        """(out [n, H], pairs run): a decode step's non-resident pairs (capabilities.host_decode_experts)."""

    def relay_decode_experts(self, layer, mailbox, seq, resident, limit_ticks, num_tokens=1) -> tuple:
        """The relay's host side for one layer of step seq (capabilities.decode_relay_host)."""

    def paged_attention(self, q, k, v, k_scale, v_scale, table, start, key_lo, key_hi, scale, out, lse=None,
                        window=0) -> None:
        """Attention of q [T, Hq, D] over host pool arrays k, v [NB, BT, Hkv, D], keys [key_lo, key_hi) (each query's
        last `window` only, where > 0); with lse [T, Hq] also each row's log-sum-exp (a device backend merges it with
        its own part)."""


def separate_projections(backend, layer, h):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], None): a backend's project_qkv as three matmuls."""
    num_tokens, hq, hkv, d = h.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = backend.linear(layer.attn_q, h).reshape(num_tokens, hq, d)
    k = backend.linear(layer.attn_k, h).reshape(num_tokens, hkv, d)
    v = backend.linear(layer.attn_v, h).reshape(num_tokens, hkv, d)
    return q, k, v, None
