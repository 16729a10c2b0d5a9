"""A one-token decode layer on the GPU with its dense launches replayed as two graphs (the default;
STRATA_DENSE_GRAPHS=0 turns it off).

At 100 % resident a decode token is bound by the host's kernel launches, about 16 a layer
(bench/results/gpu_model.md). Two runs of them take no per-step number, so each is captured once per
layer and then replayed with one call:
- "in": the attention RMSNorm, the q/k/v matmul(s), the q/k head norms and RoPE (which reads the
  step's position from a fixed device buffer);
- "out": the output projection, the residual add, the FFN RMSNorm, the router matmul and top-k.
Between them the KV write and the attention launch one by one (they take the step's start as a
number); after "out" the experts run as before (their own graphs, the split, the relay).

A graph replays the addresses it was captured with, so everything it reads or writes must stay put:
the residual stream lives in a fixed buffer, and a region keeps the arrays of its first (uncaptured)
run and gets them back, in the same order, while it is captured (a capture must not allocate).
Shape legend: H hidden, Hq / Hkv query / kv heads, D head dim, K experts per token.
"""
import logging

import numpy as np

from ..blocks import attend, attention_inputs
from ..moe import expert_mixture, moe_routing

log = logging.getLogger(__name__)


class KeptAllocations:
    """The runtime a region sees: every other call goes to the real runtime; `empty` keeps what it allocates on a
    first run and hands the same arrays back, in order, once `replay()` is on."""

    def __init__(self, runtime):
        self._runtime, self.arrays, self._next = runtime, [], None

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def replay(self):
        self._next = 0

    def empty(self, shape, dtype):
        if self._next is None:
            array = self._runtime.empty(shape, dtype)
            self.arrays.append(array)
            return array
        if self._next >= len(self.arrays):
            raise RuntimeError("a captured region allocated more than its first run did")
        array, self._next = self.arrays[self._next], self._next + 1
        if array.shape != tuple(np.atleast_1d(shape)) or array.dtype != np.dtype(dtype):
            raise RuntimeError(f"a captured region asked for {shape} {np.dtype(dtype)} where its first run had "
                               f"{array.shape} {array.dtype}")
        return array


class LayerGraphs:
    """Each (region, layer)'s kept arrays, outputs and graph. Where a capture fails, `enabled` turns False and every
    region runs op by op from then on.

    The backend comes with each call rather than being kept: a back-reference would make backend and graphs a
    cycle, so a dropped backend (its stream, buffers and graphs) would wait for the cyclic garbage collector and be
    freed at whatever moment it runs, maybe in the middle of another model's decode step."""

    def __init__(self):
        self.enabled = True
        self._regions = {}  # (region, layer index) -> [kept allocations, outputs, graph or None]
        self._residual = None  # f32 [1, H]: the residual stream of a graphed decode step
        self._position = None  # int64 [1]: its position, on the device

    def begin_step(self, be, x, positions):
        """The step's residual stream, copied into the fixed buffer, and its position uploaded into the fixed one."""
        if self._residual is None or self._residual.shape != x.shape:
            self._residual = be.rt.empty(x.shape, np.float32)
            self._position = be.rt.empty((1,), np.int64)
            self._regions.clear()
        be.rt.copy_on_device_async(self._residual, x, be.stream)
        be.staging.upload("graph_position", np.asarray(positions[:1], np.int64), be.stream, out=self._position)
        be.use_device_positions(positions, self._position)
        return self._residual

    def run(self, be, key, queue):
        """queue()'s outputs: run and kept the first time, captured and launched the second, launched after."""
        entry = self._regions.get(key)
        if entry is None or not self.enabled:
            kept = KeptAllocations(be.rt)
            outputs = self._with_runtime(be, kept, queue)
            if self.enabled:
                self._regions[key] = [kept, outputs, None]
            return outputs
        kept, outputs, graph = entry
        if graph is None:
            kept.replay()
            try:
                graph = entry[2] = self._with_runtime(be, kept, lambda: be.rt.capture(be.stream, queue))
            except Exception as exc:  # CuPy's runtime errors; ROCm builds may lack graphs
                log.warning("decode layers run op by op: graph capture failed (%s)", exc)
                self.enabled = False
                self._regions.clear()
                return self.run(be, key, queue)
        graph.launch(be.stream)
        return outputs

    @staticmethod
    def _with_runtime(be, runtime, fn):
        real, be.rt = be.rt, runtime
        try:
            return fn()
        finally:
            be.rt = real


def decode_layer(be, graphs, spec, layer, x, batch, eps, split=None, usage=None):
    """One decode token through `layer`: x f32 [1, H], the fixed residual stream of graphs.begin_step, updated in
    place."""
    def inputs():
        h = be.rmsnorm(x, layer.attn_norm, eps)  # [1, H]
        q, k, v = attention_inputs(be, spec.attention, layer, h, batch.positions)  # [1, Hq, D], [1, Hkv, D] x 2
        return q, k, v, be.rt.empty(q.shape, np.float32)

    q, k, v, out = graphs.run(be, ("in", layer.index), inputs)
    attend(be, layer, q, k, v, batch, out)

    def routing():
        be.add_into(x, be.linear(layer.attn_output, out.reshape(1, -1)))
        h = be.rmsnorm(x, layer.ffn_norm, eps)
        return (h,) + tuple(moe_routing(be, layer, h))  # h [1, H], ids [1, K], weights [1, K]

    h, ids, weights = graphs.run(be, ("out", layer.index), routing)
    be.add_into(x, expert_mixture(be, layer, h, ids, weights, split, usage))
