"""Paged KV storage: one pool of fixed-size blocks per model, a block table per sequence.

Shape legend: L layers, NB pool blocks, BT positions per block, Hkv kv heads, D head dim, n positions.
The pool holds K and V as [L, NB, BT, Hkv, D] in the encoding `dtype` names (hybrid.kv_store): f32
by default (exact), f16 / bf16 (half the bytes) or int8 with per-token, per-head scales [L, NB, BT, Hkv]
(a quarter). Position j of a sequence lives in pool block table[j // BT], row j % BT. A sequence
takes blocks as it grows and gives them back when it is cut or dropped, so sequences share one
budget and nothing is copied as they grow. Host pools live in anonymous mappings reserved without
committing them (hybrid/host_memory.py: pages are backed as they are written); a pool without a limit
doubles when it runs out (a copy), one with a limit (`max_blocks`) refuses with a RequestError.
"""
import weakref

import numpy as np

from cpu_kernels.attention import write_rows

from . import kv_store
from .errors import RequestError
from .host_memory import host_array


BLOCK_TOKENS = 64  # positions per block; the conversation cache restores in blocks of the same size


def blocks_for(num_tokens, block_tokens=BLOCK_TOKENS):
    return -(-int(num_tokens) // block_tokens)


def vram_blocks(max_context, kv_resident=None, chunk_tokens=512):
    """KV blocks one sequence may hold in VRAM: all of max_context, or with a resident window of kv_resident
    tokens the window + a prompt chunk + one (a chunk may straddle a block boundary)."""
    if kv_resident is None:
        return blocks_for(max_context)
    return min(blocks_for(max_context), blocks_for(kv_resident) + blocks_for(chunk_tokens) + 1)


class KVPool:
    """The blocks of every sequence of a model. `allocate(shape, dtype)` makes its arrays (host memory by
    default; a device backend passes its own, and a fixed size)."""

    def __init__(self, num_layers, num_kv_heads, head_dim, dtype="f32", num_blocks=16, max_blocks=None,
                 block_tokens=BLOCK_TOKENS, allocate=host_array, where="RAM"):
        if dtype not in kv_store.KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(kv_store.KV_DTYPES)}, got {dtype!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.block_tokens, self.max_blocks, self.where = dtype, block_tokens, max_blocks, where
        self._allocate = allocate
        self.k = self.v = self.k_scale = self.v_scale = None
        self.num_blocks = 0
        self._free = []  # block ids, the lowest last (taken first: used memory stays compact)
        self._grow(num_blocks if max_blocks is None else min(num_blocks, max_blocks))

    @property
    def bytes_per_block(self):
        return kv_store.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype) \
            * self.block_tokens

    @property
    def nbytes(self):
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_free(self):
        return len(self._free)

    def _grow(self, num_blocks):
        shape = (self.num_layers, num_blocks, self.block_tokens, self.num_kv_heads, self.head_dim)
        storage = kv_store.STORAGE[self.dtype]
        arrays = {"k": self._allocate(shape, storage), "v": self._allocate(shape, storage)}  # [L, NB, BT, Hkv, D]
        if self.dtype == "int8":
            arrays.update(k_scale=self._allocate(shape[:4], np.float32), v_scale=self._allocate(shape[:4], np.float32))
        for name, array in arrays.items():
            old = getattr(self, name)
            if old is not None:
                array[:, : self.num_blocks] = old
            setattr(self, name, array)
        self._free = list(range(num_blocks - 1, self.num_blocks - 1, -1)) + self._free
        self.num_blocks = num_blocks

    def take(self, count):
        """`count` free block ids; grows an unlimited pool, else RequestError when too few are free."""
        if count > len(self._free):
            if self.max_blocks is not None:
                need = count - len(self._free)
                if self.num_blocks + need > self.max_blocks:
                    raise RequestError(
                        f"KV cache full: {count} more blocks of {self.block_tokens} tokens needed, "
                        f"{len(self._free)} of {self.max_blocks} free ({self.nbytes / 2**20:.0f} MiB in {self.where}); "
                        f"raise the KV budget or lower --parallel / --max-context")
                self._grow(min(self.max_blocks, max(self.num_blocks + need, 2 * self.num_blocks)))
            else:
                self._grow(max(self.num_blocks + count, 2 * self.num_blocks))
        return [self._free.pop() for _ in range(count)]

    def give(self, blocks):
        self._free.extend(sorted(blocks, reverse=True))

    def layer(self, layer):
        """(k, v, k_scale, v_scale) of one layer: [NB, BT, Hkv, D] x2 and [NB, BT, Hkv] x2 (None unless int8)."""
        if self.dtype == "int8":
            return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        return self.k[layer], self.v[layer], None, None


def _give_back(pool, blocks):
    pool.give(blocks)
    blocks.clear()


