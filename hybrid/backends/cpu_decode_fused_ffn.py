"""The fused decode layer's feed-forward parts (cpu_decode_fused.py runs them in its one parallel region).

One worker, ffn_worker_template, runs every feed-forward block the fused layer takes, in the layer's last four
stages (router, gate+up, down, combine):
- a MoE block (ROUTED): router logits by items; then each thread routes by itself (ROUTE: softmax top-k, the
  sigmoid router with its choice bias and groups, or top-k then softmax over the logits plus a bias), groups the
  pairs, runs its share of the experts' gate+up and down items, and the activation (ACTIVATE: SwiGLU, or gpt-oss's
  clamped SwiGLU with the experts' gate / up biases) of every pair; DOWN_BIAS adds the experts' down biases in the
  combine, by column ranges;
- a dense SwiGLU FFN beside it or alone (SHARED): a MoE's shared expert, or a leading dense layer's FFN, its gate,
  up and down items in the same stages as the experts', added to the mixture in the combine.
Each op runs the kernels the compiled layer (cpu_decode.py, cpu_decode_ffn.py) runs, on the same inputs and in the
same order of float operations, so the fused layer's output equals the compiled one's bit for bit.

`register()` adds MoE and DenseFFN to cpu_decode_fused.FUSED_FFNS (cpu_layer.py calls it).

Shape legend: T tokens, H hidden, E experts, K top-k, N pairs (T * K), F expert width, S the dense FFN's width,
W workers.
"""
import numpy as np
from numba import njit

from cpu_kernels import activation, moe_combine, rmsnorm, routing, sync

from ..arch.recipe import ClampedSwiGLU, DenseFFN, MoE, SharedExpert, SigmoidTopK, SoftmaxTopK, SwiGLU, TopKSoftmax
from .cpu_decode import instance
from .cpu_decode_fused import (COMBINE, COMBINE_COLUMNS, DOWN, FUSED_FFNS, GATE_UP, MOE_STAGES, ROUTER, FusedPart,
                               _add_columns, _f32, _i64, _parts)

NO_BIAS = np.zeros((1, 1), dtype=np.float32)  # the down bias of experts without one


# -- routers: fn(logits [T, E], scratch [T, E], top_k, normalize, route_args, ids [T, K], weights [T, K]) -------
# (each thread routes by itself from the shared logits: a router that changes its logits works on `scratch`)

@njit(nogil=True, cache=True)
def softmax_route(logits, scratch, top_k, normalize, route_args, ids, weights):
    routing.route_softmax_topk_serial(logits, top_k, normalize, ids, weights)


@njit(nogil=True, cache=True)
def sigmoid_route(logits, scratch, top_k, normalize, route_args, ids, weights):
    """route_args = (choice bias [E], groups, kept groups, routed scaling factor)."""
    bias, num_groups, topk_groups, scale = route_args
    routing.route_sigmoid_topk_serial(logits, bias, top_k, num_groups, topk_groups, normalize, scale, ids, weights)


@njit(nogil=True, cache=True)
def topk_softmax_route(logits, scratch, top_k, normalize, route_args, ids, weights):
    """route_args = (the router's bias [E],): scratch = logits + bias, its top k, the softmax over those."""
    bias = route_args[0]
    for t in range(logits.shape[0]):
        for e in range(logits.shape[1]):
            scratch[t, e] = logits[t, e] + bias[e]
    routing.route_topk_softmax_serial(scratch, top_k, ids, weights)


# -- expert activations: fn(gate, up [N, F], pair_expert int64 [N], glu_args, out [N, F]) ------------------------

@njit(nogil=True, cache=True)
def swiglu_act(gate, up, pair_expert, glu_args, out):
    activation.swiglu_serial(gate, up, out)


