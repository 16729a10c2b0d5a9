"""Moving rows between token order and expert-sorted (token, expert) pair order.

Shape legend: T tokens, H hidden, K top-k, N pair rows held here (N <= T*K).
Row i of an expert-sorted array belongs to flat pair order[i], token order[i] // K.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def gather_rows(x, order, k, out):
    """x [T, H], order int64 [N] -> out [N, H] with out[i] = x[order[i] // k]."""
    num_rows, hidden = out.shape
    for i in prange(num_rows):
        t = order[i] // k
        for d in range(hidden):
            out[i, d] = x[t, d]  # [N, H]


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def scatter_add_weighted(expert_out, order, weights_flat, k, out):
    """out[t] += weights_flat[p] * expert_out[i] for each row i with pair p = order[i], t = p // k.

    expert_out [N, H], order int64 [N], weights_flat f32 [T*K], out [T, H]. Each token
    sums its rows in a fixed order (by slot j), so the result does not depend on threads.
    """
    num_tokens, hidden = out.shape
    row_of_pair = np.full(num_tokens * k, -1, dtype=np.int64)  # [T*K]
    for i in range(order.size):
        row_of_pair[order[i]] = i
    for t in prange(num_tokens):
        for j in range(k):
            p = t * k + j
            i = row_of_pair[p]
            if i < 0:
                continue
            w = weights_flat[p]
            for d in range(hidden):
                out[t, d] += w * expert_out[i, d]  # [T, H]


gather_rows_serial = serial_twin(gather_rows)
scatter_add_weighted_serial = serial_twin(scatter_add_weighted)
