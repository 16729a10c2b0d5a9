"""Per-sequence KV storage for the CPU path.

Shape legend: L layers, S capacity in positions, Hkv kv heads, D head dim.
Each sequence owns contiguous float32 K and V of [L, S, Hkv, D] that grow by
doubling up to the context limit (paged storage comes with the server's slots).
"""
import numpy as np

from .errors import RequestError


class SequenceKV:
    def __init__(self, num_layers, num_kv_heads, head_dim, max_tokens, initial_capacity=256):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_tokens = max_tokens
        self.length = 0  # positions whose K/V are written
        self.k = self.v = None
        self._allocate(min(initial_capacity, max_tokens))

    @property
    def capacity(self):
        return self.k.shape[1]

    def _allocate(self, capacity):
        shape = (self.num_layers, capacity, self.num_kv_heads, self.head_dim)
        k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)  # [L, S, Hkv, D]
        if self.k is not None:
            k[:, : self.length] = self.k[:, : self.length]
            v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k, v

    def reserve(self, num_tokens):
        """Make room for positions [0, num_tokens)."""
        if num_tokens > self.max_tokens:
            raise RequestError(f"context overflow: {num_tokens} tokens exceed the context of {self.max_tokens}")
        if num_tokens > self.capacity:
            self._allocate(min(self.max_tokens, max(num_tokens, 2 * self.capacity)))

    def write(self, layer, start, k, v):
        """k, v: [n, Hkv, D] for positions [start, start + n)."""
        n = k.shape[0]
        self.k[layer, start : start + n] = k
        self.v[layer, start : start + n] = v

    def truncate(self, length):
        self.length = min(self.length, length)