@njit(nogil=True, cache=True)
def clamped_act(gate, up, pair_expert, glu_args, out):
    """glu_args = (gate_bias [E, F], up_bias [E, F], down_bias [E, H], alpha, limit). In place on a copy of gate, as
    the compiled layer runs it (written elsewhere, the kernel's loop compiles to other roundings)."""
    gate_bias, up_bias, _, alpha, limit = glu_args
    out[:] = gate
    activation.clamped_swiglu_serial(out, up, pair_expert, gate_bias, up_bias, alpha, limit, out)


# -- the worker -------------------------------------------------------------------------------------------------

@njit(nogil=True)
def _pair_experts(expert_ids, pair_starts, out):
    """out [N]: each pair row's expert (rows pair_starts[g]:pair_starts[g + 1] are expert_ids[g]'s)."""
    for g in range(pair_starts.shape[0] - 1):
        out[pair_starts[g]:pair_starts[g + 1]] = expert_ids[g]


@njit(nogil=True)
def _add_down_bias(down, pair_expert, down_bias, c0, c1):
    """down[:, c0:c1] += each pair row's expert's down bias (activation.add_pair_bias over those columns)."""
    for i in range(down.shape[0]):
        for c in range(c0, c1):
            down[i, c] += down_bias[pair_expert[i], c]


@njit(fastmath=True, nogil=True)
def _combine_columns(down, row_of_pair, weights, top_k, shared, c0, c1, moe):
    """moe[:, c0:c1] (zero) = the weighted pair rows of down, then + shared (where it has columns), in the order
    the compiled layer sums them."""
    for t in range(moe.shape[0]):
        for j in range(top_k):
            i = row_of_pair[t * top_k + j]
            if i < 0:
                continue
            w = weights[t, j]
            for c in range(c0, c1):
                moe[t, c] += w * down[i, c]
    if shared.shape[1]:
        for t in range(moe.shape[0]):
            for c in range(c0, c1):
                moe[t, c] += shared[t, c]


@njit(nogil=True)
def _rows_of_pairs(order, rows):
    """rows [T*K]: the row of each flat pair in `order`, -1 where it has none."""
    rows[:] = -1
    for r in range(order.size):
        rows[order[r]] = r


