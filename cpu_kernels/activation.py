"""SwiGLU activation of the expert / MLP hidden layer: silu(gate) * up.

Shape legend: N rows (tokens or (token, expert) pairs), F intermediate size.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin


@njit(inline="always", fastmath=True, nogil=True, cache=True)
def silu(x):
    """x / (1 + exp(-x)) in float32, never forming exp of a large positive number."""
    if x >= 0:
        return x / (np.float32(1.0) + np.exp(-x))
    e = np.exp(x)
    return x * e / (np.float32(1.0) + e)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def swiglu(gate, up, out):
    """gate [N, F], up [N, F] -> out [N, F]; out may be gate or up."""
    num_rows, width = gate.shape
    for n in prange(num_rows):
        for i in range(width):
            out[n, i] = silu(gate[n, i]) * up[n, i]  # [N, F]


swiglu_serial = serial_twin(swiglu)
