"""MoE router (softmax, top-k as HF Qwen3Moe) and the expert-sorted grouping of its picks.

Shape legend: T tokens, E experts, K top-k, G experts with at least one pair.
A pair is a flat index t * K + j into the [T, K] assignment.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def route_softmax_topk(logits, k, normalize, ids_out, weights_out):
    """logits [T, E] -> ids_out int64 [T, K] (highest first, ties to the lower id), weights_out f32 [T, K]."""
    num_tokens, num_experts = logits.shape
    for t in prange(num_tokens):
        best = logits[t, 0]
        for e in range(1, num_experts):
            best = max(best, logits[t, e])
        probs = np.empty(num_experts, dtype=np.float32)  # [E]
        total = 0.0  # float64 accumulator
        for e in range(num_experts):
            probs[e] = np.exp(logits[t, e] - best)
            total += probs[e]
        inv_total = np.float32(1.0 / total)
        num_kept = 0
        for e in range(num_experts):
            p = probs[e] * inv_total
            if num_kept == k and p <= weights_out[t, k - 1]:
                continue
            slot = min(num_kept, k - 1)
            while slot > 0 and weights_out[t, slot - 1] < p:  # strict: equal values keep the lower id first
                weights_out[t, slot] = weights_out[t, slot - 1]
                ids_out[t, slot] = ids_out[t, slot - 1]
                slot -= 1
            weights_out[t, slot] = p  # [T, K]
            ids_out[t, slot] = e
            num_kept = min(num_kept + 1, k)
        if normalize:
            kept_sum = np.float32(0.0)
            for j in range(k):
                kept_sum += weights_out[t, j]
            for j in range(k):
                weights_out[t, j] /= kept_sum


@njit(nogil=True, cache=True)
def group_by_expert(ids, num_experts):
    """ids int64 [T, K] -> order int64 [T*K] (pairs sorted by expert, stable),
    expert_ids int64 [G], row_starts int64 [G+1]; experts with no pair are left out."""
    flat = ids.reshape(-1)  # [T*K]
    counts = np.zeros(num_experts, dtype=np.int64)  # [E]
    for p in range(flat.size):
        counts[flat[p]] += 1
    num_groups = 0
    for e in range(num_experts):
        num_groups += counts[e] > 0
    expert_ids = np.empty(num_groups, dtype=np.int64)  # [G]
    row_starts = np.empty(num_groups + 1, dtype=np.int64)  # [G+1]
    next_row = np.empty(num_experts, dtype=np.int64)  # [E]
    g = 0
    row = 0
    for e in range(num_experts):
        next_row[e] = row
        if counts[e] > 0:
            expert_ids[g] = e
            row_starts[g] = row
            g += 1
        row += counts[e]
    row_starts[num_groups] = row
    order = np.empty(flat.size, dtype=np.int64)  # [T*K]
    for p in range(flat.size):
        e = flat[p]
        order[next_row[e]] = p
        next_row[e] += 1
    return order, expert_ids, row_starts


route_softmax_topk_serial = serial_twin(route_softmax_topk)
