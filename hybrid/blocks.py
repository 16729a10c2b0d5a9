"""The layer's parts as steps over the backend ops, written once for every backend and family.

`layer_steps(recipe)` turns a LayerRecipe (hybrid/arch/recipe.py) into the steps of one layer. A step
reads and writes the layer's state `s` (a dict: the residual stream "x", the batch, the split, the
usage record and what earlier steps left) and says whether it may be captured in a graph: its launches
take no per-step host value and touch only arrays a region keeps (hybrid/runners.py GraphRunner).
A new part variant is a new entry in PART_STEPS (and one in each compiled runner's table).

Shape legend: T tokens in the batch, H hidden, Hq / Hkv query / kv heads, D head dim, K top-k.
"""
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .arch.recipe import FullAttention, MoE, SoftmaxTopK, SwiGLU
from .moe import expert_mixture


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable  # (backend, layer, s) -> None
    capturable: bool


def attention_inputs(backend, part, layer, h, positions):
    """h [T, H] (normed hidden) -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]): projected, head-normed, roped."""
    q, k, v, qk = backend.project_qkv(layer, h)  # qk: q and k as one view, or None
    if part.qk_norm:
        backend.rmsnorm_heads(q, layer.attn_q_norm, layer.eps)
        backend.rmsnorm_heads(k, layer.attn_k_norm, layer.eps)
    for x in (q, k) if qk is None else (qk,):
        backend.rope(x, positions, layer.rope_theta)
    return q, k, v


def attend(backend, layer, q, k, v, batch, out):
    """Appends k, v to each chunk's cache and writes q's attention over it into out [T, Hq, D]."""
    scale = 1.0 / np.sqrt(layer.head_dim)
    for chunk, (lo, hi) in zip(batch.chunks, batch.row_ranges):
        chunk.kv.write(layer.index, chunk.start, k[lo:hi], v[lo:hi])
        backend.attention(q[lo:hi], chunk.kv, layer.index, chunk.start, scale, out[lo:hi])


def full_attention_steps(part):
    """h -> y [T, H]: q, k, v (and the attention's output array), then the attention over the caches (it
    takes each chunk's start as a number), then the output projection."""
    if part.rope != "neox":
        return None

    def project(be, layer, s):
        q, k, v = attention_inputs(be, part, layer, s["h"], s["batch"].positions)
        s.update(q=q, k=k, v=v, att=be.empty(q.shape))  # att [T, Hq, D]: the attention's output

    def attention(be, layer, s):
        attend(be, layer, s["q"], s["k"], s["v"], s["batch"], s["att"])

    def output(be, layer, s):
        s["y"] = be.linear(layer.attn_output, s["att"].reshape(s["h"].shape[0], -1))

    return (Step("project", project, True), Step("attention", attention, False), Step("output", output, True))


def softmax_topk_steps(part):
    """h -> ids, weights [T, K]."""
    def route(be, layer, s):
        router_logits = be.linear(layer.router, s["h"])  # [T, E]
        s["ids"], s["weights"] = be.route(router_logits, layer.num_experts_per_tok, layer.norm_topk_prob)

    return (Step("route", route, True),)


def swiglu_steps(part):
    """(h, ids, weights) -> y [T, H]: through the expert split where there is one (it waits for the routing
    or hands it over, so never captured)."""
    def experts(be, layer, s):
        s["y"] = expert_mixture(be, layer, s["h"], s["ids"], s["weights"], s["split"], s["usage"])

    return (Step("experts", experts, False),)


def moe_steps(part):
    router, experts = _steps_of(part.router), _steps_of(part.experts)
    return None if router is None or experts is None else router + experts


PART_STEPS = {FullAttention: full_attention_steps, MoE: moe_steps, SoftmaxTopK: softmax_topk_steps,
              SwiGLU: swiglu_steps}


def _steps_of(part):
    make = PART_STEPS.get(type(part))
    return None if make is None else make(part)


def block_steps(block):
    """x += part(rmsnorm(x)): the norm, the part's steps, the residual add (captured where the part's last step
    is: its output then stays put)."""
    part = _steps_of(block.part)
    if part is None:
        return None

    def norm(be, layer, s):
        s["h"] = be.rmsnorm(s["x"], getattr(layer, block.norm), layer.eps)

    def residual(be, layer, s):
        be.add_into(s["x"], s["y"])

    return (Step("norm", norm, True),) + part + (Step("residual", residual, part[-1].capturable),)


def layer_steps(recipe):
    """The layer's steps in order, or None where a part has no implementation here."""
    blocks = [block_steps(block) for block in recipe.blocks]
    return None if any(b is None for b in blocks) else tuple(step for b in blocks for step in b)
