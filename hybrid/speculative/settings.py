"""The speculative-decoding settings the engine takes (from EngineConfig's spec, spec_ngram, spec_min_p, mtp)."""
from dataclasses import dataclass

DEFAULT_SPEC = 4
DEFAULT_NGRAM = 3
DEFAULT_MIN_P = 0.5


@dataclass(frozen=True)
class SpecSettings:
    """k: at most this many drafts per slot and step (0: off); ngram: the longest context the n-gram drafter
    matches; min_p: drafting stops where the drafter's confidence in the drafts so far falls below it; mtp: drafts
    from the model's MTP / NextN layer (mtp.py) where its file has one, instead of n-gram lookup."""

    k: int = DEFAULT_SPEC
    ngram: int = DEFAULT_NGRAM
    min_p: float = DEFAULT_MIN_P
    mtp: bool = False

    def __post_init__(self):
        if self.k < 0 or self.ngram < 1 or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"speculation: k must be >= 0, ngram >= 1 and min_p in [0, 1], got {self}")

    @property
    def enabled(self):
        return self.k > 0

    @classmethod
    def of(cls, config):
        """The settings of an EngineConfig (None when speculation is off)."""
        settings = cls(config.spec, config.spec_ngram, config.spec_min_p, config.mtp)
        return settings if settings.enabled else None
