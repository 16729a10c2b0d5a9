"""Speculative decoding: a drafter proposes a few tokens per decoding slot, one batched forward pass scores
them as a short chunk of that slot, and the acceptance rule keeps what plain decoding would have produced.

- `SpecSettings`: the engine's settings (max drafts K, n-gram size, drafter confidence floor).
- `ngram.NgramDrafter`: prompt lookup over the slot's own prompt and output.
- `acceptance.verify`: the longest accepted prefix of the drafts plus one sampled token.
- `slot.SlotSpeculation`: one request's drafter, its adaptive K and its draft counters.
"""
from .settings import SpecSettings

__all__ = ["SpecSettings"]