def ffn_worker_template(w, num_workers, x, y, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,
                        counters, first, one_expert, row_starts, work, args, ids_out, t):
    """Worker w's share of the feed-forward part, the layer's last: x2 = x + y (the mixer's output) and its norm
    stay on each thread; its stages (from stage `first`) route, run the experts and the dense FFN, and write
    x = x2 + their sum by column ranges; ids_out [T, K] gets the routing."""
    (ffn_norm, eps, r_raws, g_raws, u_raws, d_raws, top_k, normalize, route_args, glu_args, down_bias, sg_raws,
     su_raws, sd_raws) = args
    (logits, gate, up, down, moe, s_gate, s_up, s_down, x2_of, h2_of, ids_of, weights_of, xs_of, act_of, rows_of,
     scratch_of, experts_of, s_act_of) = work
    num_tokens, hidden = x.shape
    x2, h2 = x2_of[w], h2_of[w]  # [T, H] each
    _add_columns(x, y, 0, hidden, x2)
    rmsnorm.rmsnorm_serial(x2, ffn_norm, eps, h2)
    # router logits
    nr = 0
    if ROUTED:  # noqa: F821 (instance globals)
        r_items, r_prep = R_PREP(r_raws, h2, one_expert, row_starts, act_quant)  # noqa: F821
        nr = r_items.shape[0]
    done = 0
    t = sync.mark(trace, w, 3 * (first + ROUTER), t)
    i, tried = sync.take(counters, first + ROUTER, w, num_workers, nr, 0)
    while i < nr:
        if ROUTED:  # noqa: F821
            R_ITEM(r_raws, h2, r_items, r_prep, (logits,), i, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, first + ROUTER, w, num_workers, nr, tried)
    t = sync.mark(trace, w, 3 * (first + ROUTER) + 1, t)
    sync.finish(counters, first + ROUTER, num_workers, done, nr)
    t = sync.mark(trace, w, 3 * (first + ROUTER) + 2, t)
    # gate+up: each thread routes, groups and rounds the pair rows itself; the dense FFN's items after the experts'
    ids, weights = ids_of[w], weights_of[w]  # [T, K] each
    n_gu = 0
    if ROUTED:  # noqa: F821
        ROUTE(logits, scratch_of[w], top_k, normalize, route_args, ids, weights)  # noqa: F821
        order, expert_ids, pair_starts = routing.group_by_expert(ids, logits.shape[1])
        xs = xs_of[w]  # [N, H]
        moe_combine.gather_rows_serial(h2, order, top_k, xs)
        g_items, g_prep = G_PREP(g_raws, xs, expert_ids, pair_starts, act_quant)  # noqa: F821
        if GU_PAIRED:  # noqa: F821: one prepare, the items over both weights
            gu_raws = g_raws + u_raws
            n_gu = 2 * g_items.shape[0]
        else:
            u_items, u_prep = U_PREP(u_raws, xs, expert_ids, pair_starts, act_quant)  # noqa: F821
            n_gu = g_items.shape[0] + u_items.shape[0]
    n_s = 0
    if SHARED:  # noqa: F821
        sg_items, sg_prep = SG_PREP(sg_raws, h2, one_expert, row_starts, act_quant)  # noqa: F821
        su_items, su_prep = SU_PREP(su_raws, h2, one_expert, row_starts, act_quant)  # noqa: F821
        n_s = sg_items.shape[0] + su_items.shape[0]
    done = 0
    t = sync.mark(trace, w, 3 * (first + GATE_UP), t)
    i, tried = sync.take(counters, first + GATE_UP, w, num_workers, n_gu + n_s, 0)
    while i < n_gu + n_s:
        if i >= n_gu:  # (each flag's branch is compiled only where the flag is on)
            if SHARED:  # noqa: F821
                if i - n_gu < sg_items.shape[0]:
                    SG_ITEM(sg_raws, h2, sg_items, sg_prep, (s_gate,), i - n_gu, act_quant)  # noqa: F821
                else:
                    SU_ITEM(su_raws, h2, su_items, su_prep, (s_up,), i - n_gu - sg_items.shape[0],  # noqa: F821
                            act_quant)
        elif ROUTED:  # noqa: F821
            if GU_PAIRED:  # noqa: F821
                G_ITEM(gu_raws, xs, g_items, g_prep, (gate, up), i, act_quant)  # noqa: F821
            elif i < g_items.shape[0]:
                G_ITEM(g_raws, xs, g_items, g_prep, (gate,), i, act_quant)  # noqa: F821
            else:
                U_ITEM(u_raws, xs, u_items, u_prep, (up,), i - g_items.shape[0], act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, first + GATE_UP, w, num_workers, n_gu + n_s, tried)
    t = sync.mark(trace, w, 3 * (first + GATE_UP) + 1, t)
    sync.finish(counters, first + GATE_UP, num_workers, done, n_gu + n_s)
    t = sync.mark(trace, w, 3 * (first + GATE_UP) + 2, t)
    # down: each thread runs the activations itself
    pair_expert = experts_of[w]  # [N]
    nd = 0
    if ROUTED:  # noqa: F821
        act = act_of[w]  # [N, F]
        _pair_experts(expert_ids, pair_starts, pair_expert)
        ACTIVATE(gate, up, pair_expert, glu_args, act)  # noqa: F821
        d_items, d_prep = D_PREP(d_raws, act, expert_ids, pair_starts, act_quant)  # noqa: F821
        nd = d_items.shape[0]
    nsd = 0
    if SHARED:  # noqa: F821
        s_act = s_act_of[w]  # [T, S]
        activation.swiglu_serial(s_gate, s_up, s_act)
        sd_items, sd_prep = SD_PREP(sd_raws, s_act, one_expert, row_starts, act_quant)  # noqa: F821
        nsd = sd_items.shape[0]
    done = 0
    t = sync.mark(trace, w, 3 * (first + DOWN), t)
    i, tried = sync.take(counters, first + DOWN, w, num_workers, nd + nsd, 0)
    while i < nd + nsd:
        if i < nd:
            if ROUTED:  # noqa: F821
                D_ITEM(d_raws, act, d_items, d_prep, (down,), i, act_quant)  # noqa: F821
        elif SHARED:  # noqa: F821
            SD_ITEM(sd_raws, s_act, sd_items, sd_prep, (s_down,), i - nd, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, first + DOWN, w, num_workers, nd + nsd, tried)
    t = sync.mark(trace, w, 3 * (first + DOWN) + 1, t)
    sync.finish(counters, first + DOWN, num_workers, done, nd + nsd)
    t = sync.mark(trace, w, 3 * (first + DOWN) + 2, t)
    # combine: column ranges of x, each from this thread's x + o and the weighted pair rows
    row_of_pair = rows_of[w]  # [T*K]
    if ROUTED:  # noqa: F821
        _rows_of_pairs(order, row_of_pair)
    num_chunks = (hidden + COMBINE_COLUMNS - 1) // COMBINE_COLUMNS
    t = sync.mark(trace, w, 3 * (first + COMBINE), t)
    i, tried = sync.take(counters, first + COMBINE, w, num_workers, num_chunks, 0)
    while i < num_chunks:
        if i == 0:
            ids_out[:] = ids
        c0, c1 = i * COMBINE_COLUMNS, min(hidden, (i + 1) * COMBINE_COLUMNS)
        if DOWN_BIAS:  # noqa: F821
            _add_down_bias(down, pair_expert, down_bias, c0, c1)
        _combine_columns(down, row_of_pair, weights, top_k, s_down, c0, c1, moe)
        _add_columns(x2, moe, c0, c1, x)
        i, tried = sync.take(counters, first + COMBINE, w, num_workers, num_chunks, tried)
    t = sync.mark(trace, w, 3 * (first + COMBINE) + 1, t)
    return t


