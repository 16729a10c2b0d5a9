"""The expert cache: fixed VRAM slots holding the resident experts, and the VRAM budget behind it.

The resident set is data: a boolean mask [L, E] (from a placement file, a plan made at start-up
for the room left, or the default that fills the budget layer by layer). Layer l gets one slot per
resident expert, each holding that expert's gate, up and down rows as raw GGUF blocks. The dynamic
mode (placement/dynamic.py) swaps a slot's expert in the background: `begin_swap` copies on a
side stream through a pinned staging buffer once the model's queued work is done with the slot;
`poll` marks the newcomer resident when its copy has landed.
Shape legend: L layers, E experts, n_l slots of layer l, F expert width, H hidden, B bytes per row.
"""
import logging
from dataclasses import dataclass

import numpy as np

from placement.residency import default_residency

from .errors import VramError

log = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass
class VramBudget:
    total: int
    free: int
    dense: int
    kv: int
    scratch: int
    reserve: int
    expert_cache: int  # bytes the resident experts take
    slots_resident: int
    slots_total: int

    def describe(self):
        mib = lambda n: f"{n / MIB:.0f} MiB"  # noqa: E731
        return (f"VRAM {mib(self.total)} ({mib(self.free)} free): dense weights {mib(self.dense)}, "
                f"KV {mib(self.kv)}, expert slots {self.slots_resident}/{self.slots_total} "
                f"({mib(self.expert_cache)}), scratch {mib(self.scratch)}, reserve {mib(self.reserve)}")


