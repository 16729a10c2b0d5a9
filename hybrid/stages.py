"""Several GPUs as pipeline stages: which layers each device runs, the experts it holds, and a sequence's KV over them.

`--layer-split K[,K2...]` gives the first layer of each stage after the first; `auto` takes the placement's split
when there is one, else cuts where the layers' bytes (dense and experts) match each device's share of the free
memory. A placement planned for another split is refused with both splits. The engine over the stages is
hybrid/staged_model.py. Shape legend: L layers, E experts, n positions, Hkv kv heads, D head dim.
"""
import logging

import numpy as np

from placement.placement import PlacementError
from placement.residency import default_residency

from .host_memory import host_array

log = logging.getLogger(__name__)


def layer_bytes(weights):
    """int [L]: each layer's bytes in the file (its dense weights and every expert)."""
    sizes = np.zeros(weights.config.num_layers, dtype=np.int64)
    for name, tensor in weights.tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and int(parts[1]) < len(sizes):
            sizes[int(parts[1])] += tensor.raw.nbytes
    return sizes


def trim_copies(layers, resident):
    """Trimmed stage weights: copy into host RAM only the rows of the experts no device holds (resident bool [L, E],
    every device's), into a host_array whose unwritten rows take no memory; a layer whose experts some device holds
    all stays mapped from the file. Returns the bytes copied."""
    copied = 0
    for layer in layers:
        cpu = np.flatnonzero(~resident[layer.index]) if layer.gate_exps is not None else ()
        for tensor in (layer.gate_exps, layer.up_exps, layer.down_exps) if len(cpu) else ():
            if tensor.raw.flags.writeable:  # a copy already
                continue
            out = host_array(tensor.raw.shape, tensor.raw.dtype)  # [E, R, B]
            out[cpu] = tensor.raw[cpu]
            tensor.raw = out
            copied += out[cpu].nbytes
    return copied


def describe_split(ranges):
    """"layers 0-11, 12-23" of stage ranges."""
    return "layers " + ", ".join(f"{r.start}-{r.stop - 1}" for r in ranges)


def check_cuts(cuts, num_layers, num_stages):
    """Stage ranges of the first layers `cuts` of stages 1.. (ValueError naming --layer-split when they do not fit)."""
    cuts = tuple(int(k) for k in cuts)
    if len(cuts) != num_stages - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < k < num_layers for k in cuts):
        raise ValueError(f"--layer-split {','.join(map(str, cuts))}: need {num_stages - 1} increasing layer indices "
                         f"in 1..{num_layers - 1} for {num_stages} GPUs")
    bounds = (0, *cuts, num_layers)
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def auto_cuts(sizes, free):
    """The first layer of each stage after the first: the layers' bytes `sizes` [L] cut in the proportions of the
    devices' free bytes `free` [S], each stage at least one layer."""
    num_layers, num_stages = len(sizes), len(free)
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} GPUs for {num_layers} layers: a GPU needs at least one layer")
    ends = np.cumsum(sizes, dtype=np.float64)  # [L] bytes up to and with layer l
    shares = np.cumsum(free, dtype=np.float64)[:-1] / float(np.sum(free)) * ends[-1]
    cuts, low = [], 1
    for s, share in enumerate(shares):
        k = int(np.searchsorted(ends, share, side="left")) + 1  # the first layer past the share
        k = min(max(k, low), num_layers - (num_stages - 1 - s))
        cuts.append(k)
        low = k + 1
    return tuple(cuts)


def stage_ranges(layer_split, num_layers, free, sizes, placement=None):
    """[range] of layers per stage (len(free) stages). layer_split: "auto" or cuts; a placement with a split fixes
    "auto" and must match given cuts (PlacementError with both)."""
    num_stages = len(free)
    planned = None if placement is None else [range(g.first_layer, g.last_layer) for g in placement.gpus]
    if layer_split == "auto":
        ranges = planned if planned is not None and len(planned) == num_stages else check_cuts(
            auto_cuts(sizes, free), num_layers, num_stages)
    else:
        ranges = check_cuts(layer_split, num_layers, num_stages)
    if planned is not None and planned != ranges:
        raise PlacementError(f"the placement of {placement.model_id} was planned for {len(planned)} GPU(s), "
                             f"{describe_split(planned)}; this engine runs {num_stages} GPUs, "
                             f"{describe_split(ranges)}: plan again with `strata plan --gpu-mib ... --layer-split "
                             f"{','.join(str(r.start) for r in ranges[1:]) or 'auto'}` or give its split")
    return ranges


