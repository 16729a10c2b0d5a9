"""Causal grouped-query attention of one sequence segment against its KV cache.

The cache holds positions 0..start_pos+T-1; query t sits at position start_pos+t
and attends to keys 0..start_pos+t. Query head h reads kv head h // (Hq // Hkv).

Shape legend: T tokens, Hq query heads, Hkv kv heads, D head dim, S cache positions.
"""
import numpy as np
from numba import njit, prange


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def attention(q, k_cache, v_cache, start_pos, scale, out):
    """q [T, Hq, D], k_cache/v_cache [S, Hkv, D] -> out [T, Hq, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_cache.shape[1]
    for th in prange(num_tokens * num_q_heads):
        t = th // num_q_heads
        h = th % num_q_heads
        kv = h // group
        num_keys = start_pos + t + 1
        scores = np.empty(num_keys, dtype=np.float32)  # [S]
        best = -np.inf
        for j in range(num_keys):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q[t, h, d] * k_cache[j, kv, d]
            scores[j] = dot * scale
            best = max(best, scores[j])
        total = 0.0  # float64 accumulator
        for j in range(num_keys):
            p = np.exp(scores[j] - best)
            scores[j] = p
            total += p
        inv_total = np.float32(1.0 / total)
        acc = np.zeros(head_dim, dtype=np.float32)  # [D]
        for j in range(num_keys):
            p = scores[j] * inv_total
            for d in range(head_dim):
                acc[d] += p * v_cache[j, kv, d]
        for d in range(head_dim):
            out[t, h, d] = acc[d]  # [T, Hq, D]
