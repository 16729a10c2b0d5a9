"""MoE routers (softmax top-k as HF Qwen3Moe; sigmoid with a choice bias and group-limited top-k as HF
Glm4Moe / DeepSeek-V3) and the expert-sorted grouping of their picks.

Shape legend: T tokens, E experts, K top-k, G experts with at least one pair.
A pair is a flat index t * K + j into the [T, K] assignment.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin

LOWEST = np.float32(-3.0e38)  # below any score (fast-math kernels assume no infinities)


@njit(fastmath=True, nogil=True, cache=True)
def keep_top(ids, values, num_kept, value, index):
    """Insert (index, value) into a row's top K kept so far (ids [K], values [K], highest first; equal values keep
    the lower index first, as indices come in order); returns how many it keeps now."""
    k = len(values)
    if num_kept == k and value <= values[k - 1]:
        return num_kept
    slot = min(num_kept, k - 1)
    while slot > 0 and values[slot - 1] < value:  # strict: equal values keep the lower index first
        values[slot] = values[slot - 1]
        ids[slot] = ids[slot - 1]
        slot -= 1
    values[slot] = value
    ids[slot] = index
    return min(num_kept + 1, k)


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
            num_kept = keep_top(ids_out[t], weights_out[t], num_kept, probs[e] * inv_total, e)
        if normalize:
            kept_sum = np.float32(0.0)
            for j in range(k):
                kept_sum += weights_out[t, j]
            for j in range(k):
                weights_out[t, j] /= kept_sum


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def route_sigmoid_topk(logits, bias, k, num_groups, topk_groups, normalize, scale, ids_out, weights_out):
    """logits [T, E], bias [E] -> ids_out int64 [T, K] (highest choice first, ties to the lower id), weights_out f32
    [T, K]. Scores s = sigmoid(logits); the choice ranks s + bias among the experts of the topk_groups groups (of
    num_groups equal runs of ids) whose two best choice values sum highest; a weight is the chosen expert's s, over
    the K's sum (+1e-20) where normalize, times scale."""
    num_tokens, num_experts = logits.shape
    group_size = num_experts // num_groups
    for t in prange(num_tokens):
        scores = np.empty(num_experts, dtype=np.float32)  # [E]
        choice = np.empty(num_experts, dtype=np.float32)  # [E]
        for e in range(num_experts):
            x = logits[t, e]
            if x >= 0:  # no exp of a large positive value (fast-math assumes no infinities)
                scores[e] = np.float32(1.0) / (np.float32(1.0) + np.exp(-x))
            else:
                z = np.exp(x)
                scores[e] = z / (np.float32(1.0) + z)
            choice[e] = scores[e] + bias[e]
        allowed = np.ones(num_groups, dtype=np.bool_)  # [G]
        if topk_groups < num_groups:
            group_score = np.empty(num_groups, dtype=np.float32)
            for g in range(num_groups):
                first, second = LOWEST, LOWEST
                for e in range(g * group_size, (g + 1) * group_size):
                    if choice[e] > first:
                        first, second = choice[e], first
                    elif choice[e] > second:
                        second = choice[e]
                group_score[g] = first + second
            allowed[:] = False
            for _ in range(topk_groups):
                best = -1
                for g in range(num_groups):
                    if not allowed[g] and (best < 0 or group_score[g] > group_score[best]):
                        best = g
                allowed[best] = True
        best_choice = np.empty(k, dtype=np.float32)  # [K]
        num_kept = 0
        for e in range(num_experts):
            if not allowed[e // group_size]:
                continue
            num_kept = keep_top(ids_out[t], best_choice, num_kept, choice[e], e)
        total = np.float32(0.0)
        for j in range(k):
            weights_out[t, j] = scores[ids_out[t, j]]
            total += weights_out[t, j]
        factor = np.float32(scale) / (total + np.float32(1e-20)) if normalize else np.float32(scale)
        for j in range(k):
            weights_out[t, j] *= factor


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
route_sigmoid_topk_serial = serial_twin(route_sigmoid_topk)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def route_topk_softmax(logits, k, ids_out, weights_out):
    """gpt-oss's router (HF GptOssTopKRouter): logits [T, E] -> the K largest, ids_out int64 [T, K] (highest first,
    ties to the lower id), and weights_out f32 [T, K] the softmax over those K logits."""
    num_tokens, num_experts = logits.shape
    for t in prange(num_tokens):
        num_kept = 0
        for e in range(num_experts):
            num_kept = keep_top(ids_out[t], weights_out[t], num_kept, logits[t, e], e)
        best = weights_out[t, 0]
        total = 0.0  # float64 accumulator
        for j in range(k):
            weights_out[t, j] = np.exp(weights_out[t, j] - best)
            total += weights_out[t, j]
        for j in range(k):
            weights_out[t, j] = np.float32(weights_out[t, j] / total)


route_topk_softmax_serial = serial_twin(route_topk_softmax)
