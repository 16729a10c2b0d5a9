"""Expert-usage recording: which experts each layer's router picks, for prefill and decode tokens.

The model runs each forward step inside `step(batch)` and calls `record(layer, ids)` after each layer's
routing. Within a step a decode-sized layer's record is kept and the step's layers are added together at
its end (one set of NumPy calls, bincount and add.at, for them all), so recording is always on when serving.
A step's chunk of one token is counted as decode, a longer chunk as prefill.
Shape legend: L layers, E experts, T tokens, K experts per token.
"""
import contextlib
import threading

import numpy as np


# Routings a layer (tokens x K) up to which a step's layers are added in one set of NumPy calls; above, a layer at a
# time, so that the scattered adds into the co-activations [L, E, E] stay within one layer's E x E (cache-sized).
GATHERED_ROUTINGS = 256


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
        self._held = None  # within step(): [(layer, ids int64 [T, K])] added at its end

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

    @contextlib.contextmanager
    def step(self, batch):
        """begin(batch); within, the records of decode-sized layers are held and added when it ends (whether
        or not the step failed: what it routed is counted, as with records added at once)."""
        self.begin(batch)
        self._held = []
        try:
            yield self
        finally:
            held, self._held = self._held, None
            if held:
                self._add(np.asarray([layer for layer, _ in held], dtype=np.int64),
                          np.stack([ids for _, ids in held]), self._decode_rows)

    def record(self, layer, ids):
        """ids int [T, K] (host array): the experts routed for each token of this step at `layer`."""
        if self._held is not None and np.size(ids) <= GATHERED_ROUTINGS:
            self._held.append((layer, np.array(ids, dtype=np.int64)))  # a copy: ids may be a reused buffer
            return
        self.record_rows(layer, ids, self._decode_rows)

    def record_rows(self, layer, ids, dec):
        """record() of a part of the step (a pipeline stage's slot group, hybrid/pipeline.py) whose rows are
        decode tokens where dec bool [T] says so."""
        self._add(np.asarray([layer], dtype=np.int64), np.asarray(ids, dtype=np.int64)[None], dec)

    def _add(self, layers, ids, dec):
        """layers int64 [L'], ids int64 [L', T, K], dec bool [T]: counts and co-activations added."""
        E = self.num_experts
        if len(dec) != ids.shape[1]:
            raise ValueError(f"expert usage: {ids.shape[1]} routed tokens at layer {int(layers[0])}, "
                             f"the step has {len(dec)} (call begin(batch) first)")
        flat = ids + (layers * E)[:, None, None]  # [L', T, K]: an index into [L, E]
        a, b = ids[:, :, self._pairs[0]], ids[:, :, self._pairs[1]]  # [L', T, K(K-1)/2]
        base = (layers * E * E)[:, None, None]
        both = np.concatenate(((base + a * E + b).ravel(), (base + b * E + a).ravel()))  # into [L, E, E]
        with self._lock:
            np.add.at(self.decode.reshape(-1), flat[:, dec].ravel(), 1)
            np.add.at(self.prefill.reshape(-1), flat[:, ~dec].ravel(), 1)
            np.add.at(self.coactivation.reshape(-1), both, 1)

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
