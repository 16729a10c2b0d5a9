"""Expert-usage recording: which experts each layer's router picks, for prefill and decode tokens.

The model calls `begin(batch)` once per forward step and `record(layer, ids)` after each layer's
routing; both are a few NumPy calls (bincount, add.at), so recording is always on when serving.
A step's chunk of one token is counted as decode, a longer chunk as prefill.
Shape legend: L layers, E experts, T tokens, K experts per token.
"""
import threading

import numpy as np


class ExpertUsage:
    def __init__(self, num_layers, num_experts, num_experts_per_tok):
        L, E = num_layers, num_experts
        self.num_layers, self.num_experts, self.num_experts_per_tok = L, E, num_experts_per_tok
        self.prefill = np.zeros((L, E), dtype=np.int64)
        self.decode = np.zeros((L, E), dtype=np.int64)
        self.coactivation = np.zeros((L, E, E), dtype=np.int64)  # symmetric, zero diagonal
        self.tokens_prefill = 0
        self.tokens_decode = 0
        self._decode_rows = np.zeros(0, dtype=bool)  # [T] of the current step
        self._pairs = np.triu_indices(num_experts_per_tok, k=1)  # the K*(K-1)/2 slot pairs of a token
        self._lock = threading.Lock()

    @classmethod
    def for_config(cls, config):
        return cls(config.num_layers, config.num_experts, config.num_experts_per_tok)

    def begin(self, batch):
        """Marks which rows of this step are decode tokens."""
        rows = [np.full(len(c.token_ids), len(c.token_ids) == 1) for c in batch.chunks]
        self._decode_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=bool)  # [T]
        num_decode = int(self._decode_rows.sum())
        with self._lock:
            self.tokens_decode += num_decode
            self.tokens_prefill += len(self._decode_rows) - num_decode

    def record(self, layer, ids):
        """ids int [T, K] (host array): the experts routed for each token of this step at `layer`."""
        self.record_rows(layer, ids, self._decode_rows)

    def record_rows(self, layer, ids, dec):
        """record() of a part of the step (a pipeline stage's slot group, hybrid/pipeline.py) whose rows are
        decode tokens where dec bool [T] says so."""
        ids = np.asarray(ids, dtype=np.int64)  # [T, K]
        E = self.num_experts
        if len(dec) != len(ids):
            raise ValueError(f"expert usage: {len(ids)} routed tokens at layer {layer}, "
                             f"the step has {len(dec)} (call begin(batch) first)")
        decode_counts = np.bincount(ids[dec].ravel(), minlength=E)  # [E]
        prefill_counts = np.bincount(ids[~dec].ravel(), minlength=E)  # [E]
        a, b = ids[:, self._pairs[0]].ravel(), ids[:, self._pairs[1]].ravel()  # [T * K(K-1)/2]
        with self._lock:
            self.decode[layer] += decode_counts
            self.prefill[layer] += prefill_counts
            np.add.at(self.coactivation[layer], (a, b), 1)
            np.add.at(self.coactivation[layer], (b, a), 1)

    def reset(self):
        with self._lock:
            for array in (self.prefill, self.decode, self.coactivation):
                array[...] = 0
            self.tokens_prefill = self.tokens_decode = 0

    def hit_rate(self, resident, phase="decode"):
        """Share of the recorded routings (of `phase`: decode, prefill or all) that went to a
        resident expert; resident bool [L, E]. None before any routing."""
        counts = {"decode": self.decode, "prefill": self.prefill, "all": self.decode + self.prefill}[phase]
        total = counts.sum()
        return None if total == 0 else float(counts[np.asarray(resident, dtype=bool)].sum() / total)

    def snapshot(self, resident=None):
        """A JSON-ready summary for /metrics and /slots: tokens seen, routings, and, given the
        resident mask bool [L, E] of the expert cache, its hit rates."""
        with self._lock:
            out = {"tokens_prefill": self.tokens_prefill, "tokens_decode": self.tokens_decode,
                   "routings_prefill": int(self.prefill.sum()), "routings_decode": int(self.decode.sum()),
                   "num_layers": self.num_layers, "num_experts": self.num_experts}
        if resident is not None:
            out["hit_rate_decode"] = self.hit_rate(resident, "decode")
            out["hit_rate_prefill"] = self.hit_rate(resident, "prefill")
        return out

    def to_profile(self, model_id, source="serve"):
        """The counts so far as a `placement.profile.ExpertProfile` (a copy)."""
        from placement.profile import ExpertProfile

        with self._lock:
            return ExpertProfile(model_id=model_id, num_experts_per_tok=self.num_experts_per_tok,
                                 prefill=self.prefill.copy(), decode=self.decode.copy(),
                                 coactivation=self.coactivation.copy(), tokens_prefill=self.tokens_prefill,
                                 tokens_decode=self.tokens_decode, sources=[source])
