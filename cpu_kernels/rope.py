"""NeoX-style rotary embedding as HF Qwen3 applies it (rotate_half splits the head dim in halves).

inv_freq, the angles and the products are float32 as HF forms them. Our float32
pow is correctly rounded; torch's vectorized one is sometimes an ulp off (for
D=128, theta=1e6 only inv_freq[37]), worth < 2e-6 rad at position 40960.
cos/sin are taken in float64 and rounded, within an ulp of torch's float32 ones.

Shape legend: T tokens, nH heads, D head dim.
"""
import numpy as np
from numba import njit, prange

from .twins import serial_twin


@njit(nogil=True, cache=True)
def inv_freq_f32(theta, head_dim):
    """1 / theta^(arange(0, D, 2) / D) in float32, rounded like torch; not fastmath, so pow and / stay IEEE."""
    half = head_dim // 2
    inv_freq = np.empty(half, dtype=np.float32)  # [D/2]
    base = np.float32(theta)
    for i in range(half):
        exponent = np.float32(2 * i) / np.float32(head_dim)
        inv_freq[i] = np.float32(1.0) / (base ** exponent)
    return inv_freq


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def rope_neox(x, positions, theta, out):
    """x [T, nH, D], positions int64 [T] -> out [T, nH, D]; out may be x."""
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    inv_freq = inv_freq_f32(theta, head_dim)  # [D/2]
    for t in prange(num_tokens):
        pos = np.float32(positions[t])
        for i in range(half):
            angle = np.float64(pos * inv_freq[i])  # float32 product, as HF
            c = np.float32(np.cos(angle))
            s = np.float32(np.sin(angle))
            for h in range(num_heads):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                out[t, h, i] = x1 * c - x2 * s  # [T, nH, D]
                out[t, h, i + half] = x2 * c + x1 * s


rope_neox_serial = serial_twin(rope_neox)


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def rope_neox_freqs(x, positions, inv_freq, scale, out):
    """x [T, nH, D], positions int64 [T], inv_freq f32 [R/2] -> out [T, nH, D]: the NeoX rotation of the first R
    dims (pairs i, i + R/2) by pos * inv_freq[i], cos and sin times `scale` (YaRN's attention factor), as HF's
    rotary embeddings with scaled or partial frequencies; dims R.. are copied. out may be x."""
    num_tokens, num_heads, head_dim = x.shape
    half = inv_freq.shape[0]
    scale32 = np.float32(scale)
    for t in prange(num_tokens):
        pos = np.float32(positions[t])
        for i in range(half):
            angle = np.float64(pos * inv_freq[i])  # float32 product, as HF
            c = np.float32(np.cos(angle)) * scale32
            s = np.float32(np.sin(angle)) * scale32
            for h in range(num_heads):
                x1 = x[t, h, i]
                x2 = x[t, h, i + half]
                out[t, h, i] = x1 * c - x2 * s  # [T, nH, D]
                out[t, h, i + half] = x2 * c + x1 * s
        for h in range(num_heads):
            for d in range(2 * half, head_dim):
                out[t, h, d] = x[t, h, d]


rope_neox_freqs_serial = serial_twin(rope_neox_freqs)