@njit(nogil=True)
def ffn_prologue(positions, work, args):
    """The feed-forward part's serial work before the region: the sum zeroed; returns the routing's array [T, K]."""
    work[4][:] = 0.0
    return np.empty((positions.shape[0], args[6]), dtype=np.int64)


# -- per layer --------------------------------------------------------------------------------------------------

def _dense_weights(layer, part):
    """(gate, up, down) of the block's dense FFN (a MoE's shared expert, a DenseFFN's), or None."""
    if isinstance(part, DenseFFN):
        return layer.ffn_gate, layer.ffn_up, layer.ffn_down
    if part.shared is not None:
        return layer.gate_shexp, layer.up_shexp, layer.down_shexp
    return None


def new_ffn_work(layer, part, num_tokens, num_workers):
    """The feed-forward part's arrays (see the legend; a part without experts or without a dense FFN gets empty
    ones in their place)."""
    hidden = layer.attn_output.shape[0]
    routed = isinstance(part, MoE)
    num_experts, width = (layer.gate_exps.shape[0], layer.gate_exps.shape[1]) if routed else (1, 0)
    top_k = layer.num_experts_per_tok if routed else 0
    dense = _dense_weights(layer, part)
    s_width = dense[0].shape[0] if dense is not None else 0
    pairs = num_tokens * top_k
    return (_f32(num_tokens, num_experts),  # router logits
            _f32(pairs, width), _f32(pairs, width), _f32(pairs, hidden),  # gate, up, down
            _f32(num_tokens, hidden),  # moe: the sum
            _f32(num_tokens, s_width), _f32(num_tokens, s_width),  # the dense FFN's gate, up
            _f32(num_tokens, hidden if dense is not None else 0),  # its down
            # per worker
            _f32(num_workers, num_tokens, hidden), _f32(num_workers, num_tokens, hidden),  # x2, h2
            _i64(num_workers, num_tokens, top_k), _f32(num_workers, num_tokens, top_k),  # ids, weights
            _f32(num_workers, pairs, hidden), _f32(num_workers, pairs, width),  # xs, act
            _i64(num_workers, pairs),  # rows
            _f32(num_workers, num_tokens, num_experts), _i64(num_workers, pairs),  # router scratch, pair experts
            _f32(num_workers, num_tokens, s_width))  # the dense FFN's activation


