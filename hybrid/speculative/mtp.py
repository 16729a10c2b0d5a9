"""Drafts from the model's own MTP / NextN layer (glm4moe's NextN, qwen3next / qwen35moe's MTP).

The layer predicts the token after next from the main stack's last hidden row h_p of position p (before
output_norm) and the token x_{p+1} that followed it:
    z = eh_proj([rmsnorm(embed(x_{p+1}), enorm); rmsnorm(h_p, hnorm)])       # [H, 2H] @ [2H]
    g = decoder_layer(z) at position p, over the layer's own KV                # the family's layer recipe
    logits = head(rmsnorm(g, shared_head_norm))                               # -> x_{p+2}
and chains: the next draft reads the drafted token and g (glm4moe, DeepSeek style) or rmsnorm(g,
shared_head_norm) (qwen3next / qwen35moe, as vLLM's Qwen3-Next MTP returns it). embed and head are the layer's
own where the file has them (nextn.embed_tokens, nextn.shared_head_head), else the model's.

`MtpHead`: the model's first NextN layer, run op by op on a host CPU backend (the model's own on the CPU,
else its hybrid host or a new one) over a KV pool of its own. `MtpDrafter`: one request's drafter (the
drafter interface of ngram.NgramDrafter, plus `add_hidden`): its own KV holds the layer's positions p whose
h_p and x_{p+1} are verified, each written once; the chained drafts' positions are dropped after each draft,
so a rollback of the main sequence needs nothing here (hidden rows of rejected positions are never read: they
are rewritten by the step that reads those positions again). The layer's positions count from the first
position with a hidden row (a prompt prefix restored from the conversation cache has none): RoPE attention
depends on position differences only.
Shape legend: n positions, H hidden, V vocab.
"""
import dataclasses
import logging

import numpy as np

from ..backends.cpu import CpuBackend
from ..batch import Batch, SeqChunk
from ..blocks import layer_steps
from ..weight_formats import dequantize

log = logging.getLogger(__name__)

CHAIN_NORMED = frozenset(("qwen3next", "qwen35moe"))  # families whose MTP layer chains on its normed output


def host_backend(model):
    """The CPU backend the MTP layer runs on: the model's, else its hybrid host, else a new one."""
    if isinstance(model.backend, CpuBackend):
        return model.backend
    return model.host if model.host is not None else CpuBackend()


class MtpHead:
    """The model's first NextN / MTP layer (the model must have one: `of` checks)."""

    def __init__(self, model, backend=None):
        c = model.config
        own = model.nextn_tensors[0]
        self.backend = backend or host_backend(model)
        self.eps, self.hidden_size, self.context = c.rms_norm_eps, c.hidden_size, c.context_length
        self.layer = dataclasses.replace(model.nextn_layers[0], kv_index=0)
        self.steps = layer_steps(model.spec.layer_recipe(c, c.num_layers))
        if self.steps is None:
            raise ValueError(f"no implementation of every part of {c.arch}'s MTP layer")
        self.eh_proj = own["eh_proj.weight"]  # [H, 2H]
        self.enorm, self.hnorm, self.head_norm = (np.ascontiguousarray(dequantize(own[f"{n}.weight"]))
                                                  for n in ("enorm", "hnorm", "shared_head_norm"))  # [H] each
        self.embed = own.get("embed_tokens.weight", model.token_embd)
        self.head = own.get("shared_head_head.weight", model.output)
        self.chain_normed = c.arch in CHAIN_NORMED
        self.pool = self.backend.new_kv_pool(1, c.num_kv_heads, c.head_dim, "f32", 4096)

    @classmethod
    def of(cls, model):
        """The model's MTP head, or None (logged) when its file has no NextN / MTP layer."""
        if not model.nextn_layers:
            log.warning("--mtp: the model has no MTP / NextN layer; drafts come from n-gram lookup")
            return None
        return cls(model)

    def new_sequence(self, max_tokens=None):
        return self.backend.new_kv(self.pool, max_tokens or self.context)

    def run(self, kv, start, token_ids, hidden):
        """The layer at positions [start, start + n) of `kv`: tokens x_{p+1} int [n], hidden rows h_p [n, H] ->
        (logits [V] of the last position, its chained hidden [1, H])."""
        be, eps = self.backend, self.eps
        batch = Batch([SeqChunk(kv, start, np.asarray(token_ids, dtype=np.int64), "last")])
        kv.reserve(start + len(token_ids))
        e = be.rmsnorm(be.embed(self.embed, batch.token_ids), self.enorm, eps)  # [n, H]
        h = be.rmsnorm(np.ascontiguousarray(hidden, dtype=np.float32), self.hnorm, eps)  # [n, H]
        x = be.linear(self.eh_proj, np.concatenate([e, h], axis=1))  # [n, H]
        s = {"x": x, "batch": batch, "split": None, "usage": None}
        for step in self.steps:
            step.run(be, self.layer, s)
        kv.commit(start + len(token_ids))
        last = np.ascontiguousarray(x[-1:])  # [1, H]
        normed = be.rmsnorm(last, self.head_norm, eps)  # [1, H]
        logits = be.linear(self.head, normed)[0]  # [V]
        return logits, normed if self.chain_normed else last


