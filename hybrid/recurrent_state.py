"""A sequence's recurrent state: what its linear-attention layers keep instead of KV, beside the paged KV of
its full-attention layers (the sequence's `recurrent`, hybrid/kv_cache.py SequenceKV).

Per linear layer: the conv state (the last W-1 conv inputs) and the delta state (one [Dk, Dv] matrix per value
head), float32, in the backend's memory. Its size does not grow with the context. The state cannot be cut back
to an arbitrary position: `truncate(n)` works for 0 (a fresh sequence), for the current length, and for the
start of the last chunk of several tokens (a snapshot is taken there: the speculation's rollback contract,
/tmp notes: `rollback(length)` gives back the position it could keep, the caller reads the rest again).
Shape legend: NL linear layers, W conv width, C conv channels, Hv value heads, Dk / Dv key / value head dim.
"""
from dataclasses import dataclass

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


def _size(shape):
    n = 1
    for d in shape:
        n *= d
    return n


class RecurrentState:
    """One sequence's conv and delta states, arrays from `zeros(shape)` (the backend's: float32, zeroed)."""

    supports_rollback = True

    def __init__(self, shape, zeros):
        self.shape = shape
        self.conv_all, self.delta_all = zeros(shape.conv_shape), zeros(shape.delta_shape)
        self._slot = {layer: i for i, layer in enumerate(shape.layers)}
        self.length = 0  # positions the state has read
        self._snapshot = None  # (position, conv copy, delta copy): the state before the last multi-token chunk

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
        self.length, self._snapshot = keep, None
        return keep
