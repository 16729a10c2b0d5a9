"""The acceptance rule: which drafts a slot keeps after the verification pass, and the token after them.

For a deterministic drafter (n-gram, greedy MTP) speculative sampling reduces to: accept draft d with
probability p(d), else draw from p with d removed and renormalized. A token x is then emitted with
probability p(d)[x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x): the distribution of plain sampling.
Greedy (temperature 0) accepts d exactly when it is the argmax. p is the sampler's own distribution
(temperature, top-k, top-p, min-p over logits with the request's logit bias).
Shape legend: k drafts, V vocabulary.
"""
import numpy as np


def verify(sampler, rows, drafts):
    """rows: logits [k + 1, V] of the verification chunk (row i: the position after draft i - 1), drafts: k
    token ids -> (emitted tokens: the accepted drafts then one more, their adjusted logits rows [V] each)."""
    tokens, adjusted = [], []
    for row, draft in zip(rows, drafts):
        row = sampler.adjusted(row)  # [V]
        token = accept_or_replace(sampler, row, draft)
        tokens.append(token)
        adjusted.append(row)
        if token != draft:
            return tokens, adjusted
    row = sampler.adjusted(rows[len(drafts)])  # [V]
    tokens.append(sampler.draw(row))
    adjusted.append(row)
    return tokens, adjusted


def accept_or_replace(sampler, row, draft):
    """`draft` when accepted, else a token drawn from p without it: adjusted logits row [V] -> token id."""
    if sampler.greedy:
        return int(np.argmax(row))
    candidates, probs = sampler.distribution(row)  # [C], [C]
    hit = np.flatnonzero(candidates == draft)
    if hit.size:
        p_draft = probs[hit[0]]
        if sampler.rng.random() < p_draft:
            return int(draft)
        probs = probs.copy()
        probs[hit[0]] = 0.0
        probs /= probs.sum()  # > 0: p_draft < 1 here, since random() < 1
    return int(candidates[sampler.rng.choice(len(candidates), p=probs)])
