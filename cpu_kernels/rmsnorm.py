"""RMSNorm as HF Qwen3RMSNorm computes it: x * rsqrt(mean(x^2) + eps), then times weight.

Shape legend: T tokens, H hidden, nH heads, D head dim.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def rmsnorm(x, weight, eps, out):
    """x [T, H], weight [H] -> out [T, H]; out may be x."""
    num_rows, hidden = x.shape
    for t in prange(num_rows):
        sum_sq = 0.0  # float64 accumulator
        for i in range(hidden):
            v = np.float64(x[t, i])
            sum_sq += v * v
        inv_rms = np.float32(1.0 / np.sqrt(sum_sq / hidden + eps))
        for i in range(hidden):
            out[t, i] = weight[i] * (x[t, i] * inv_rms)  # [T, H]


@njit(nogil=True, cache=True)
def rmsnorm_heads(x, weight, eps, out):
    """Per-head q/k norm: x [T, nH, D], weight [D] -> out [T, nH, D]; out may be x."""
    num_tokens, num_heads, head_dim = x.shape
    rows = num_tokens * num_heads
    rmsnorm(x.reshape(rows, head_dim), weight, eps, out.reshape(rows, head_dim))  # [T*nH, D]


rmsnorm_serial = serial_twin(rmsnorm)
