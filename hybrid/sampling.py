"""Per-request sampling settings and the sampler that applies them to one row of logits."""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.8  # <= 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    seed: int | None = None
    stop: list = field(default_factory=list)  # stop strings (not included in the text)
    ignore_eos: bool = False

    def validate(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self


class Sampler:
    """temperature -> top-k -> top-p -> min-p -> draw (the transformers order); greedy at temperature 0.

    Only the candidates that can survive are sorted: top-p and min-p each keep a prefix of the
    tokens in descending probability, so the kept set is the shorter prefix, and min-p's prefix
    is found without sorting. A full-vocabulary sort (150K entries) happens only with both
    top-k and min-p off.
    """

    def __init__(self, params):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits):
        """logits [V] -> token id."""
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature  # [V]
        candidates = np.arange(scaled.size)
        if 0 < p.top_k < scaled.size:
            candidates = np.argpartition(-scaled, p.top_k - 1)[: p.top_k]
        weights = np.exp(scaled[candidates] - scaled[candidates].max())  # unnormalized probabilities
        total = weights.sum()
        if p.min_p > 0.0:
            keep = weights >= p.min_p * weights.max()
            candidates, weights = candidates[keep], weights[keep]
        order = np.lexsort((candidates, -weights))  # descending probability, ties to the lower id
        candidates, weights = candidates[order], weights[order]
        if p.top_p < 1.0:
            keep = min(int(np.searchsorted(np.cumsum(weights) / total, p.top_p)) + 1, len(weights))
            candidates, weights = candidates[:keep], weights[:keep]
        return int(candidates[self.rng.choice(len(candidates), p=weights / weights.sum())])
