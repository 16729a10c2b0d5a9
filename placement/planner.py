"""The placement planner: which experts each GPU holds, chosen to minimise predicted decode time.

Cost model of one decode step at batch B (every slot decoding one token):
  step = fixed + sum over layers of the layer's expected time
  q_e = 1 - (1 - p_e)^B, the chance that at least one of the B tokens uses e (p_e from the profile),
  so sum q_e is the expected number of distinct experts a step reads (exact by linearity).
  G = sum over resident experts e of q_e * expert bytes / GPU bandwidth (expected GPU part)
  C = sum over non-resident experts e of q_e * expert bytes / CPU bandwidth (expected CPU part)
  P0 = product over non-resident experts of (1 - q_e): the chance that the layer needs no CPU expert
  layer = max(G, C + P0 * G)
  fixed = (dense weights + output head + the KV read at half the planned context) / GPU bandwidth.
The two parts run at once, so a layer takes the longer of them. A step that needs any CPU expert
waits for it, and one CPU expert (a few MB from RAM) outlasts every GPU expert of the step; a step
that needs none takes the GPU part. Hence C + P0 * G, bounded below by G for a slow GPU. The
simpler max(G, C) would let a layer stop taking experts once C fell under G, which at batch 1
gave up hit rate on strongly skewed layers for nothing: the rare miss still costs a whole CPU
expert. P0 treats the experts as independent (the profile's pairwise co-activation cannot give
the chance of a whole set).

Per layer, for a resident count n the best set is the n experts of highest q; f_l(n) = the least
layer cost over prefixes of length <= n, so a layer may leave a slot empty when the GPU part would
become the longer one (`fill_slots` then uses such slots for the most used experts left out: see
there). Where every f_l is convex, handing a GPU's slots out one by one to the layer that gains
most is optimal for the sum (ties go to the lower layer, then the lower expert index); otherwise
a dynamic programme over (layer, slots used) finds the optimum. Several GPUs: contiguous layer
ranges, a layer's experts live on the GPU that runs its layer; `auto` tries every split, keeps the
fastest, then the most even memory use.

The plan is kept only where it is shown to beat the simple baseline, the global top-k (the most used
(layer, expert) pairs by the profile's counts, prompt and decode together), on routings it did not
plan from (`cross_check`): the profile's parts (its prompts, or groups of them) are dealt into folds;
for each fold both choices are made from the other folds and scored on the fold's routings by the
cost model (the predicted step). The plan stays where its mean gain over the folds exceeds
CHECK_Z standard errors, else the cache holds the global top-k. A profile of fewer than two parts
(none kept: a single recording, or a file older than the parts) cannot be checked: the plan stays.
Shape legend: L layers, E experts, P parts.
"""
import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np

from .budget import MIB, BudgetError, check_fits, gpu_budget
from .placement import GpuPlacement, Placement
from .profile import decode_estimate

log = logging.getLogger(__name__)

DEFAULT_CPU_GBPS = 40.0  # expert weights streamed by the CPU kernels; pass a measured value
DEFAULT_GPU_GBPS = 3000.0  # H200-class HBM at realistic efficiency
MAX_SPLITS = 200_000  # layer splits `auto` may try
MAX_FOLDS = 10  # folds of the profile's parts in `cross_check`
CHECK_Z = 2.0  # standard errors of the mean gain over the folds that keep the plan


@dataclass(frozen=True)
class Budgets:
    gpu_mib: tuple  # memory per GPU
    num_slots: int  # --parallel: sequences served at once, also the planned decode batch
    max_context: int
    kv_dtype: str = "f16"
    reserve_mib: float = 1024.0
    layer_split: object = "auto"  # "auto", or the first layer of each GPU after the first (tuple of ints)
    kv_resident: int = None  # tokens of each slot's KV kept in VRAM (--kv-resident), None: all


@dataclass(frozen=True)
class Speeds:
    cpu_gbps: float = DEFAULT_CPU_GBPS
    gpu_gbps: float = DEFAULT_GPU_GBPS


