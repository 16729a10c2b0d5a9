"""The dynamic expert cache: per-layer frequency/recency scores that swap experts in the background.

Each step, every layer's score decays and gains the step's routings (score = decay * score +
count: frequency weighted towards recent steps). A swap replaces a layer's coldest resident
expert with its hottest non-resident one only when the newcomer's score beats the resident's by
the hysteresis margin (score_in > (1 + margin) * score_out + min_score), at most `max_swaps` a
step (the largest gains first), so a burst cannot thrash the cache. A swap keeps the layer's slot
count: the cache never holds more experts than it has slots. The copy runs in the background
(`ExpertCache.begin_swap`); until it lands, neither expert is resident and both run on the CPU.
Shape legend: L layers, E experts.
"""
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


SETTING_LIMITS = {  # DynamicSettings field: (test of a value, what the value must be)
    "decay": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "margin": (lambda v: 0.0 <= v < float("inf"), ">= 0"),
    "min_score": (lambda v: 0.0 <= v < float("inf"), ">= 0"),
    "max_swaps": (lambda v: v >= 1, "an integer >= 1"),
    "max_pending": (lambda v: v >= 1, "an integer >= 1"),
}


@dataclass(frozen=True)
class DynamicSettings:
    decay: float = 0.98  # per step: a routing's weight halves in ~34 steps
    margin: float = 0.5  # the newcomer's score must beat the resident's by 50 % ...
    min_score: float = 2.0  # ... plus this many (decayed) routings
    max_swaps: int = 2  # swaps started per step, over all layers
    max_pending: int = 8  # swaps in flight at once (pinned staging buffers)

    def __post_init__(self):
        for name, (valid, what) in SETTING_LIMITS.items():
            value = getattr(self, name)
            if name.startswith("max_") and not isinstance(value, (int, np.integer)) or not valid(value):
                raise ValueError(f"DynamicSettings.{name}: must be {what}, got {value!r}")


class SwapPolicy:
    """Scores float [L, E] and the swaps they call for; pure NumPy, no device."""

    def __init__(self, num_layers, num_experts, settings=DynamicSettings()):
        self.settings = settings
        self.scores = np.zeros((num_layers, num_experts), dtype=np.float64)  # [L, E]

    def observe(self, counts):
        """counts int [L, E]: the routings of one step."""
        self.scores *= self.settings.decay
        self.scores += counts

    def propose(self, resident, busy=None, limit=None):
        """[(layer, out_expert, in_expert)], largest gain first, at most `limit` (default max_swaps).
        resident bool [L, E]; busy bool [L, E]: experts with a swap in flight (neither in nor out)."""
        s = self.settings
        limit = s.max_swaps if limit is None else min(limit, s.max_swaps)
        busy = np.zeros_like(resident) if busy is None else busy
        candidates = []  # (gain, layer, out, in)
        for layer in range(self.scores.shape[0]):
            score = self.scores[layer]
            inside = np.flatnonzero(resident[layer] & ~busy[layer])
            outside = np.flatnonzero(~resident[layer] & ~busy[layer])
            if len(inside) == 0 or len(outside) == 0:
                continue
            cold = inside[np.lexsort((inside, score[inside]))]  # coldest first, ties by index
            hot = outside[np.lexsort((outside, -score[outside]))]  # hottest first
            for out_e, in_e in zip(cold, hot):
                if score[in_e] <= (1.0 + s.margin) * score[out_e] + s.min_score:
                    break
                candidates.append((score[in_e] - score[out_e], layer, int(out_e), int(in_e)))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        return [(layer, out_e, in_e) for _, layer, out_e, in_e in candidates[:max(limit, 0)]]


class DynamicResidency:
    """Drives an expert cache from the routings the model records (an ExpertUsage), once a step.

    `cache` offers resident bool [L, E] (shared with the split), begin_swap(layer, out, in, after)
    and poll() -> [(layer, out, in)] of the swaps that landed since; `stream`: the stream the model's kernels run on (the copies wait
    for its work queued so far). Also counts the live hit rate: routings of each step that found
    their expert resident during that step.
    """

    def __init__(self, cache, settings=DynamicSettings(), stream=None):
        self.cache, self.stream = cache, stream
        L, E = cache.resident.shape
        self.policy = SwapPolicy(L, E, settings)
        self.busy = np.zeros((L, E), dtype=bool)  # [L, E] experts of swaps in flight
        self.swaps_started = self.swaps_landed = 0
        self.in_flight = 0
        self.routed = {"prefill": 0, "decode": 0}
        self.hits = {"prefill": 0, "decode": 0}
        self._usage, self._seen = None, None  # the ExpertUsage followed, its counts at the last step

    def after_step(self, usage):
        """Called by the model after each forward step's layers (usage: its ExpertUsage, or None)."""
        if usage is None:
            return
        counts = {"prefill": usage.prefill.copy(), "decode": usage.decode.copy()}
        if usage is not self._usage or any((counts[p] < self._seen[p]).any() for p in counts):
            self._usage, self._seen = usage, {p: np.zeros_like(c) for p, c in counts.items()}  # new or reset
        step = {p: counts[p] - self._seen[p] for p in counts}  # [L, E] each
        self._seen = counts
        for phase, delta in step.items():  # the mask this step ran with: swaps land only below
            self.routed[phase] += int(delta.sum())
            self.hits[phase] += int(delta[self.cache.resident].sum())
        for layer, out_e, in_e in self.cache.poll():
            self.busy[layer, [out_e, in_e]] = False
            self.swaps_landed += 1
            self.in_flight -= 1
        self.policy.observe(step["prefill"] + step["decode"])
        room = self.policy.settings.max_pending - self.in_flight
        for layer, out_e, in_e in self.policy.propose(self.cache.resident, self.busy, limit=room):
            self.cache.begin_swap(layer, out_e, in_e, self.stream)
            self.busy[layer, [out_e, in_e]] = True
            self.swaps_started += 1
            self.in_flight += 1

    def hit_rate(self, phase="decode"):
        return None if self.routed[phase] == 0 else self.hits[phase] / self.routed[phase]

    def snapshot(self):
        return {"hit_rate_decode": self.hit_rate("decode"), "hit_rate_prefill": self.hit_rate("prefill"),
                "swaps_started": self.swaps_started, "swaps_landed": self.swaps_landed}
