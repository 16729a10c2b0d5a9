"""The CPU backend: every op of the forward pass as a Numba kernel over NumPy arrays.

Small ops (one decode token's norm, rope, routing, combine, its attention projections)
run as the serial twins of their kernels: a parallel region costs more to open than they
take, and far more when other processes hold the cores. A layer's experts
run as two parallel regions, gate and up together, then down.

Shape legend: T tokens, H hidden, R output rows, C input columns, nH heads,
D head dim, E experts, K top-k, N (token, expert) pairs, F expert FFN width.
"""
import numpy as np

from cpu_kernels import activation, attention, format_for, moe_combine, rmsnorm, rope, routing

from ..kv_cache import SequenceKV

SERIAL_MAX_ELEMENTS = 1 << 15  # elementwise ops on at most this many values run serially
SERIAL_MAX_ATTENTION = 1 << 20  # attention of at most this many query-key-dim products runs serially
SERIAL_MAX_WEIGHT_BYTES = 1 << 20  # a one-token matvec over at most this many weight bytes runs serially


class CpuBackend:
    name = "cpu"

    def place(self, model):
        """Nothing to place: the CPU reads the weights where they are."""

    def new_kv(self, num_layers, num_kv_heads, head_dim, max_tokens, dtype="f32"):
        return SequenceKV(num_layers, num_kv_heads, head_dim, max_tokens, dtype=dtype)

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[rows])

    def to_host(self, x):
        return x

    def linear(self, weight, x):
        """x [T, C] @ weight[R, C].T -> [T, R]."""
        fmt = format_for(weight.qtype)
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        if x.shape[0] == 1:
            fmt.matvec(weight.raw, x[0], out[0], serial=weight.raw.nbytes <= SERIAL_MAX_WEIGHT_BYTES)
        else:
            fmt.matmul(weight.raw, x, out)
        return out

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

    def rope(self, x, positions, theta):
        """In place over x [T, nH, D]."""
        _small_or_parallel(x.size, rope.rope_neox_serial, rope.rope_neox)(x, positions, theta, x)

    def attention(self, q, k_cache, v_cache, start, scale, out, *scales):
        """scales: (k_scale, v_scale) [S, Hkv] of an int8 cache, else none."""
        num_tokens, num_heads, head_dim = q.shape
        work = num_tokens * (start + num_tokens) * num_heads * head_dim
        kernel = attention.attention_serial if work <= SERIAL_MAX_ATTENTION else attention.attention
        kernel(q, k_cache, v_cache, start, scale, out, *scales)

    def route(self, router_logits, k, normalize):
        num_tokens = router_logits.shape[0]
        ids = np.empty((num_tokens, k), dtype=np.int64)  # [T, K]
        weights = np.empty((num_tokens, k), dtype=np.float32)  # [T, K]
        kernel = _small_or_parallel(router_logits.size, routing.route_softmax_topk_serial, routing.route_softmax_topk)
        kernel(router_logits, k, normalize, ids, weights)
        return ids, weights

    def experts(self, x, ids, weights, gate_exps, up_exps, down_exps):
        """SwiGLU experts for every (token, expert) pair, combined per token: x [T, H] -> [T, H]."""
        groups = self.group_pairs(ids, gate_exps.shape[0])
        return self.grouped_experts(x, weights, groups, gate_exps, up_exps, down_exps)

    def group_pairs(self, ids, num_experts):
        """ids int64 [T, K] -> (order [N], expert_ids [G], row_starts [G+1]): pairs sorted by expert."""
        return routing.group_by_expert(ids, num_experts)

    def grouped_experts(self, x, weights, groups, gate_exps, up_exps, down_exps):
        """The pairs of `groups` (order, expert_ids, row_starts; a subset of the [T, K] pairs), combined
        per token with weights [T, K]: x [T, H] -> [T, H] (zero for tokens with no pair here)."""
        order, expert_ids, row_starts = groups
        num_tokens, k = weights.shape
        num_pairs, hidden, width = len(order), x.shape[1], gate_exps.shape[1]
        small = num_pairs * max(hidden, width) <= SERIAL_MAX_ELEMENTS
        xs = np.empty((num_pairs, hidden), dtype=np.float32)  # [N, H]
        (moe_combine.gather_rows_serial if small else moe_combine.gather_rows)(x, order, k, xs)
        gate = np.empty((num_pairs, width), dtype=np.float32)  # [N, F]
        up = np.empty((num_pairs, width), dtype=np.float32)  # [N, F]
        fmt = format_for(gate_exps.qtype)
        if up_exps.qtype == gate_exps.qtype and up_exps.raw.shape == gate_exps.raw.shape:
            fmt.moe_matmul_pair(gate_exps.raw, up_exps.raw, xs, expert_ids, row_starts, gate, up)
        else:
            fmt.moe_matmul(gate_exps.raw, xs, expert_ids, row_starts, gate)
            format_for(up_exps.qtype).moe_matmul(up_exps.raw, xs, expert_ids, row_starts, up)
        (activation.swiglu_serial if small else activation.swiglu)(gate, up, gate)
        down = np.empty((num_pairs, hidden), dtype=np.float32)  # [N, H]
        format_for(down_exps.qtype).moe_matmul(down_exps.raw, gate, expert_ids, row_starts, down)
        out = np.zeros((num_tokens, hidden), dtype=np.float32)
        scatter = moe_combine.scatter_add_weighted_serial if small else moe_combine.scatter_add_weighted
        scatter(down, order, np.ascontiguousarray(weights).reshape(-1), k, out)
        return out


def _small_or_parallel(num_elements, serial, parallel):
    return serial if num_elements <= SERIAL_MAX_ELEMENTS else parallel