def stage_resident(layers_range, num_layers, num_experts, resident=None, placement=None, stage=0):
    """A stage's GpuBackend `resident`: bool [L, E] with rows only in its layers (from a mask for every layer, or
    the placement's GPU `stage`), or, with neither, a function that fills its room layer by layer over its layers."""
    if placement is not None:
        resident = placement.resident_mask(num_layers, num_experts, gpu=placement.gpus[stage].gpu)
    if resident is not None:
        mask = np.zeros((num_layers, num_experts), dtype=bool)
        mask[layers_range.start:layers_range.stop] = np.asarray(resident, dtype=bool)[
            layers_range.start:layers_range.stop]
        return mask

    def fill(room, bytes_per_expert):
        mask = np.zeros((num_layers, num_experts), dtype=bool)
        own = [i for i in layers_range if bytes_per_expert[i] > 0]  # not the dense layers
        if own:
            mask[own] = default_residency([bytes_per_expert[i] for i in own], num_experts, room)
        return mask

    return fill


class StagedKV:
    """One sequence's KV over the stages: a part per stage (its device's DeviceSequenceKV of the stage's layers),
    moved together, each with its device current. Export / load stack the parts' layers in order."""

    supports_rollback = True
    recurrent = None

    def __init__(self, parts):
        self.parts = parts
        self.max_tokens, self.dtype = parts[0].max_tokens, parts[0].dtype

    @property
    def length(self):
        return self.parts[0].length

    @length.setter
    def length(self, value):
        for part in self.parts:
            part.length = value

    def reserve(self, num_tokens):
        for part in self.parts:
            part.reserve(num_tokens)

    def _each(self):
        for part in self.parts:
            part.backend.rt.use()
            yield part

    def commit(self, length):
        for part in self._each():
            part.commit(length)

    def truncate(self, length):
        for part in self.parts:
            part.truncate(length)

    def rollback(self, length):
        return min(part.rollback(length) for part in self.parts)

    def export(self, n):
        """Positions [0, n) as float32 (k, v) [L, n, Hkv, D]."""
        pieces = [part.export(n) for part in self._each()]
        return tuple(np.concatenate([p[i] for p in pieces]) for i in (0, 1))

    def load(self, k, v):
        """Float32 (k, v) [L, n, Hkv, D] become positions [0, n) of every part."""
        start = 0
        for part in self._each():
            stop = start + part.num_layers
            part.load(k[start:stop], v[start:stop])
            start = stop


def hit_rates(usage, resident, ranges):
    """[{decode, prefill}] per stage: the share of the routed pairs of its layers whose expert it holds (None
    before any)."""
    out = []
    for r in ranges:
        rates = {}
        for phase in ("decode", "prefill"):
            counts = getattr(usage, phase)[r.start:r.stop]  # [L_s, E]
            total = counts.sum()
            rates[phase] = float((counts * resident[r.start:r.stop]).sum() / total) if total else None
        out.append(rates)
    return out


def planned_placement(profile, weights, free, settings, max_context, layer_split):
    """A placement for the stages planned at start-up from `profile` (an ExpertProfile or its file) for each device's
    free bytes `free` [S] (placement.planner.plan: every split for "auto", else the given one). settings: the
    EngineConfig (--parallel's kv_sequences, --kv, --vram-reserve-mib, --kv-resident)."""
    from placement.budget import ModelSizes
    from placement.planner import Budgets, plan
    from placement.profile import ExpertProfile, model_id

    loaded = ExpertProfile.load(profile) if isinstance(profile, str) else profile
    c = weights.config
    loaded.check_model(c.num_layers, c.num_experts, model_id(weights))  # ProfileError when the model differs
    budgets = Budgets(tuple(f / 2**20 for f in free), settings.kv_sequences, max_context, settings.kv,
                      settings.vram_reserve_mib, layer_split, settings.kv_resident)
    placement = plan(loaded, ModelSizes.from_weights(weights), budgets)
    log.info("expert cache over %d GPUs planned at start-up from the profile: %s, %d experts resident, predicted hit "
             "rate %.1f%%", len(free), describe_split([range(g.first_layer, g.last_layer) for g in placement.gpus]),
             placement.predicted["resident"], 100 * placement.predicted["hit_rate"])
    return placement


def placement_or_none(placement):
    """A Placement from a file name, a Placement, or None."""
    from placement.placement import Placement

    if placement is None or not isinstance(placement, str):
        return placement
    loaded = Placement.load(placement)
    log.info("placement %s: %d GPU(s), %s", placement, len(loaded.gpus),
             describe_split([range(g.first_layer, g.last_layer) for g in loaded.gpus]))
    return loaded
