"""A sequence's recurrent state: what its linear-attention layers keep instead of KV, beside the paged KV of
its full-attention layers (the sequence's `recurrent`, hybrid/kv_cache.py SequenceKV).

Per linear layer: the conv state (the last W-1 conv inputs) and the delta state (one [Dk, Dv] matrix per value
head), float32, in the backend's memory. Its size does not grow with the context. The state cannot be cut back
to an arbitrary position: `truncate(n)` works for 0 (a fresh sequence), for the current length, and for the
start of the last chunk of several tokens (a snapshot is taken there: the speculation's rollback contract,
hybrid/kv_cache.py SequenceKV.rollback gives back the position it could keep, the caller reads the rest again).

Checkpoints (the conversation cache's, hybrid/conversation_cache.py): with `checkpoint_tokens` N set, the state at
every multiple of N is copied to host memory as the layers reach it (a chunk's rows are split there), the last
MAX_CHECKPOINTS kept, and a parked conversation adds one at its end; a returning conversation restores the KV
and the state of the last checkpoint before it differs from a parked one, and reads the rest.
Shape legend: NL linear layers, W conv width, C conv channels, Hv value heads, Dk / Dv key / value head dim.
"""
from dataclasses import dataclass

import numpy as np

from .arch.recipe import LinearAttention


@dataclass(frozen=True)
class RecurrentShape:
    """The state's arrays for a model: its linear layers (indices) and their part (one for all)."""

    layers: tuple
    part: LinearAttention

    @classmethod
    def of(cls, recipes):
        """The shape a model's layer recipes need, or None without linear-attention layers."""
        found = [(i, r.mixer.part) for i, r in enumerate(recipes) if isinstance(r.mixer.part, LinearAttention)]
        if not found:
            return None
        parts = {p for _, p in found}
        if len(parts) > 1:
            raise ValueError(f"linear-attention layers of different shapes: {sorted(map(repr, parts))}")
        return cls(tuple(i for i, _ in found), found[0][1])

    @property
    def conv_shape(self):
        return (len(self.layers), self.part.conv_width - 1, self.part.conv_channels)  # [NL, W-1, C]

    @property
    def delta_shape(self):
        p = self.part
        return (len(self.layers), p.num_v_heads, p.key_dim, p.value_dim)  # [NL, Hv, Dk, Dv]

    @property
    def nbytes(self):
        """Bytes of one sequence's state."""
        return 4 * sum(_size(shape) for shape in (self.conv_shape, self.delta_shape))

    @property
    def slot_bytes(self):
        """Bytes a sequence holds for it: the state and its snapshot at the start of the last multi-token chunk."""
        return 2 * self.nbytes


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


MAX_CHECKPOINTS = 4  # checkpoints a sequence keeps (the newest): a returning conversation may differ near its end


@dataclass(frozen=True)
class Checkpoint:
    """The state after `position` tokens, in host memory: conv [NL, W-1, C], delta [NL, Hv, Dk, Dv]."""

    position: int
    conv: np.ndarray
    delta: np.ndarray

    @property
    def nbytes(self):
        return self.conv.nbytes + self.delta.nbytes