class SequenceKV:
    """One sequence's positions [0, length) in `pool`, at most max_tokens of them. Its blocks go back to
    the pool when it is cut (`truncate`) or dropped."""

    supports_rollback = True  # `rollback` may drop a verification chunk's rejected positions (speculation)
    recurrent = None  # the linear-attention layers' state (hybrid/recurrent_state.py), for models that have them

    def __init__(self, pool, max_tokens):
        self.pool, self.max_tokens = pool, max_tokens
        self.dtype, self.num_layers = pool.dtype, pool.num_layers
        self.num_kv_heads, self.head_dim, self.block_tokens = pool.num_kv_heads, pool.head_dim, pool.block_tokens
        self.length = 0  # positions whose K/V are written
        self.table = np.zeros(blocks_for(max_tokens, self.block_tokens), dtype=np.int32)  # [nb] pool block ids
        self.host_blocks = 0  # leading blocks kept outside the pool (a device sequence's RAM part)
        self.blocks = []  # the pool blocks held, in position order: table[host_blocks:][:len(blocks)]
        self._release = weakref.finalize(self, _give_back, pool, self.blocks)

    @property
    def capacity(self):
        return (self.host_blocks + len(self.blocks)) * self.block_tokens

    def reserve(self, num_tokens):
        """Make room for positions [0, num_tokens)."""
        if num_tokens > self.max_tokens:
            raise RequestError(f"context overflow: {num_tokens} tokens exceed the context of {self.max_tokens}")
        need = blocks_for(num_tokens, self.block_tokens) - self.host_blocks - len(self.blocks)
        if need > 0:
            self._add_blocks(self.pool.take(need))

    def _add_blocks(self, blocks):
        first = self.host_blocks + len(self.blocks)
        self.blocks.extend(blocks)
        self.table[first:first + len(blocks)] = blocks
        self.table_changed()

    def table_changed(self):
        """Called when the table's entries change (a device sequence uploads it)."""

    def commit(self, length):
        """Positions [0, length) are written (after a forward step)."""
        self.length = length
        if self.recurrent is not None:
            self.recurrent.commit(length)

    def _slots(self, start, n):
        """(pool block, row) int arrays [n] of positions [start, start + n)."""
        positions = np.arange(start, start + n)
        return self.table[positions // self.block_tokens], positions % self.block_tokens

    def check_room(self, start, n):
        """ValueError unless positions [start, start + n) are reserved (the compiled writers do not check bounds)."""
        if start + n > self.capacity:
            raise ValueError(f"KV write of positions {start}..{start + n - 1} past the {self.capacity} reserved")

    def write(self, layer, start, k, v):
        """k, v: float32 [n, Hkv, D] for positions [start, start + n)."""
        self.check_room(start, len(k))
        for name, x in (("k", k), ("v", v)):
            data, scale = kv_store.encode(x, self.dtype)
            pool = getattr(self.pool, name)  # [L, NB, BT, Hkv, D]
            if data.dtype != pool.dtype or data.shape[1:] != pool.shape[3:]:  # the writer would cast or misplace
                raise ValueError(f"KV write: {name} {x.dtype} {x.shape} encodes as {data.dtype} {data.shape}, the pool "
                                 f"holds {pool.dtype} rows of {pool.shape[3:]}")
            write_rows(pool, layer, self.table, start, data)
            if scale is not None:
                write_rows(getattr(self.pool, f"{name}_scale"), layer, self.table, start, scale)

    def export(self, n):
        """Positions [0, n) as float32 (k, v) [L, n, Hkv, D]."""
        blocks, rows = self._slots(0, n)
        out = []
        for name in ("k", "v"):
            scale = getattr(self.pool, f"{name}_scale")
            out.append(kv_store.decode(getattr(self.pool, name)[:, blocks, rows],
                                       None if scale is None else scale[:, blocks, rows]))
        return tuple(out)

    def load(self, k, v):
        """Float32 (k, v) [L, n, Hkv, D] become positions [0, n)."""
        n = k.shape[1]
        self.truncate(0)
        self.reserve(n)
        for layer in range(self.num_layers):
            self.write(layer, 0, k[layer], v[layer])
        self.length = n

    def rollback(self, length):
        """Drop the positions [length, self.length) of the last step's chunk (drafts the sampler rejected): the
        sequence is then as if it had never seen them (positions past `length` are rewritten before read).
        Returns the length kept: a recurrent state may keep less (the start of the chunk), the caller reads the
        positions from there to `length` again."""
        self.truncate(length)
        return self.length

    def truncate(self, length):
        """Keep positions [0, length); the blocks past them go back to the pool. A recurrent state may keep fewer
        (hybrid/recurrent_state.py): the KV is cut to match."""
        if self.recurrent is not None:
            length = self.recurrent.truncate(length)
        self.length = min(self.length, length)
        keep = blocks_for(self.length, self.block_tokens)
        self.host_blocks = min(self.host_blocks, keep)
        keep_pool = keep - self.host_blocks
        if keep_pool < len(self.blocks):
            dropped = self.blocks[keep_pool:]
            del self.blocks[keep_pool:]
            self.pool.give(dropped)
            self.table_changed()