def _confidence(logits, token):
    """Softmax probability of `token` under logits [V]."""
    z = logits - logits.max()
    return float(np.exp(z[token]) / np.exp(z).sum())


class MtpDrafter:
    """One request's MTP drafts. extend(token_ids): the request's verified tokens (prompt, then output);
    add_hidden(start, rows): the main stack's hidden rows [n, H] of positions [start, start + n);
    draft(k, min_p): up to k greedy drafts while the product of their probabilities stays >= min_p.
    The layer reads each position as soon as its hidden row and next token are both known (a prompt's chunk by
    chunk), so the rows kept are the few still waiting for their next token."""

    needs_hidden = True

    def __init__(self, head, max_tokens=None):
        self.head = head
        self.kv = head.new_sequence(max_tokens)
        self.tokens = []
        self.offset = None  # the first position with a hidden row: the layer's position 0
        self.done = 0  # the layer's KV holds positions [offset, offset + done)
        self.rows = np.empty((0, head.hidden_size), dtype=np.float32)  # [cap, H]: rows of positions offset + done ..
        self.num_rows = 0  # ... offset + done + num_rows - 1
        self.newest = None  # (position, logits [V], chained hidden [1, H]) of the newest position read

    def extend(self, token_ids):
        self.tokens.extend(int(t) for t in token_ids)

    def add_hidden(self, start, rows):
        first = None if self.offset is None else self.offset + self.done  # the position of self.rows[0]
        if first is None or start > first + self.num_rows:  # first rows, or a gap: start over there
            self.offset, self.done, self.num_rows, first = start, 0, 0, start
            self.kv.truncate(0)
        if start < first:  # positions the layer has read
            rows, start = rows[first - start:], first
        end = start - first + len(rows)
        if end > len(self.rows):
            grown = np.empty((max(end, 2 * len(self.rows)), self.rows.shape[1]), dtype=np.float32)
            grown[:self.num_rows] = self.rows[:self.num_rows]
            self.rows = grown
        self.rows[start - first:end] = rows
        self.num_rows = end
        self._read(len(self.tokens) - 2)

    def _read(self, last):
        """Positions offset + done .. last (at most those with rows) through the layer; their rows go."""
        first = self.offset + self.done
        last = min(last, first + self.num_rows - 1)
        if last < first:
            return
        n = last + 1 - first
        logits, g = self.head.run(self.kv, self.done, self.tokens[first + 1:last + 2], self.rows[:n])
        self.newest = (last, logits, g)
        self.rows[:self.num_rows - n] = self.rows[n:self.num_rows].copy()
        self.num_rows -= n
        self.done += n

    def draft(self, k, min_p=0.0):
        last = len(self.tokens) - 2  # the newest position whose hidden row and next token are both verified
        if k <= 0 or self.offset is None:
            return []
        self._read(last)
        if self.newest is None or self.newest[0] != last:
            return []
        _, logits, g = self.newest
        out, confidence = [], 1.0
        while True:
            token = int(np.argmax(logits))
            confidence *= _confidence(logits, token)
            if confidence < min_p:
                break
            out.append(token)
            if len(out) == k:
                break
            logits, g = self.head.run(self.kv, self.done + len(out) - 1, [token], g)
        self.kv.truncate(self.done)  # the chained drafts' positions
        return out
