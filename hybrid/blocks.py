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

from .arch.recipe import (ClampedSwiGLU, DenseFFN, FullAttention, GatedAttention, LinearAttention, MoE, SharedExpert,
                          SigmoidTopK, SoftmaxTopK, SwiGLU, TopKSoftmax)
from .linear_attention import gated_attention_inputs, linear_attention
from .moe import expert_mixture


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable  # (backend, layer, s) -> None
    capturable: bool
    step_graph: bool = False  # not capturable alone, but may run inside a whole-step graph (hybrid/runners.py:
    # its per-step numbers are read on the device there, and nothing waits for the host)
    norm: str = None  # a block's norm step: the layer's attribute of its weight (a step graph fuses the residual
    # add before it into it: carry_residual)


def attention_inputs(backend, part, layer, h, positions):
    """h [T, H] (normed hidden) -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]): projected, head-normed, roped."""
    q, k, v, qk = backend.project_qkv(layer, h)  # qk: q and k as one view, or None
    if part.qkv_bias:
        for x, bias in ((q, layer.attn_q_bias), (k, layer.attn_k_bias), (v, layer.attn_v_bias)):
            backend.add_bias(x.reshape(x.shape[0], -1), bias)
    if part.qk_norm and backend.capabilities.fused_norms:
        backend.qk_norm_rope(q, k, qk, layer, positions)
        return q, k, v
    if part.qk_norm:
        backend.rmsnorm_heads(q, layer.attn_q_norm, layer.eps)
        backend.rmsnorm_heads(k, layer.attn_k_norm, layer.eps)
    for x in (q, k) if qk is None else (qk,):
        backend.rope(x, positions, layer.rope_freqs, layer.rope_scale)  # the first 2 * len(rope_freqs) dims
    return q, k, v


def attend(backend, layer, q, k, v, batch, out, window=0, sinks=None):
    """Appends k, v to each chunk's cache and writes q's attention over it into out [T, Hq, D] (the last `window`
    positions only where it is > 0; with the heads' sink logits sinks [Hq] where given)."""
    scale = 1.0 / np.sqrt(layer.head_dim)
    if len(batch.chunks) > 1 and backend.capabilities.step_graph and backend.attend_step(
            layer.kv_index, q, k, v, batch, scale, out, window, sinks):  # several users' tokens, one launch each
        return
    for chunk, (lo, hi) in zip(batch.chunks, batch.row_ranges):
        chunk.kv.write(layer.kv_index, chunk.start, k[lo:hi], v[lo:hi])
        backend.attention(q[lo:hi], chunk.kv, layer.kv_index, chunk.start, scale, out[lo:hi], window, sinks)


def full_attention_steps(part):
    """h -> y [T, H]: q, k, v (and the attention's output array), then the attention over the caches (it
    takes each chunk's start as a number), then the output projection."""
    if part.rope not in ("neox", "yarn"):
        return None

    def project(be, layer, s):
        q, k, v = attention_inputs(be, part, layer, s["h"], s["batch"].positions)
        s.update(q=q, k=k, v=v, att=be.empty(q.shape))  # att [T, Hq, D]: the attention's output

    def attention(be, layer, s):
        attend(be, layer, s["q"], s["k"], s["v"], s["batch"], s["att"], part.window,
               layer.attn_sinks if part.sinks else None)

    def output(be, layer, s):
        s["y"] = be.linear(layer.attn_output, s["att"].reshape(s["h"].shape[0], -1))
        if part.o_bias:
            be.add_bias(s["y"], layer.attn_output_bias)

    return (Step("project", project, True), Step("attention", attention, False, step_graph=True),
            Step("output", output, True))


def softmax_topk_steps(part):
    """h -> ids, weights [T, K]."""
    def route(be, layer, s):
        router_logits = be.linear(layer.router, s["h"])  # [T, E]
        s["ids"], s["weights"] = be.route(router_logits, layer.num_experts_per_tok, layer.norm_topk_prob)

    return (Step("route", route, True),)


def sigmoid_topk_steps(part):
    """h -> ids, weights [T, K]: sigmoid scores, the choice biased and group-limited, the weights unbiased."""
    def route(be, layer, s):
        router_logits = be.linear(layer.router, s["h"])  # [T, E]
        s["ids"], s["weights"] = be.route_sigmoid(router_logits, layer.router_choice_bias, layer.num_experts_per_tok,
                                                  part.num_groups, part.topk_groups, layer.norm_topk_prob, part.scale)

    return (Step("route", route, True),)


def topk_softmax_steps(part):
    """h -> ids, weights [T, K]: the biased logits' top k, softmax over those k."""
    def route(be, layer, s):
        router_logits = be.linear(layer.router, s["h"])  # [T, E]
        be.add_bias(router_logits, layer.router_bias)
        s["ids"], s["weights"] = be.route_topk_softmax(router_logits, layer.num_experts_per_tok)

    return (Step("route", route, True),)


def swiglu_ffn(be, h, gate, up, down):
    """down(silu(gate(h)) * up(h)) [T, H] for h [T, H]: a dense SwiGLU through the backend's ops."""
    return be.linear(down, be.silu_mul(be.linear(gate, h), be.linear(up, h)))


