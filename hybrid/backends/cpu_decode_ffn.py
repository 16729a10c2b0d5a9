"""Compiled decode parts of the feed-forward block beyond qwen3moe's (cpu_decode.py composes them): the sigmoid and
top-k-then-softmax routers, gpt-oss's clamped SwiGLU experts with their biases, the shared expert (optionally gated)
and a dense SwiGLU FFN (a MoE model's leading dense layers). The shared expert and the dense FFN are one function,
swiglu_ffn_template; each part runs the kernels the plain runner's backend ops run (hybrid/backends/cpu.py), with
the same serial / parallel choices.

`register()` adds them to cpu_decode.COMPILED_PARTS (cpu_layer.py calls it).

Shape legend: T tokens, H hidden, E experts, K top-k, N pairs, F expert / FFN width, G expert groups.
"""
import numpy as np
from numba import njit

from cpu_kernels import activation, routing

from ..arch.recipe import ClampedSwiGLU, DenseFFN, SharedExpert, SigmoidTopK, TopKSoftmax
from .cpu_decode import COMPILED_PARTS, Part, _linear_kernels, _rmsnorm, _small, expert_mixture, instance
from .cpu_thresholds import SERIAL_MAX_ELEMENTS, TINY_MAX_ELEMENTS

# -- routers: fn(logits [T, E], top_k, normalize, route_args, ids [T, K], weights [T, K], one_thread) ----------


