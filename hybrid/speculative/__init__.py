"""Speculative decoding: a drafter proposes a few tokens per decoding slot, one batched forward pass scores
them as a short chunk of that slot, and the acceptance rule keeps what plain decoding would have produced.

- `SpecSettings`: the engine's settings (max drafts K, n-gram size, drafter confidence floor).
- `ngram.NgramDrafter`: prompt lookup over the slot's own prompt and output.
- `mtp.MtpDrafter`: the model's own MTP / NextN layer (`mtp.MtpHead`), from the main stack's hidden rows.
- `acceptance.verify`: the longest accepted prefix of the drafts plus one sampled token.
- `policy`: how many drafts pay, from a slot's acceptance estimate and the measured step times.
- `slot.SlotSpeculation`: one request's drafter, its acceptance estimate and its draft counters.

The engine (hybrid/engine.py `_verify`) emits the kept tokens and rolls the slot's sequence back past the
rejected ones (`SequenceKV.rollback`); the scheduler puts the drafts in the slot's decode chunk.
"""
from .settings import SpecSettings

__all__ = ["SpecSettings"]