def shared_expert_steps(part):
    """h -> shared [T, H], the shared expert of every token (queued before the routed experts: with a split, the
    device runs it while the host runs its experts); added to the mixture by moe_steps' last step."""
    def shared(be, layer, s):
        s["shared"] = swiglu_ffn(be, s["h"], layer.gate_shexp, layer.up_shexp, layer.down_shexp)
        if part.gated:  # times sigmoid(h @ shexp_gate.T) per token
            be.sigmoid_mul(s["shared"], be.linear(layer.shexp_gate, s["h"]))

    return (Step("shared_expert", shared, True),)


def _add_shared(be, layer, s):
    be.add_into(s["y"], s["shared"])


def dense_ffn_steps(part):
    """h -> y [T, H]: a dense layer's SwiGLU FFN."""
    def ffn(be, layer, s):
        s["y"] = swiglu_ffn(be, s["h"], layer.ffn_gate, layer.ffn_up, layer.ffn_down)

    return (Step("dense_ffn", ffn, True),)


def swiglu_steps(part):
    """(h, ids, weights) -> y [T, H]: through the expert split where there is one (it waits for the routing
    or hands it over, so never captured). SwiGLU and ClampedSwiGLU alike: a layer's expert_glu (its clamp and
    biases, or None) says which activation the backends run."""
    def experts(be, layer, s):
        s["y"] = expert_mixture(be, layer, s["h"], s["ids"], s["weights"], s["split"], s["usage"])

    return (Step("experts", experts, False, step_graph=True),)


def moe_steps(part):
    """The router's steps, the shared expert's, the experts', then the shared expert's output added to theirs (not
    captured: the experts' y is a new array each step)."""
    parts = [_steps_of(p) for p in (part.router, part.shared, part.experts) if p is not None]
    if any(p is None for p in parts):
        return None
    add = (Step("add_shared", _add_shared, False, step_graph=True),) if part.shared is not None else ()
    return sum(parts, ()) + add


def gated_attention_steps(part):
    """h -> y [T, H]: Qwen3-Next's full attention (hybrid/linear_attention.py): q, its gate, k, v; the attention over
    the caches; the output gated, then projected."""
    def project(be, layer, s):
        q, k, v, gate = gated_attention_inputs(be, layer, s["h"], s["batch"].positions)
        s.update(q=q, k=k, v=v, gate=gate, att=be.empty(q.shape))

    def attention(be, layer, s):
        attend(be, layer, s["q"], s["k"], s["v"], s["batch"], s["att"])

    def output(be, layer, s):
        att = s["att"].reshape(s["h"].shape[0], -1)
        be.sigmoid_mul(att, s["gate"].reshape(att.shape))
        s["y"] = be.linear(layer.attn_output, att)

    return (Step("project", project, False), Step("attention", attention, False), Step("output", output, False))


def linear_attention_steps(part):
    """h -> y [T, H]: Gated DeltaNet over each sequence's recurrent state (hybrid/linear_attention.py)."""
    return (Step("linear_attention", lambda be, layer, s: linear_attention(be, part, layer, s), False),)


PART_STEPS = {GatedAttention: gated_attention_steps, LinearAttention: linear_attention_steps,
              FullAttention: full_attention_steps, MoE: moe_steps, SoftmaxTopK: softmax_topk_steps,
              SigmoidTopK: sigmoid_topk_steps, SwiGLU: swiglu_steps, SharedExpert: shared_expert_steps,
              DenseFFN: dense_ffn_steps, TopKSoftmax: topk_softmax_steps, ClampedSwiGLU: swiglu_steps}


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

    return (Step("norm", norm, True, norm=block.norm),) + part + (
        Step("residual", residual, part[-1].capturable, step_graph=True),)


def carries_residual(steps, next_steps, backend):
    """Whether a layer's last step, its residual add, may be left to the next layer's first, its norm, as one
    add_rmsnorm launch (a whole-step graph, where both run in one capture: carry_residual)."""
    return (backend.capabilities.fused_norms and steps[-1].name == "residual" and bool(next_steps)
            and next_steps[0].norm is not None)


def carry_residual(be, layer, s, y, norm_step):
    """The last layer's residual add (its y [T, H]) and this layer's first norm in one launch: x += y, h = norm(x)."""
    s["h"] = be.add_rmsnorm(s["x"], y, getattr(layer, norm_step.norm), layer.eps)


def residual_norm_step(residual, block):
    """A block's residual add and the next block's norm as one step, one launch where the backend fuses them
    (Capabilities.fused_norms). Only for a captured residual: h, a new array each run, then stays in its region."""

    def residual_norm(be, layer, s):
        if be.capabilities.fused_norms:
            s["h"] = be.add_rmsnorm(s["x"], s["y"], getattr(layer, block.norm), layer.eps)
            return
        residual.run(be, layer, s)
        s["h"] = be.rmsnorm(s["x"], getattr(layer, block.norm), layer.eps)

    return Step("residual_norm", residual_norm, True, step_graph=True)


def layer_steps(recipe):
    """The layer's steps in order, or None where a part has no implementation here. A captured residual add and the
    next block's norm are one step."""
    blocks = [block_steps(block) for block in recipe.blocks]
    if any(b is None for b in blocks):
        return None
    steps = list(blocks[0])
    for block, block_of_steps in zip(recipe.blocks[1:], blocks[1:]):
        if steps[-1].capturable:
            steps[-1:] = [residual_norm_step(steps[-1], block)] + list(block_of_steps[1:])
        else:
            steps.extend(block_of_steps)
    return tuple(steps)
