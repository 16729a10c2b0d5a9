"""How many drafts a slot scores: as many as raise the step's expected tokens per second.

A step of T tokens takes `StepTimes.estimate(T)` seconds (measured decode-only steps, by T). A slot whose
drafts are each accepted with probability p (given the ones before were) emits 1 + p + ... + p^k tokens
from k drafts; with n decoding slots the step emits n - 1 + that. `best_k` takes the k of the most tokens
per second, if that beats drafting nothing by MARGIN. Where a step size was never measured its time is
extrapolated from the largest one below at a quarter of a token's average time per extra token (optimistic, so
that drafting gets tried and measured).
"""
DECAY = 0.8  # weight of the older measurements of one step size
EXTRA_TOKEN_SHARE = 0.25  # an unmeasured extra token's time, in average token times of the size below
MARGIN = 0.05  # drafts must promise this share more tokens per second: near break-even, noise in the estimates
# (and the verification's own work: sampling each drafted position, the rollback) turns a promised gain into a loss


class StepTimes:
    """Seconds of decode-only steps by their number of tokens (exponentially weighted)."""

    def __init__(self):
        self.seconds = {}

    def add(self, num_tokens, seconds):
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def estimate(self, num_tokens):
        """Seconds of a step of num_tokens tokens, or None before any smaller or equal step was measured."""
        if num_tokens in self.seconds:
            return self.seconds[num_tokens]
        below = [t for t in self.seconds if t < num_tokens]
        if not below:
            return None
        t = max(below)
        return self.seconds[t] * (1 + EXTRA_TOKEN_SHARE * (num_tokens - t) / t)


def best_k(p, max_k, num_slots, times):
    """The number of drafts (0..max_k) of one slot of num_slots with the most expected tokens per second of
    the step; every one up to max_k while the step times are unknown."""
    base = times.estimate(num_slots) if times is not None else None
    if base is None:
        return max_k
    best, best_rate, expected, gain = 0, num_slots / base, num_slots, 1.0
    for k in range(1, max_k + 1):
        gain *= p
        expected += gain
        seconds = times.estimate(num_slots + k)
        if expected / seconds > best_rate:
            best, best_rate = k, expected / seconds
    return best if best_rate > (1 + MARGIN) * num_slots / base else 0
