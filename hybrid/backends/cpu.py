"""The CPU backend: every op of the forward pass as a Numba kernel over NumPy arrays.

Shape legend: T tokens, H hidden, R output rows, C input columns, nH heads,
D head dim, E experts, K top-k, N (token, expert) pairs, F expert FFN width.
"""
import numpy as np

from cpu_kernels import activation, attention, format_for, moe_combine, rmsnorm, rope, routing

from ..kv_cache import SequenceKV


class CpuBackend:
    name = "cpu"

    def place(self, model):
        """Nothing to place: the CPU reads the weights where they are."""

    def new_kv(self, num_layers, num_kv_heads, head_dim, max_tokens):
        return SequenceKV(num_layers, num_kv_heads, head_dim, max_tokens)

    def take_rows(self, x, rows):
        return np.ascontiguousarray(x[rows])

    def to_host(self, x):
        return x

    def linear(self, weight, x):
        """x [T, C] @ weight[R, C].T -> [T, R]."""
        fmt = format_for(weight.qtype)
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        if x.shape[0] == 1:
            fmt.matvec(weight.raw, x[0], out[0])
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
        rmsnorm.rmsnorm(x, weight, eps, out)
        return out

    def rmsnorm_heads(self, x, weight, eps):
        """In place over x [T, nH, D]."""
        rmsnorm.rmsnorm_heads(x, weight, eps, x)

    def rope(self, x, positions, theta):
        """In place over x [T, nH, D]."""
        rope.rope_neox(x, positions, theta, x)

    def attention(self, q, k_cache, v_cache, start, scale, out):
        attention.attention(q, k_cache, v_cache, start, scale, out)

    def route(self, router_logits, k, normalize):
        num_tokens = router_logits.shape[0]
        ids = np.empty((num_tokens, k), dtype=np.int64)  # [T, K]
        weights = np.empty((num_tokens, k), dtype=np.float32)  # [T, K]
        routing.route_softmax_topk(router_logits, k, normalize, ids, weights)
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
        xs = np.empty((len(order), x.shape[1]), dtype=np.float32)  # [N, H]
        moe_combine.gather_rows(x, order, k, xs)
        gate = self._grouped(gate_exps, xs, expert_ids, row_starts)  # [N, F]
        up = self._grouped(up_exps, xs, expert_ids, row_starts)  # [N, F]
        activation.swiglu(gate, up, gate)
        down = self._grouped(down_exps, gate, expert_ids, row_starts)  # [N, H]
        out = np.zeros((num_tokens, x.shape[1]), dtype=np.float32)
        moe_combine.scatter_add_weighted(down, order, np.ascontiguousarray(weights).reshape(-1), k, out)
        return out

    @staticmethod
    def _grouped(weight, x, expert_ids, row_starts):
        out = np.empty((x.shape[0], weight.shape[1]), dtype=np.float32)
        format_for(weight.qtype).moe_matmul(weight.raw, x, expert_ids, row_starts, out)
        return out
