"""Per-sequence KV storage.

Shape legend: L layers, S capacity in positions, Hkv kv heads, D head dim.
Each sequence owns contiguous K and V of [L, S, Hkv, D] that grow by doubling
up to the context limit, in the encoding `dtype` names (hybrid.kv_store): f32
by default (exact), f16 / bf16 (half the bytes) or int8 with per-token,
per-head scales (a quarter).
"""
import numpy as np

from . import kv_store
from .errors import RequestError


class SequenceKV:
    def __init__(self, num_layers, num_kv_heads, head_dim, max_tokens, initial_capacity=256, dtype="f32"):
        if dtype not in kv_store.KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(kv_store.KV_DTYPES)}, got {dtype!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_tokens, self.dtype = max_tokens, dtype
        self.length = 0  # positions whose K/V are written
        self.k = self.v = self.k_scale = self.v_scale = None
        self._allocate(min(initial_capacity, max_tokens))

    @property
    def capacity(self):
        return self.k.shape[1]

    def _allocate(self, capacity):
        shape = (self.num_layers, capacity, self.num_kv_heads, self.head_dim)
        storage = kv_store.STORAGE[self.dtype]
        arrays = {"k": np.empty(shape, storage), "v": np.empty(shape, storage)}  # [L, S, Hkv, D]
        if self.dtype == "int8":
            arrays.update(k_scale=np.empty(shape[:3], np.float32), v_scale=np.empty(shape[:3], np.float32))
        for name, array in arrays.items():
            old = getattr(self, name)
            if old is not None:
                array[:, : self.length] = old[:, : self.length]
            setattr(self, name, array)

    def reserve(self, num_tokens):
        """Make room for positions [0, num_tokens)."""
        if num_tokens > self.max_tokens:
            raise RequestError(f"context overflow: {num_tokens} tokens exceed the context of {self.max_tokens}")
        if num_tokens > self.capacity:
            self._allocate(min(self.max_tokens, max(num_tokens, 2 * self.capacity)))

    def write(self, layer, start, k, v):
        """k, v: float32 [n, Hkv, D] for positions [start, start + n)."""
        n = k.shape[0]
        for name, x in (("k", k), ("v", v)):
            data, scale = kv_store.encode(x, self.dtype)
            getattr(self, name)[layer, start : start + n] = data
            if scale is not None:
                getattr(self, f"{name}_scale")[layer, start : start + n] = scale

    def scales(self, layer):
        """The extra attention arguments of this encoding: (k_scale, v_scale) [S, Hkv] for int8, else ()."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.dtype == "int8" else ()

    def export(self, n):
        """Positions [0, n) as float32 (k, v) [L, n, Hkv, D]."""
        scales = {"k": self.k_scale, "v": self.v_scale}
        return tuple(kv_store.decode(getattr(self, name)[:, :n], None if scales[name] is None else scales[name][:, :n])
                     for name in ("k", "v"))

    def load(self, k, v):
        """Float32 (k, v) [L, n, Hkv, D] become positions [0, n)."""
        n = k.shape[1]
        self.reserve(n)
        for layer in range(self.num_layers):
            self.write(layer, 0, k[layer], v[layer])
        self.length = n

    def truncate(self, length):
        self.length = min(self.length, length)
