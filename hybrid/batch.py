"""What one forward step computes: chunks of tokens from one or more sequences."""
from dataclasses import dataclass

import numpy as np


@dataclass
class SeqChunk:
    """Tokens of one sequence at positions [start, start + len(token_ids)), appended to `kv`."""

    kv: object  # SequenceKV
    start: int
    token_ids: np.ndarray  # int64 [n]
    logits: str = "last"  # which positions need logits: "last", "all" or "none"
    hidden: bool = False  # the forward pass returns this chunk's last hidden rows (an MTP drafter reads them)


class Batch:
    def __init__(self, chunks):
        self.chunks = chunks
        self.token_ids = np.concatenate([c.token_ids for c in chunks]).astype(np.int64)  # [T]
        self.positions = np.concatenate(
            [np.arange(c.start, c.start + len(c.token_ids), dtype=np.int64) for c in chunks])  # [T]
        offsets = np.cumsum([0] + [len(c.token_ids) for c in chunks])
        self.row_ranges = [(int(offsets[i]), int(offsets[i + 1])) for i in range(len(chunks))]
        rows = []
        for chunk, (lo, hi) in zip(chunks, self.row_ranges):
            if chunk.logits == "all":
                rows.extend(range(lo, hi))
            elif chunk.logits == "last":
                rows.append(hi - 1)
        self.logit_rows = np.asarray(rows, dtype=np.int64)  # [T_out]
        self.hidden_rows = np.asarray([r for chunk, (lo, hi) in zip(chunks, self.row_ranges) if chunk.hidden
                                       for r in range(lo, hi)], dtype=np.int64)  # [T_hidden]
        self.hidden = None  # set by the forward pass: float32 [T_hidden, H], the main stack's output before its norm

    @property
    def num_tokens(self):
        return len(self.token_ids)