def expert_bytes(layer):
    """Bytes of one expert of `layer` (gate + up + down rows)."""
    return sum(t.nbytes // t.shape[0] for t in (layer.gate_exps, layer.up_exps, layer.down_exps))


def plan(free, total, dense, kv, scratch, reserve, bytes_per_expert, num_experts, cache_bytes=None, resident=None):
    """The budget and the resident mask [L, E]. cache_bytes None = all that is left ("auto");
    `resident` overrides the default fill: a mask (a placement's), or a function (room bytes,
    bytes_per_expert) -> mask that plans for the room left. VramError when it cannot fit."""
    fixed = dense + kv + scratch + reserve
    if fixed > free:
        raise VramError(f"the GPU has {free / MIB:.0f} MiB free, too little for dense weights {dense / MIB:.0f} MiB "
                        f"+ KV {kv / MIB:.0f} MiB + scratch {scratch / MIB:.0f} MiB + reserve {reserve / MIB:.0f} MiB")
    room = free - fixed if cache_bytes is None else min(cache_bytes, free - fixed)
    if resident is None:
        resident = default_residency(bytes_per_expert, num_experts, room)
    elif callable(resident):
        resident = resident(room, list(bytes_per_expert))
    resident = np.asarray(resident, dtype=bool)
    if resident.shape != (len(bytes_per_expert), num_experts):
        raise VramError(f"the resident mask has shape {resident.shape}; the model has {len(bytes_per_expert)} "
                        f"layers x {num_experts} experts")
    used = int((resident.sum(axis=1) * np.asarray(bytes_per_expert)).sum())
    if used > room:
        raise VramError(f"the resident experts ({int(resident.sum())} of {resident.size}) need {used / MIB:.0f} MiB; "
                        f"the expert cache has {room / MIB:.0f} MiB (GPU {free / MIB:.0f} MiB free - dense weights "
                        f"{dense / MIB:.0f} - KV {kv / MIB:.0f} - scratch {scratch / MIB:.0f} - reserve "
                        f"{reserve / MIB:.0f}{'' if cache_bytes is None else f', capped at {cache_bytes / MIB:.0f}'})")
    budget = VramBudget(total, free, dense, kv, scratch, reserve, used, int(resident.sum()), resident.size)
    return budget, resident


@dataclass
class _Swap:
    layer: int
    slot: int
    out_expert: int
    in_expert: int
    done: object  # event recorded after the copy
    staging: np.ndarray


class ExpertCache:
    """Per layer, device arrays gate [n_l, F, B], up [n_l, F, B], down [n_l, H, B]; slot_of int32 [L, E] (-1: not here)
    and its device copy slot_map, which decode kernels read to find the resident pairs themselves.

    `resident` is updated in place by swaps (the ExpertSplit reads the same array); slot_map follows
    in the order of `stream` (the model's), so kernels queued before a change see the old slots."""

    def __init__(self, runtime, layers, resident, stream=None):
        self.rt, self.host_layers, self.stream = runtime, layers, stream
        self.resident = resident  # [L, E]
        self.slot_of = np.full(resident.shape, -1, dtype=np.int32)  # [L, E]
        self.layers = []
        for layer in layers:
            if layer.gate_exps is None:  # a dense layer: nothing to cache
                self.layers.append(None)
                continue
            experts = np.flatnonzero(resident[layer.index])
            self.slot_of[layer.index, experts] = np.arange(len(experts), dtype=np.int32)
            self.layers.append(tuple(self._upload(runtime, t, experts)
                                     for t in (layer.gate_exps, layer.up_exps, layer.down_exps)))
        self.slot_map = runtime.to_device(self.slot_of)  # [L, E]
        self.pending = []  # [_Swap] in flight
        self._copy_stream = None
        self._staging = []  # free pinned buffers

    def begin_swap(self, layer, out_expert, in_expert, stream=None):
        """Start replacing resident `out_expert` of `layer` by `in_expert` in its slot. From now on
        neither is resident; the copy waits for the work queued on `stream` (which may still read the
        slot), runs on a side stream, and lands at a later `poll`."""
        slot = int(self.slot_of[layer, out_expert])
        if slot < 0 or self.slot_of[layer, in_expert] >= 0:
            raise ValueError(f"swap at layer {layer}: expert {out_expert} must be resident and {in_expert} not")
        self.slot_of[layer, out_expert] = -1
        self.resident[layer, out_expert] = False
        self._publish(layer, stream)
        w = self.host_layers[layer]
        sources = [np.ascontiguousarray(t.raw[in_expert]) for t in (w.gate_exps, w.up_exps, w.down_exps)]
        staging = self._staging_buffer(sum(a.nbytes for a in sources))
        if self._copy_stream is None:
            self._copy_stream = self.rt.stream()
        queued = self.rt.event()
        queued.record(stream)
        if self._copy_stream is not None:
            self._copy_stream.wait_event(queued)
        offset = 0
        for source, slots in zip(sources, self.layers[layer]):
            view = staging[offset:offset + source.nbytes].reshape(source.shape)
            np.copyto(view, source)
            self.rt.copy_from_host(slots[slot], view, self._copy_stream)
            offset += source.nbytes
        done = self.rt.event()
        done.record(self._copy_stream)
        self.pending.append(_Swap(layer, slot, out_expert, in_expert, done, staging))

    def poll(self):
        """[(layer, out_expert, in_expert)] of the swaps whose copy has landed; their newcomers are resident now."""
        landed, waiting = [], []
        for swap in self.pending:
            if not swap.done.done:
                waiting.append(swap)
                continue
            self.slot_of[swap.layer, swap.in_expert] = swap.slot
            self.resident[swap.layer, swap.in_expert] = True
            self._publish(swap.layer, self.stream)
            self._staging.append(swap.staging)
            landed.append((swap.layer, swap.out_expert, swap.in_expert))
        self.pending = waiting
        return landed

    def _publish(self, layer, stream):
        """Queue the copy of slot_of[layer] into the device slot map on `stream`."""
        self.rt.copy_from_host(self.slot_map[layer], self.slot_of[layer].copy(), stream)

    def _staging_buffer(self, nbytes):
        for i, buffer in enumerate(self._staging):
            if buffer.nbytes >= nbytes:
                return self._staging.pop(i)
        return self.rt.pinned_empty((nbytes,), np.uint8)

    @staticmethod
    def _upload(runtime, tensor, experts):
        slots = runtime.empty((len(experts),) + tensor.raw.shape[1:], np.uint8)  # [n_l, R, B]
        for slot, e in enumerate(experts):
            runtime.copy_from_host(slots[slot], np.ascontiguousarray(tensor.raw[e]))
        return slots