ROUTERS = {SoftmaxTopK: (softmax_route, "softmax"), SigmoidTopK: (sigmoid_route, "sigmoid"),
           TopKSoftmax: (topk_softmax_route, "topksoftmax")}


def _route_args(layer, router):
    if isinstance(router, SigmoidTopK):
        return (layer.router_choice_bias, int(router.num_groups), int(router.topk_groups), float(router.scale))
    if isinstance(router, TopKSoftmax):
        return (layer.router_bias,)
    return ()


def fused_ffn(backend, layer, block):
    """(worker instance, prologue, arguments, name, stages) of a MoE or DenseFFN feed-forward block."""
    part = block.part
    routed = isinstance(part, MoE)
    dense = _dense_weights(layer, part)
    experts = (layer.router, layer.gate_exps, layer.up_exps, layer.down_exps) if routed else dense[:1] * 4
    shared = dense if dense is not None else experts[1:]  # (never run without SHARED: the experts' kernels type it)
    keyed = tuple(zip(("R", "G", "U", "D", "SG", "SU", "SD"), experts + shared))
    kernels, raws, names = _parts(backend, keyed)
    flags = dict(ROUTED=routed, SHARED=dense is not None, GU_PAIRED=False, DOWN_BIAS=False)
    route, route_name, glu_args, down_bias, act, act_name = softmax_route, "dense", (), NO_BIAS, swiglu_act, "swiglu"
    top_k, normalize = 0, False
    if routed:
        gate, up = layer.gate_exps, layer.up_exps
        flags["GU_PAIRED"] = (up.qtype == gate.qtype and up.raw.shape == gate.raw.shape
                              and up.raw.flags.writeable == gate.raw.flags.writeable)
        route, route_name = ROUTERS[type(part.router)]
        top_k, normalize = layer.num_experts_per_tok, bool(layer.norm_topk_prob)
        if isinstance(part.experts, ClampedSwiGLU):
            glu = layer.expert_glu
            glu_args = (glu.gate_bias, glu.up_bias, glu.down_bias, float(part.experts.alpha), float(part.experts.limit))
            down_bias, act, act_name, flags["DOWN_BIAS"] = glu.down_bias, clamped_act, "clamped", True
    route_args = _route_args(layer, part.router) if routed else ()
    name = "_".join(names + [route_name, act_name] + [key.lower() for key, on in flags.items() if on])
    args = ((getattr(layer, block.norm), float(layer.eps)) + raws[:4]
            + (top_k, normalize, route_args, glu_args, down_bias) + raws[4:])
    worker = instance(ffn_worker_template, name, ROUTE=route, ACTIVATE=act, **flags, **kernels)
    return worker, ffn_prologue, args, "ffn_" + name, MOE_STAGES


def _moe_takes(part):
    return (type(part.router) in ROUTERS and type(part.experts) in (SwiGLU, ClampedSwiGLU)
            and part.shared in (None, SharedExpert()))


def register():
    """Adds these parts to cpu_decode_fused.FUSED_FFNS."""
    FUSED_FFNS.update({MoE: FusedPart(_moe_takes, fused_ffn, new_ffn_work),
                       DenseFFN: FusedPart(lambda part: True, fused_ffn, new_ffn_work)})