@njit(nogil=True, cache=True)
def sigmoid_topk_route(logits, top_k, normalize, route_args, ids, weights, one_thread):
    """The SigmoidTopK router: route_args = (choice bias [E], groups, kept groups, routed scaling factor)."""
    bias, num_groups, topk_groups, scale = route_args
    if _small(logits.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        routing.route_sigmoid_topk_serial(logits, bias, top_k, num_groups, topk_groups, normalize, scale, ids, weights)
    else:
        routing.route_sigmoid_topk(logits, bias, top_k, num_groups, topk_groups, normalize, scale, ids, weights)


@njit(nogil=True, cache=True)
def topk_softmax_route(logits, top_k, normalize, route_args, ids, weights, one_thread):
    """The TopKSoftmax router: logits += route_args[0] (the router's bias [E]), their top k, softmax over those."""
    bias = route_args[0]
    for t in range(logits.shape[0]):
        for e in range(logits.shape[1]):
            logits[t, e] += bias[e]
    if _small(logits.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        routing.route_topk_softmax_serial(logits, top_k, ids, weights)
    else:
        routing.route_topk_softmax(logits, top_k, ids, weights)


# -- gpt-oss's experts: expert_mixture_template's ACTIVATE and DOWN_BIAS over glu_args ----------------------------

@njit(nogil=True, cache=True)
def _pair_experts(expert_ids, row_starts):
    """int64 [N]: each pair row's expert (rows row_starts[g]:row_starts[g + 1] are expert_ids[g]'s)."""
    out = np.empty(row_starts[row_starts.shape[0] - 1], dtype=np.int64)  # [N]
    for g in range(row_starts.shape[0] - 1):
        out[row_starts[g]:row_starts[g + 1]] = expert_ids[g]
    return out


@njit(nogil=True, cache=True)
def clamped_activate(gate, up, expert_ids, row_starts, glu_args, small):
    """gate [N, F] = ClampedSwiGLU(gate + gate_bias, up + up_bias); glu_args = (gate_bias [E, F], up_bias [E, F],
    down_bias [E, H], alpha, limit)."""
    gate_bias, up_bias, _, alpha, limit = glu_args
    pair_expert = _pair_experts(expert_ids, row_starts)
    if small:
        activation.clamped_swiglu_serial(gate, up, pair_expert, gate_bias, up_bias, alpha, limit, gate)
    else:
        activation.clamped_swiglu(gate, up, pair_expert, gate_bias, up_bias, alpha, limit, gate)


@njit(nogil=True, cache=True)
def clamped_down_bias(down, expert_ids, row_starts, glu_args, small):
    """down [N, H] += each pair row's expert's down bias."""
    pair_expert = _pair_experts(expert_ids, row_starts)
    if small:
        activation.add_pair_bias_serial(down, pair_expert, glu_args[2])
    else:
        activation.add_pair_bias(down, pair_expert, glu_args[2])


def make_clamped_swiglu(backend, layer, part):
    """(expert_mixture's instance, gate+up raws, down raws, names, glu_args)."""
    glu = layer.expert_glu
    made = expert_mixture(backend, layer, f"decode layer {layer.index}", activate=clamped_activate,
                          down_bias=clamped_down_bias, glu_name="clamped")
    return made + ((glu.gate_bias, glu.up_bias, glu.down_bias, float(part.alpha), float(part.limit)),)


# -- a dense SwiGLU FFN: the shared expert and the leading dense layers ------------------------------------------

def swiglu_ffn_template(h, one_thread, act_quant, args, out):
    """out [T, H] += down(silu(gate(h)) * up(h)) for h [T, H], times sigmoid(h @ gate_inp.T) per token where GATED
    (Qwen3-Next's shared expert gate, S_*). args: (gate, up, down, gate_inp raws, width F, hidden H, serial bool [4]:
    whether each weight is small enough for its serial kernel on one thread)."""
    g_raws, u_raws, d_raws, s_raws, width, hidden, serial = args
    num_tokens = h.shape[0]
    one_token_serial = num_tokens == 1 and one_thread
    one_expert = np.zeros(1, dtype=np.int64)  # [1]
    row_starts = np.array([0, num_tokens], dtype=np.int64)  # [2]
    gate = np.empty((num_tokens, width), dtype=np.float32)  # [T, F]
    up = np.empty((num_tokens, width), dtype=np.float32)  # [T, F]
    if one_token_serial and serial[0]:
        G_SER(g_raws, h, one_expert, row_starts, (gate,), act_quant)  # noqa: F821 (instance globals)
    else:
        G_PAR(g_raws, h, one_expert, row_starts, (gate,), act_quant)  # noqa: F821
    if one_token_serial and serial[1]:
        U_SER(u_raws, h, one_expert, row_starts, (up,), act_quant)  # noqa: F821
    else:
        U_PAR(u_raws, h, one_expert, row_starts, (up,), act_quant)  # noqa: F821
    act = np.empty((num_tokens, width), dtype=np.float32)  # [T, F]
    if _small(act.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        activation.swiglu_serial(gate, up, act)
    else:
        activation.swiglu(gate, up, act)
    y = np.empty((num_tokens, hidden), dtype=np.float32)  # [T, H]
    if one_token_serial and serial[2]:
        D_SER(d_raws, act, one_expert, row_starts, (y,), act_quant)  # noqa: F821
    else:
        D_PAR(d_raws, act, one_expert, row_starts, (y,), act_quant)  # noqa: F821
    if GATED:  # noqa: F821
        logit = np.empty((num_tokens, 1), dtype=np.float32)  # [T, 1]
        if one_token_serial and serial[3]:
            S_SER(s_raws, h, one_expert, row_starts, (logit,), act_quant)  # noqa: F821
        else:
            S_PAR(s_raws, h, one_expert, row_starts, (logit,), act_quant)  # noqa: F821
        for t in range(num_tokens):
            y[t] *= np.float32(1.0) / (np.float32(1.0) + np.exp(-logit[t, 0]))
    out += y


def swiglu_ffn(backend, layer, gate, up, down, gate_inp=None):
    """(swiglu_ffn_template's instance, its args, name) over the layer's weights gate, up, down (and gate_inp)."""
    keyed = (("G", gate), ("U", up), ("D", down), ("S", gate if gate_inp is None else gate_inp))
    kernels, raws, serial, names = _linear_kernels(backend, keyed)
    name = "_".join(names[:3] + ([names[3], "gated"] if gate_inp is not None else ["plain"]))
    fn = instance(swiglu_ffn_template, name, GATED=gate_inp is not None, **kernels)
    return fn, raws + (int(gate.shape[0]), int(down.shape[0]), serial), name


def make_shared_expert(backend, layer, part):
    """(the MoE's SHARED function, its args, name)."""
    return swiglu_ffn(backend, layer, layer.gate_shexp, layer.up_shexp, layer.down_shexp,
                      layer.shexp_gate if part.gated else None)


def dense_ffn_template(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, args):
    """The DenseFFN block: x += FFN(rmsnorm(x)) (FFN: swiglu_ffn_template's instance); no routing ([T, 0] ids)."""
    norm, eps, ffn_args = args
    _rmsnorm(x, norm, eps, h, one_thread)
    y = np.zeros_like(x)  # [T, H]
    FFN(h, one_thread, act_quant, ffn_args, y)  # noqa: F821
    x += y
    return np.empty((x.shape[0], 0), dtype=np.int64)


def make_dense_ffn(backend, layer, block):
    ffn, ffn_args, name = swiglu_ffn(backend, layer, layer.ffn_gate, layer.ffn_up, layer.ffn_down)
    fn = instance(dense_ffn_template, name, FFN=ffn)
    return fn, (getattr(layer, block.norm), float(layer.eps), ffn_args), "dense_" + name


def _make_sigmoid_route(backend, layer, part):
    args = (layer.router_choice_bias, int(part.num_groups), int(part.topk_groups), float(part.scale))
    return sigmoid_topk_route, args, "sigmoid"


def register():
    """Adds these parts to cpu_decode.COMPILED_PARTS."""
    COMPILED_PARTS.update({
        SigmoidTopK: Part(takes=lambda part: True, make=_make_sigmoid_route),
        TopKSoftmax: Part(takes=lambda part: True,
                          make=lambda backend, layer, part: (topk_softmax_route, (layer.router_bias,), "topksoftmax")),
        ClampedSwiGLU: Part(takes=lambda part: True, make=make_clamped_swiglu),
        SharedExpert: Part(takes=lambda part: True, make=make_shared_expert),
        DenseFFN: Part(takes=lambda part: True, make=make_dense_ffn),
    })
