"""Graph regions of a one-token decode layer on the GPU (the default; dense_graphs=False turns them off).

At 100 % resident a decode token is bound by the host's kernel launches, about 16 a layer
(bench/results/gpu_model.md). Runs of them that take no per-step number are captured once per layer
and then replayed with one call. Which runs those are comes from the layer recipe
(hybrid/runners.py GraphRunner merges consecutive capturable steps); for qwen3moe's layer they are
the attention RMSNorm, the q/k/v matmul(s), the q/k head norms and RoPE (which reads the step's
position from a fixed device buffer); then the output projection, the residual add, the FFN RMSNorm,
the router matmul and top-k. Between them the KV write and the attention launch one by one (they take
the step's start as a number); after the second the experts run as before (their own graphs, the
split, the relay).

A graph replays the addresses it was captured with, so everything it reads or writes must stay put:
the residual stream lives in a fixed buffer, and a region keeps the arrays of its first (uncaptured)
run and gets them back, in the same order, while it is captured (a capture must not allocate).
Shape legend: H hidden, Hq / Hkv query / kv heads, D head dim, K experts per token.
"""
import logging

import numpy as np

log = logging.getLogger(__name__)

STEP_GRAPHS_KEPT = 8  # whole-step graphs kept at once (one a token count and keys bound in use)


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
        self._regions = {}  # (region, layer index) or a step graph's key -> [kept allocations, outputs, graph or None]
        self._buffers = {}  # n -> (residual stream f32 [n, H], positions int64 [n]) of a graphed step of n tokens
        self._position = None  # int64 [n]: the current step's positions, on the device

    def begin_step(self, be, x, positions):
        """The step's residual stream x [n, H], copied into the fixed buffer of n tokens, and its positions int64 [n]
        uploaded into the fixed one."""
        held = self._buffers.get(x.shape[0])
        if held is None or held[0].shape != x.shape:
            held = self._buffers[x.shape[0]] = (be.rt.empty(x.shape, np.float32),
                                                be.rt.empty((x.shape[0],), np.int64))
        residual, self._position = held
        be.rt.copy_on_device_async(residual, x, be.stream)
        be.staging.upload(f"graph_position.{x.shape[0]}", np.asarray(positions, np.int64), be.stream,
                          out=self._position)
        be.use_device_positions(positions, self._position)
        return residual

    @property
    def position(self):
        """The step's positions int64 [n] on the device (set by begin_step)."""
        return self._position

    def run_step(self, be, key, queue):
        """run() for a whole step's graph (hybrid/step_graph.py): the newest STEP_GRAPHS_KEPT of them are kept."""
        if key in self._regions:
            self._regions[key] = self._regions.pop(key)  # the newest used last
        else:
            steps = [k for k in self._regions if k[0] == "step"]
            for old in steps[:max(0, len(steps) - STEP_GRAPHS_KEPT + 1)]:
                del self._regions[old]
        return self.run(be, key, queue)

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
