"""RoPE frequencies of a model, computed once: plain, YaRN-scaled (gpt-oss) or over part of the head (partial
rotary), as transformers' rope init functions compute them in float32.

`rope_freqs(config)` gives (inv_freq float32 [R/2], scale): the rotation of dims (i, i + R/2) by
pos * inv_freq[i], cos and sin times `scale` (YaRN's attention factor; 1 otherwise). Dims past R stay.
Shape legend: D head dim, R rotated dims (R <= D).
"""
import math
from dataclasses import dataclass

import numpy as np

from cpu_kernels.rope import inv_freq_f32


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's parameters as HF's rope_parameters (rope_type "yarn") / GGUF's rope.scaling.* name them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = None  # None: 0.1 * ln(factor) + 1
    truncate: bool = True


def _yarn_attention_factor(yarn):
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    return 1.0 if yarn.factor <= 1 else 0.1 * math.log(yarn.factor) + 1.0


def yarn_inv_freq(theta, dim, yarn):
    """transformers' _compute_yarn_parameters' inv_freq [dim/2] float32 (a linear ramp between the interpolated
    and the extrapolated frequencies over the correction range of beta_fast .. beta_slow rotations)."""
    def correction_dim(rotations):
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    exponents = (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)).astype(np.float64)
    pos_freqs = (np.float64(theta) ** exponents).astype(np.float32)  # correctly rounded, as inv_freq_f32's
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    inv_freq = interpolation * (np.float32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32)


def rope_freqs(theta, head_dim, rotary_dim=None, yarn=None):
    """(inv_freq float32 [R/2], scale) for R = rotary_dim (None: the whole head) and YaRN scaling or None."""
    dim = head_dim if rotary_dim is None else rotary_dim
    if yarn is None:
        return inv_freq_f32(theta, dim), 1.0
    return yarn_inv_freq(theta, dim, yarn), _yarn_attention_factor(yarn)
