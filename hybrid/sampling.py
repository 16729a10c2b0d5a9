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
    """temperature -> top-k -> top-p -> min-p -> draw (llama.cpp's order); greedy at temperature 0."""

    def __init__(self, params):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits):
        """logits [V] -> token id."""
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / p.temperature  # [V]
        order = np.argsort(-scaled, kind="stable")  # [V] best first
        if p.top_k > 0:
            order = order[: p.top_k]
        probs = np.exp(scaled[order] - scaled[order[0]])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, probs = order[keep], probs[keep]
        probs /= probs.sum()
        return int(order[self.rng.choice(len(order), p=probs)])