class CostModel:
    """Predicted decode step time and hit rate of a resident mask bool [L, E]."""

    def __init__(self, probs, sizes, batch, speeds, max_context, kv_dtype):
        self.p = np.asarray(probs, dtype=np.float64)  # [L, E] per token
        self.q = 1.0 - (1.0 - self.p) ** batch  # [L, E] per step
        self.batch = batch
        expert = np.asarray(sizes.expert_bytes, dtype=np.float64)  # [L]
        self.gpu_s = expert / (speeds.gpu_gbps * 1e9)  # [L] seconds per expert read on the GPU
        self.cpu_s = expert / (speeds.cpu_gbps * 1e9)  # [L]
        kv_read = batch * ((max_context / 2) * sizes.kv_bytes_per_token(kv_dtype) * sizes.kv_layers(range(sizes.num_layers))
                           + sizes.state_bytes(range(sizes.num_layers)))  # linear-attention layers read their state
        self.fixed_s = (sum(sizes.layer_dense_bytes) + sizes.head_bytes + kv_read) / (speeds.gpu_gbps * 1e9)
        self._curves = [self._curve(layer) for layer in range(len(expert))]

    def layer_seconds(self, mask):
        """float [L]: each layer's expected time, max(G, C + P0 * G) (see the module docstring)."""
        gpu = (self.q * mask).sum(axis=1) * self.gpu_s  # [L]
        cpu = (self.q * ~mask).sum(axis=1) * self.cpu_s  # [L]
        none_on_cpu = np.where(mask, 1.0, 1.0 - self.q).prod(axis=1)  # [L]
        return np.maximum(gpu, cpu + none_on_cpu * gpu)

    def step_seconds(self, mask):
        return self.fixed_s + float(self.layer_seconds(np.asarray(mask, dtype=bool)).sum())

    def decode_tok_s(self, mask):
        return self.batch / self.step_seconds(mask)

    def hit_rate(self, mask):
        """Share of routings that land on a resident expert."""
        return float(self.p[np.asarray(mask, dtype=bool)].sum() / max(self.p.sum(), 1e-300))

    def _curve(self, layer):
        """(expert order by q, f [E+1] = least cost with <= n resident, best_m [E+1] = its resident count)."""
        q = self.q[layer]
        order = np.lexsort((np.arange(len(q)), -q))  # q descending, ties by index
        on_gpu = np.concatenate([[0.0], np.cumsum(q[order])])  # [E+1]
        none_on_cpu = np.concatenate([np.cumprod((1.0 - q[order])[::-1])[::-1], [1.0]])  # [E+1]
        gpu, cpu = on_gpu * self.gpu_s[layer], (q.sum() - on_gpu) * self.cpu_s[layer]  # [E+1]
        cost = np.maximum(gpu, cpu + none_on_cpu * gpu)  # [E+1]
        best_m, best = np.zeros(len(cost), dtype=np.int64), np.inf
        arg = 0
        for m, c in enumerate(cost):
            if c <= best:  # ties keep more experts resident
                best, arg = c, m
            best_m[m] = arg
        return order, cost[best_m], best_m

    def plan_layers(self, layers, num_slots):
        """bool [L, E] with rows `layers` filled: the best use of `num_slots` expert slots for them."""
        mask = np.zeros(self.q.shape, dtype=bool)
        if num_slots <= 0 or len(layers) == 0:
            return mask
        gains = np.stack([-np.diff(self._curves[layer][1]) for layer in layers])  # [len(layers), E]
        if np.all(np.diff(gains, axis=1) <= 1e-12 * np.abs(gains).max(initial=0.0)):  # every curve convex
            rank = np.broadcast_to(np.arange(gains.shape[1]), gains.shape).ravel()
            row = np.repeat(np.arange(len(layers)), gains.shape[1])
            chosen = np.lexsort((rank, row, -gains.ravel()))[:num_slots]
            counts = np.bincount(row[chosen], minlength=len(layers))
        else:
            counts = self._best_counts(layers, num_slots)
        for i, layer in enumerate(layers):
            order, _, best_m = self._curves[layer]
            mask[layer, order[:best_m[counts[i]]]] = True
        return mask

    def _best_counts(self, layers, num_slots):
        """int [len(layers)]: the resident count per layer of least total cost with at most num_slots
        in all, by dynamic programming over (layer, slots used); ties leave the later layer fewer."""
        num_experts = self.q.shape[1]
        top = min(num_slots, num_experts * len(layers))
        best = np.zeros(top + 1)  # [S+1]: least cost of the layers so far with at most s slots
        picks = []
        for layer in layers:
            curve = self._curves[layer][1]  # [E+1]
            new, pick = np.full(top + 1, np.inf), np.zeros(top + 1, dtype=np.int64)
            for m in range(min(num_experts, top) + 1):
                candidate = best[:top + 1 - m] + curve[m]  # [S+1-m]
                better = candidate < new[m:]
                new[m:][better], pick[m:][better] = candidate[better], m
            best = new
            picks.append(pick)
        counts, s = np.zeros(len(layers), dtype=np.int64), top
        for i in range(len(layers) - 1, -1, -1):
            counts[i] = picks[i][s]
            s -= counts[i]
        return counts


