"""How a decode step's attention grows with the context on this box's GPU: the one-token paged attention kernel
timed at the model's heads over a short and a long KV, as the decode step graph launches it (keys planned for a
power-of-two bound, launches back to back in a captured graph), giving seconds per key per layer for setup's
predictions.

Shape legend: Hq query heads, Hkv kv heads, D head dim, NB pool blocks, BT tokens a block.
"""
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

KEYS = (256, 8192)  # the two contexts timed (powers of two: a step graph plans its keys for one)
REPEATS = 10  # graph launches timed per context (best of)
GRAPHED = 8  # attention launches a timed graph holds


@dataclass(frozen=True)
class AttentionCost:
    """One layer's one-token attention: seconds at `keys[0]` keys and seconds per key beyond."""

    keys: tuple
    seconds: tuple  # per entry of keys
    kv: str

    @property
    def per_key_s(self):
        (k0, k1), (s0, s1) = self.keys, self.seconds
        return max(s1 - s0, 0.0) / (k1 - k0)

    def describe(self):
        return (f"one-token attention ({self.kv} KV) {self.seconds[0] * 1e6:.1f} us a layer at {self.keys[0]} keys, "
                f"{self.seconds[1] * 1e6:.1f} us at {self.keys[1]}: {self.per_key_s * 1e9:.2f} ns a key")


def _pool(rt, kv, shape, rng):
    """A device KV pool [NB, BT, Hkv, D] of random rows in `kv`'s storage, and its scales (int8) or None."""
    from hybrid import kv_store

    data, scale = kv_store.encode(rng.standard_normal(shape, dtype=np.float32), kv)
    return rt.to_device(np.ascontiguousarray(data)), None if scale is None else rt.to_device(scale)


def best_replay_seconds(rt, stream, graph, repeats):
    """Seconds of the fastest of `repeats` replays of a captured graph on `stream` (timing events around each)."""
    best = float("inf")
    for _ in range(repeats):
        begin, end = rt.event(timing=True), rt.event(timing=True)
        begin.record(stream)
        graph.launch(stream)
        end.record(stream)
        best = min(best, rt.elapsed(begin, end))
    return best


def time_attention(rt, kernels, num_q_heads, num_kv_heads, head_dim, kv, keys=KEYS, block_tokens=64,
                   repeats=REPEATS):
    """The AttentionCost of `kernels` (gpu_kernels.Kernels on runtime `rt`) for a one-token query of the model's
    heads over `keys` keys of a `kv` paged cache."""
    rng = np.random.default_rng(0)
    num_blocks = -(-max(keys) // block_tokens)
    shape = (num_blocks, block_tokens, num_kv_heads, head_dim)
    (k_pool, k_scale), (v_pool, v_scale) = _pool(rt, kv, shape, rng), _pool(rt, kv, shape, rng)
    table = rt.to_device(np.arange(num_blocks, dtype=np.int32))
    q = rt.to_device(rng.standard_normal((1, num_q_heads, head_dim), dtype=np.float32))
    out = rt.zeros((1, num_q_heads, head_dim), np.float32)
    stream = kernels.stream
    seconds = []
    for n in keys:
        def launch():  # the query at position n - 1 attends keys 0 .. n - 1, split as a step graph splits them
            kernels.paged_attention(kv, q, k_pool, v_pool, k_scale, v_scale, table, n - 1, 0, head_dim ** -0.5,
                                    out)

        launch()  # compile / load the kernels, size the split scratch
        graph = rt.capture(stream, lambda: [launch() for _ in range(GRAPHED)])  # back to back, as in a step graph
        seconds.append(best_replay_seconds(rt, stream, graph, repeats) / GRAPHED)
    cost = AttentionCost(tuple(keys), tuple(seconds), kv)
    log.info("%s", cost.describe())
    return cost
