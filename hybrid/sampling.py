"""Per-request sampling settings and the sampler that applies them to one row of logits."""
import math
from dataclasses import dataclass, field

import numpy as np

from .errors import RequestError

_MASK_ADD = np.array([-np.inf, 0.0], dtype=np.float32)  # added to a logit whose token is (not) allowed
MAX_SEED = 2**64 - 1  # numpy's generators take any size; a bound keeps a request's seed a plain number
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 all but forces it


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
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]

    def validate(self):
        """self, or RequestError (a ValueError) naming the first setting out of its range."""
        checks = [
            (_integer(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (_finite(self.temperature) and self.temperature >= 0, "temperature must be a finite number >= 0"),
            (_integer(self.top_k) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.seed is None or _integer(self.seed) and 0 <= self.seed <= MAX_SEED,
             f"seed must be an integer from 0 to {MAX_SEED}"),
            (all(isinstance(s, str) for s in self.stop), "stop must be a list of strings"),
            (all(_integer(t) and t >= 0 and _finite(b) and abs(b) <= LOGIT_BIAS_RANGE
                 for t, b in self.logit_bias.items()),
             f"logit_bias must map token ids to numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)
        return self


def _integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _finite(value):
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)


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
        self.bias_ids = np.fromiter(params.logit_bias, dtype=np.int64, count=len(params.logit_bias))
        self.bias = np.fromiter(params.logit_bias.values(), dtype=np.float64, count=len(params.logit_bias))

    def __call__(self, logits, allowed=None):
        """logits [V] (allowed: bool [V] or None) -> token id."""
        return self.draw(self.adjusted(logits, allowed))

    def adjusted(self, logits, allowed=None):
        """The logits the draw and the logprobs use: logit_bias added, tokens outside `allowed` at -inf.

        logits [V] -> [V]; the caller's row is never changed (it is returned as it is when nothing applies)."""
        if self.bias_ids.size:
            logits = logits.astype(np.float64)  # [V], a copy
            logits[self.bias_ids] += self.bias
        if allowed is not None:
            logits = logits + _MASK_ADD.take(allowed.view(np.uint8))  # [V]; a gather: no branch per token
        return logits

    @property
    def greedy(self):
        return self.params.temperature <= 0

    def draw(self, logits):
        """Adjusted logits [V] -> token id."""
        if self.greedy:
            return int(np.argmax(logits))
        candidates, probs = self.distribution(logits)
        return int(candidates[self.rng.choice(len(candidates), p=probs)])

    def distribution(self, logits):
        """Adjusted logits [V] -> (token ids [C], probabilities [C]): what `draw` samples from (not greedy)."""
        p = self.params
        logits = logits.astype(np.float64, copy=False)
        with np.errstate(over="ignore"):  # a tiny temperature sends all but the top logits to -inf: greedy
            scaled = (logits - logits.max()) / p.temperature  # [V], <= 0
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
        return candidates, weights / weights.sum()


@dataclass
class TokenLogprob:
    """A generated token's log probability and the `top` most likely tokens at its step: [(id, logprob)]."""

    token_id: int
    logprob: float
    top: list


def token_logprob(logits, token_id, num_top):
    """log_softmax (float64) of adjusted logits [V] at `token_id`, and the `num_top` likeliest tokens that
    the adjustment left possible (a finite logprob), in descending order."""
    row = logits.astype(np.float64)  # [V]
    top = row.max()
    logz = top + np.log(np.exp(row - top).sum())
    best = []
    if num_top:
        num_top = min(num_top, row.size)
        ids = np.argpartition(-row, num_top - 1)[:num_top]
        ids = ids[np.lexsort((ids, -row[ids]))]
        best = [(int(i), float(row[i] - logz)) for i in ids if np.isfinite(row[i])]
    return TokenLogprob(int(token_id), float(row[token_id] - logz), best)