def fill_slots(mask, probs, layers, num_free):
    """mask plus the `num_free` most used experts of `layers` that it leaves out (ties by layer, expert).

    The plan leaves a slot empty only where the bandwidth model says the GPU part would become the
    longer one; a real CPU part also costs a fixed hand-over latency the model leaves out, and
    traffic reaches experts a profile never saw, so the slot is better used.
    """
    if num_free <= 0:
        return mask
    left_out = np.where(mask, -1.0, probs)  # [L, E]
    return mask | global_top_mask(left_out, layers, num_free, minimum=0.0)


def planned_mask(cost, groups):
    """bool [L, E]: the plan of each (layers, expert slots) of `groups` by `cost`, its free slots filled."""
    mask = np.zeros(cost.q.shape, dtype=bool)
    for layers, num_slots in groups:
        planned = cost.plan_layers(layers, num_slots)
        mask |= fill_slots(planned, cost.p, layers, num_slots - int(planned.sum()))
    return mask


def top_mask(counts, groups):
    """bool [L, E]: the global top-k by `counts` [L, E] of each (layers, expert slots) of `groups`."""
    mask = np.zeros(np.shape(counts), dtype=bool)
    for layers, num_slots in groups:
        mask |= global_top_mask(np.asarray(counts, dtype=np.float64), layers, num_slots)
    return mask


def cross_check(profile, sizes, groups, batch, speeds=Speeds(), max_context=4096, kv_dtype="f16"):
    """The plan against the global top-k on parts of the profile it did not plan from: a JSON-ready dict with
    folds, gain_ms (mean over folds of top-k's predicted step minus the plan's; > 0: the plan is faster),
    gain_se_ms (its standard error), hit_points (mean hit-rate points of the plan over top-k) and keep
    (whether the gain exceeds CHECK_Z standard errors); folds 0 and keep True where fewer than two parts
    hold routings of the phase planned for (nothing to hold out).

    That phase is decode (prefill for a profile without decode tokens). The parts holding its routings are
    dealt into min(their number, MAX_FOLDS) folds (the i-th to fold i mod folds; the other parts always
    plan); each fold's choices are planned from the rest of the counts as `plan_slots` plans (decode
    estimate, `planned_mask`) and as the baseline chooses (`top_mask` of prompt and decode counts together),
    and scored by the cost model on the fold's own routings of the phase."""
    prefill, decode, tokens = profile.parts()  # [P, L, E], [P, L, E], [P, 2]
    phase = 1 if profile.tokens_decode else 0
    target = (prefill, decode)[phase]
    usable = tokens[:, phase] > 0  # parts without routings of the phase are never held out
    num_folds = min(int(usable.sum()), MAX_FOLDS)
    if num_folds < 2:
        return {"folds": 0, "keep": True, "why": "fewer than two parts: nothing to hold out"}
    fold_of = np.full(len(tokens), -1)
    fold_of[usable] = np.arange(int(usable.sum())) % num_folds
    total_prefill, total_decode, total_tokens = prefill.sum(axis=0), decode.sum(axis=0), tokens.sum(axis=0)
    gains, hits = [], []
    for fold in range(num_folds):
        held = fold_of == fold
        train_prefill = total_prefill - prefill[held].sum(axis=0)
        train_decode = total_decode - decode[held].sum(axis=0)
        train_tokens = total_tokens - tokens[held].sum(axis=0)
        probs, _ = decode_estimate(train_prefill, train_decode, *train_tokens.tolist(), profile.num_experts_per_tok)
        plan_mask = planned_mask(CostModel(probs, sizes, batch, speeds, max_context, kv_dtype), groups)
        baseline = top_mask(train_prefill + train_decode, groups)
        held_counts = target[held].sum(axis=0)
        held_cost = CostModel(np.clip(held_counts / tokens[held, phase].sum(), 0.0, 1.0), sizes, batch, speeds,
                              max_context, kv_dtype)
        gains.append(1e3 * (held_cost.step_seconds(baseline) - held_cost.step_seconds(plan_mask)))
        hits.append(100 * (held_counts[plan_mask].sum() - held_counts[baseline].sum()) / max(held_counts.sum(), 1))
    gain, gain_se = float(np.mean(gains)), float(np.std(gains, ddof=1) / np.sqrt(num_folds))
    return {"folds": num_folds, "gain_ms": gain, "gain_se_ms": gain_se, "hit_points": float(np.mean(hits)),
            "keep": bool(gain > CHECK_Z * gain_se and gain > 0.0)}


