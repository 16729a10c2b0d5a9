"""Work arrays on 64-byte boundaries.

Numba aligns the arrays it allocates to 32 bytes, so an array whose rows are whole cache lines starts half the
time at an odd 32: then every 64-byte (AVX-512) load of it crosses two cache lines. The prefill kernels load
whole vectors of token panels per weight pair or column; one Q4_K integer prefill tile of 16 rows x 16 tokens ran
1.17x faster on a panel at a 64-byte boundary than on the same panel at 32 (bench/results/qwen3next.md, session 53).

Shape legend: n elements.
"""
import numpy as np
from numba import njit

ALIGN = 64  # bytes: one cache line, one AVX-512 vector


@njit(inline="always", nogil=True, cache=True)
def _at_boundary(buf, size):
    """buf[start:start + size], start the first element at an ALIGN-byte boundary (buf holds ALIGN spare
    elements)."""
    start = (-buf.ctypes.data) % ALIGN // buf.itemsize
    return buf[start:start + size]


@njit(inline="always", nogil=True, cache=True)
def zeros(size, dtype):
    """np.zeros(size, dtype) [n] starting at an ALIGN-byte boundary (reshape it to the shape wanted)."""
    return _at_boundary(np.zeros(size + ALIGN, dtype=dtype), size)


@njit(inline="always", nogil=True, cache=True)
def empty(size, dtype):
    """np.empty(size, dtype) [n] starting at an ALIGN-byte boundary (reshape it to the shape wanted)."""
    return _at_boundary(np.empty(size + ALIGN, dtype=dtype), size)
