"""The expert cache: fixed VRAM slots holding the resident experts, and the VRAM budget behind it.

The resident set is data: a boolean mask [L, E] (from a placement file, or the default that
fills the budget layer by layer). Layer l gets one slot per resident expert, each holding that
expert's gate, up and down rows as raw GGUF blocks.
Shape legend: L layers, E experts, n_l slots of layer l, F expert width, H hidden, B bytes per row.
"""
import logging
from dataclasses import dataclass

import numpy as np

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


def default_residency(bytes_per_expert, num_experts, budget):
    """mask bool [L, E]: whole layers first, in order, then the first experts of the next layer."""
    mask = np.zeros((len(bytes_per_expert), num_experts), dtype=bool)  # [L, E]
    left = budget
    for layer, size in enumerate(bytes_per_expert):
        count = min(num_experts, left // size)
        mask[layer, :count] = True
        left -= count * size
        if count < num_experts:
            break
    return mask


def plan(free, total, dense, kv, scratch, reserve, bytes_per_expert, num_experts, cache_bytes=None, resident=None):
    """The budget and the resident mask [L, E]. cache_bytes None = all that is left ("auto");
    `resident` (a placement's mask) overrides the default fill. VramError when it cannot fit."""
    fixed = dense + kv + scratch + reserve
    if fixed > free:
        raise VramError(f"the GPU has {free / MIB:.0f} MiB free, too little for dense weights {dense / MIB:.0f} MiB "
                        f"+ KV {kv / MIB:.0f} MiB + scratch {scratch / MIB:.0f} MiB + reserve {reserve / MIB:.0f} MiB")
    room = free - fixed if cache_bytes is None else min(cache_bytes, free - fixed)
    if resident is None:
        resident = default_residency(bytes_per_expert, num_experts, room)
    resident = np.asarray(resident, dtype=bool)
    used = int((resident.sum(axis=1) * np.asarray(bytes_per_expert)).sum())
    if used > free - fixed:
        raise VramError(f"the resident experts need {used / MIB:.0f} MiB; {(free - fixed) / MIB:.0f} MiB are left "
                        f"after dense weights, KV, scratch and reserve")
    budget = VramBudget(total, free, dense, kv, scratch, reserve, used, int(resident.sum()), resident.size)
    return budget, resident


class ExpertCache:
    """Per layer, device arrays gate [n_l, F, B], up [n_l, F, B], down [n_l, H, B]; slot_of int32 [L, E] (-1: not here)."""

    def __init__(self, runtime, layers, resident):
        self.resident = resident  # [L, E]
        self.slot_of = np.full(resident.shape, -1, dtype=np.int32)  # [L, E]
        self.layers = []
        for layer in layers:
            experts = np.flatnonzero(resident[layer.index])
            self.slot_of[layer.index, experts] = np.arange(len(experts), dtype=np.int32)
            self.layers.append(tuple(self._upload(runtime, t, experts)
                                     for t in (layer.gate_exps, layer.up_exps, layer.down_exps)))

    @staticmethod
    def _upload(runtime, tensor, experts):
        slots = runtime.empty((len(experts),) + tensor.raw.shape[1:], np.uint8)  # [n_l, R, B]
        for slot, e in enumerate(experts):
            runtime.copy_from_host(slots[slot], np.ascontiguousarray(tensor.raw[e]))
        return slots