class RecurrentState:
    """One sequence's conv and delta states in `backend`'s memory (its state_zeros, state_to_host,
    state_from_host)."""

    def __init__(self, shape, backend):
        self.shape, self.backend = shape, backend
        self.conv_all, self.delta_all = backend.state_zeros(shape.conv_shape), backend.state_zeros(shape.delta_shape)
        self._slot = {layer: i for i, layer in enumerate(shape.layers)}
        self.length = 0  # positions the state has read
        self._snapshot = None  # (position, conv copy, delta copy): the state before the last multi-token chunk
        self.checkpoint_tokens = 0  # N: checkpoints at multiples of N (0: none)
        self.checkpoints = []  # [Checkpoint], oldest first
        self._pending = None  # the checkpoint the layers are filling: (position, conv, delta)

    @property
    def nbytes(self):
        return self.shape.nbytes

    def conv(self, layer):
        return self.conv_all[self._slot[layer]]  # [W-1, C]

    def delta(self, layer):
        return self.delta_all[self._slot[layer]]  # [Hv, Dk, Dv]

    def begin_chunk(self, layer, start, num_tokens):
        """Called by each linear layer before it reads positions [start, start + num_tokens): the first layer checks
        the state is at `start` and, for a chunk of several tokens, keeps a snapshot there."""
        if layer != self.shape.layers[0]:
            return
        if start != self.length:
            raise ValueError(f"recurrent state at position {self.length}, asked to read from {start}")
        self._snapshot = (start, self.conv_all.copy(), self.delta_all.copy()) if num_tokens > 1 else None

    def commit(self, length):
        self.length = length

    def spans(self, start, num_tokens):
        """[(lo, hi)] row ranges of a chunk at positions [start, start + num_tokens), cut at checkpoint positions."""
        n = self.checkpoint_tokens
        cuts = range((start // n + 1) * n, start + num_tokens, n) if n else ()
        bounds = [0, *(p - start for p in cuts), num_tokens]
        return list(zip(bounds[:-1], bounds[1:]))

    def reached(self, layer, position):
        """Called by each linear layer after reading up to `position`: at a checkpoint position, its state is copied
        into the checkpoint; the last layer's completes it."""
        n = self.checkpoint_tokens
        if not n or position % n or position == 0:
            return
        slot = self._slot[layer]
        if slot == 0:
            self._pending = (position, np.empty(self.shape.conv_shape, np.float32),
                             np.empty(self.shape.delta_shape, np.float32))
        if self._pending is None or self._pending[0] != position:
            return
        _, conv, delta = self._pending
        conv[slot] = self.backend.state_to_host(self.conv_all[slot])
        delta[slot] = self.backend.state_to_host(self.delta_all[slot])
        if slot == len(self.shape.layers) - 1:
            self.checkpoints = self.checkpoints[-(MAX_CHECKPOINTS - 1):] + [Checkpoint(*self._pending)]
            self._pending = None

    def checkpoint_now(self):
        """A Checkpoint of the state as it is (at self.length), in host memory."""
        return Checkpoint(self.length, self.backend.state_to_host(self.conv_all),
                          self.backend.state_to_host(self.delta_all))

    def load_checkpoint(self, checkpoint):
        """The state becomes `checkpoint`'s (a restored conversation's), kept as this sequence's checkpoint too."""
        if checkpoint.conv.shape != self.shape.conv_shape or checkpoint.delta.shape != self.shape.delta_shape:
            raise ValueError(f"state checkpoint of shapes {checkpoint.conv.shape}, {checkpoint.delta.shape}: this "
                             f"model's are {self.shape.conv_shape}, {self.shape.delta_shape}")
        self.backend.state_from_host(self.conv_all, checkpoint.conv)
        self.backend.state_from_host(self.delta_all, checkpoint.delta)
        self.length, self._snapshot, self._pending = checkpoint.position, None, None
        self.checkpoints = [checkpoint]

    def keepable(self, length):
        """The position at or before `length` the state can go back to."""
        if length >= self.length:
            return self.length
        if self._snapshot is not None and self._snapshot[0] <= length:
            return self._snapshot[0]
        return 0

    def truncate(self, length):
        """Go back to keepable(length) (0: a fresh state); returns that position."""
        keep = self.keepable(length)
        if keep == self.length:
            return keep
        if keep == 0:
            self.conv_all.fill(0.0)
            self.delta_all.fill(0.0)
        else:
            _, conv, delta = self._snapshot
            self.conv_all[...] = conv
            self.delta_all[...] = delta
        self.length, self._snapshot, self._pending = keep, None, None
        self.checkpoints = [c for c in self.checkpoints if c.position <= keep]
        return keep
