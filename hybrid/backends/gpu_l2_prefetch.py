"""The next layer's dense weights read into L2 while a decode step graph runs this one (GpuBackend l2_prefetch).

A one-token step's dense matmuls (q/k/v, output, router: ~14 MB a layer of the Qwen3-30B-A3B shape) wait on the
memory's latency more than on its bandwidth (bench/results/vs_llamacpp_gpu.md). Inside a step graph each layer's
attention forks a side branch that runs ops.cu l2_prefetch over the next layer's dense weights (the last layer's:
the first's, for the next step), so that by the time the next layer's matmuls run, their weights are in L2. The
branches join the step's stream before the graph ends. Only where L2 holds several layers' worth
(L2_LAYERS_MIN): on a small L2 the prefetched lines would push out the ones in use.
Shape legend: n regions of a layer (address, bytes).
"""
import numpy as np

L2_LAYERS_MIN = 3  # the device's L2 must hold this many layers' dense weights for the prefetch to be planned


class L2Prefetch:
    """Per attention layer, the device regions of the next layer's dense weights, and the side stream that reads them
    into L2. The backend comes with each call (no back-reference: see gpu_layer_graphs.LayerGraphs)."""

    def __init__(self, regions, side_stream):
        self.regions = regions  # layer index -> int64 [n, 2] on the device: the NEXT attention layer's regions
        self.side = side_stream
        self._pending = []  # events of the side branches not joined yet

    @classmethod
    def plan(cls, be, layers, l2_bytes):
        """An L2Prefetch over the attention layers' dense weights (be._dev's device copies), or None where there is
        no layer to prefetch or L2 (l2_bytes) holds fewer than L2_LAYERS_MIN layers' worth."""
        spans = {}
        for layer in layers:
            if layer.attn_q is None:  # a linear-attention layer: its step has no project_qkv to hang the fork on
                continue
            spans[layer.index] = merged_spans(be._dev[id(w)][0] for w in layer.dense_weights() if id(w) in be._dev)
        if len(spans) < 2 or not l2_bytes:
            return None
        largest = max(sum(n for _, n in s) for s in spans.values())
        if l2_bytes < L2_LAYERS_MIN * largest:
            return None
        order = list(spans)
        regions = {i: be.rt.to_device(np.array(spans[order[(k + 1) % len(order)]], dtype=np.int64).reshape(-1, 2))
                   for k, i in enumerate(order)}
        return cls(regions, be.rt.stream())

    def queue(self, be, layer_index):
        """Fork a side branch off the backend's stream that prefetches the layer after `layer_index`."""
        regions = self.regions.get(layer_index)
        if regions is None:
            return
        fork = be.rt.event()
        fork.record(be.stream)
        be.rt.wait_event(self.side, fork)
        be.kernels.l2_prefetch(regions, self.side)
        done = be.rt.event()
        done.record(self.side)
        self._pending.append(done)

    def join(self, be):
        """Make the backend's stream wait for every side branch queued since the last join."""
        for done in self._pending:
            be.rt.wait_event(be.stream, done)
        self._pending.clear()


def merged_spans(arrays):
    """[(address, bytes)] of device arrays, overlapping or touching ones merged, in address order."""
    spans = sorted((_address(a), int(a.nbytes)) for a in arrays if a.nbytes)
    merged = []
    for start, size in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            last_start, last_size = merged[-1]
            merged[-1] = (last_start, max(last_size, start + size - last_start))
        else:
            merged.append((start, size))
    return merged


def _address(array):
    """A device array's address: a CuPy array's device pointer, a NumPy (stand-in runtime) array's own."""
    pointer = getattr(array.data, "ptr", None)
    return int(pointer) if pointer is not None else int(array.ctypes.data)