def checked_mask(profile, sizes, groups, plan, batch, speeds, max_context, kv_dtype):
    """(mask, check): the plan `plan` bool [L, E] of `groups` where `cross_check` keeps it, else the global
    top-k of the profile's counts."""
    check = cross_check(profile, sizes, groups, batch, speeds, max_context, kv_dtype)
    if check["keep"]:
        return plan, check
    log.info("profile %s: the plan's gain over the global top-k is not shown on held-out parts of the profile "
             "(%+.4g ms +- %.2g a step): using the global top-k", profile.model_id, check["gain_ms"],
             check["gain_se_ms"])
    return top_mask(profile.counts("all"), groups), check


def uniform_mask(probs, layers, num_slots):
    """Baseline: the same number of slots in every layer, each layer's most used experts."""
    mask = np.zeros(probs.shape, dtype=bool)
    layers = list(layers)
    per_layer = np.full(len(layers), num_slots // max(len(layers), 1))
    per_layer[: num_slots % max(len(layers), 1)] += 1
    for layer, n in zip(layers, per_layer):
        order = np.lexsort((np.arange(probs.shape[1]), -probs[layer]))
        mask[layer, order[: min(n, probs.shape[1])]] = True
    return mask


def global_top_mask(probs, layers, num_slots, minimum=-np.inf):
    """Baseline: the most used (layer, expert) pairs of these layers, whatever their layer
    (only pairs with probs >= minimum)."""
    mask = np.zeros(probs.shape, dtype=bool)
    layers = np.asarray(list(layers), dtype=np.int64)
    E = probs.shape[1]
    layer_of, expert_of = np.repeat(layers, E), np.tile(np.arange(E), len(layers))
    chosen = np.lexsort((expert_of, layer_of, -probs[layers].ravel()))[:max(num_slots, 0)]
    chosen = chosen[probs[layer_of[chosen], expert_of[chosen]] >= minimum]
    mask[layer_of[chosen], expert_of[chosen]] = True
    return mask


def _splits(num_layers, num_gpus, layer_split):
    """Candidate tuples of layer ranges, one per GPU."""
    if num_gpus > num_layers:
        raise BudgetError(f"{num_gpus} GPUs for {num_layers} layers: a GPU needs at least one layer")
    if layer_split == "auto":
        if math.comb(num_layers - 1, num_gpus - 1) > MAX_SPLITS:
            raise BudgetError(f"too many layer splits for {num_gpus} GPUs to try; give --layer-split")
        candidates = itertools.combinations(range(1, num_layers), num_gpus - 1)
    else:
        cuts = tuple(int(k) for k in layer_split)
        if len(cuts) != num_gpus - 1 or list(cuts) != sorted(set(cuts)) or not all(0 < k < num_layers for k in cuts):
            raise ValueError(f"--layer-split {','.join(map(str, cuts))}: need {num_gpus - 1} increasing layer "
                             f"indices in 1..{num_layers - 1} for {num_gpus} GPUs")
        candidates = [cuts]
    for cuts in candidates:
        bounds = (0, *cuts, num_layers)
        yield tuple(range(bounds[g], bounds[g + 1]) for g in range(num_gpus))


def _layer_probs(profile):
    """(float64 [L, E] per decode token, how they were estimated): the decode routings with the prompt's
    as their prior (ExpertProfile.decode_estimate)."""
    probs, strength = profile.decode_estimate()
    if profile.tokens_decode == 0:
        log.warning("profile %s has no decode tokens: planning from its prompt routings", profile.model_id)
        return probs, "prefill"
    if strength == 0.0:
        return probs, "decode"
    return probs, f"decode, prompt prior of {strength:.3g} routings"


def plan(profile, sizes, budgets, speeds=Speeds()):
    """ExpertProfile + ModelSizes + Budgets -> Placement (raises BudgetError when nothing fits)."""
    profile.check_model(sizes.num_layers, sizes.num_experts)
    probs, phase = _layer_probs(profile)
    cost = CostModel(probs, sizes, budgets.num_slots, speeds, budgets.max_context, budgets.kv_dtype)
    best, first_error = None, None
    for ranges in _splits(sizes.num_layers, len(budgets.gpu_mib), budgets.layer_split):
        try:
            candidate = _plan_split(cost, sizes, budgets, ranges)
        except BudgetError as exc:
            first_error = first_error or exc
            continue
        if best is None or _better(candidate, best):
            best = candidate
    if best is None:
        raise first_error
    mask, gpu_budgets, _, _ = best
    groups = [(range(b.first_layer, b.last_layer), b.expert_slots) for b in gpu_budgets]
    mask, check = checked_mask(profile, sizes, groups, mask, budgets.num_slots, speeds, budgets.max_context,
                               budgets.kv_dtype)
    return _placement_of_split(profile, cost, mask, gpu_budgets, budgets, speeds, phase, check)


def _plan_split(cost, sizes, budgets, ranges):
    """(mask, budgets, step seconds, memory imbalance) of one layer split."""
    mask = np.zeros(cost.q.shape, dtype=bool)
    gpu_budgets, used = [], []
    for gpu, layers in enumerate(ranges):
        budget = gpu_budget(sizes, gpu, len(ranges), budgets.gpu_mib[gpu] * MIB, layers, budgets.num_slots,
                            budgets.max_context, budgets.kv_dtype, budgets.reserve_mib * MIB, budgets.kv_resident)
        check_fits(budget, budgets.num_slots, budgets.max_context, budgets.kv_dtype)
        mask |= planned_mask(cost, [(layers, budget.expert_slots)])
        gpu_budgets.append(budget)
        used.append(1.0 - (budget.free - mask[layers.start:layers.stop].sum() * budget.slot_bytes) / budget.total)
    return mask, gpu_budgets, cost.step_seconds(mask), max(used) - min(used)


def _better(a, b):
    """Faster wins; within a relative 1e-9, the more even memory use; then the earlier split."""
    if abs(a[2] - b[2]) > 1e-9 * b[2]:
        return a[2] < b[2]
    return a[3] < b[3] - 1e-12


def plan_slots(profile, sizes, num_slots, batch, speeds=Speeds(), max_context=4096, kv_dtype="f16"):
    """One GPU whose expert cache holds `num_slots` experts (sized by the engine at start-up, after its
    dense weights, KV and scratch): the Placement of the best resident set, with the baselines."""
    profile.check_model(sizes.num_layers, sizes.num_experts)
    probs, phase = _layer_probs(profile)
    cost = CostModel(probs, sizes, batch, speeds, max_context, kv_dtype)
    layers = range(sizes.num_layers)
    mask, check = checked_mask(profile, sizes, [(layers, num_slots)], planned_mask(cost, [(layers, num_slots)]),
                               batch, speeds, max_context, kv_dtype)
    slot = max(sizes.expert_bytes)
    budget = {"expert_slots": int(num_slots), "slot_mib": slot / MIB, "expert_cache_mib": num_slots * slot / MIB}
    settings = {"parallel": batch, "max_context": max_context, "kv": kv_dtype, "cpu_gbps": speeds.cpu_gbps,
                "gpu_gbps": speeds.gpu_gbps, "profile_phase": phase, "profile_tokens": profile.tokens(),
                "planned_at": "start-up", "check": check}
    return _placement(profile, cost, mask, [(0, layers, num_slots, budget)], batch, settings)


def _placement_of_split(profile, cost, mask, gpu_budgets, budgets, speeds, phase, check):
    settings = {"gpu_mib": list(budgets.gpu_mib), "parallel": budgets.num_slots, "max_context": budgets.max_context,
                "kv": budgets.kv_dtype, "vram_reserve_mib": budgets.reserve_mib, "cpu_gbps": speeds.cpu_gbps,
                "gpu_gbps": speeds.gpu_gbps, "profile_phase": phase, "profile_tokens": profile.tokens(),
                "check": check}
    gpus = [(b.gpu, range(b.first_layer, b.last_layer), b.expert_slots, b.to_json()) for b in gpu_budgets]
    return _placement(profile, cost, mask, gpus, budgets.num_slots, settings)


def _placement(profile, cost, mask, gpus, batch, settings):
    """gpus: [(gpu, layers range, expert slots, budget json)]."""
    placed, uniform, top = [], np.zeros_like(mask), np.zeros_like(mask)
    for gpu, layers, num_slots, budget in gpus:
        resident = [(int(layer), int(e)) for layer, e in zip(*np.nonzero(mask)) if layer in layers]
        placed.append(GpuPlacement(gpu, layers.start, layers.stop, resident, budget))
        uniform |= uniform_mask(cost.p, layers, num_slots)
        top |= global_top_mask(cost.p, layers, num_slots)

    def prediction(m):
        return {"hit_rate": cost.hit_rate(m), "decode_tok_s": cost.decode_tok_s(m),
                "step_ms": 1e3 * cost.step_seconds(m), "resident": int(m.sum())}

    return Placement(profile.model_id, profile.num_layers, profile.num_experts, placed,
                     predicted={**prediction(mask), "batch": batch},
                     baselines={"uniform": prediction(uniform), "global_top": prediction(top)}, settings=settings)
