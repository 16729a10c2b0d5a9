"""A decode step's layer as one compiled call on the CPU backend, composed from per-part functions.

Op by op, a decode layer is ~30 backend calls (norms, five linears, rope, KV write, attention,
routing, the experts), each paying Python and Numba's dispatch. Here the same kernels run in the
same order, with the same serial / parallel choices, from one compiled function a layer. The
results are bit-identical with the op-by-op path, and the GIL stays released for the whole layer.

The layer (layer_template) calls its two blocks' part functions (MIXER, FFN), each a block of the
layer recipe (hybrid/arch/recipe.py): norm, part, residual add. COMPILED_PARTS maps each part type
to its compiled implementation: `takes(part)` says which variants it runs (declared, checked when
the runner is chosen), `make(backend, layer, block)` gives the part's function and its arguments. A
MoE block's router and experts are parts too (ROUTE, MIXTURE). Templates' globals name the kernels
and parts (Q_PAR, MIXER, ...), and each combination gets a copy of the template with its own globals
and its own name, so Numba caches each apart (cpu_kernels.twins.renamed_copy). The templates live in
this one file: Numba's cache of a caller does not see a change in a callee's file.

It covers batches of one-token chunks (decode) and float32 KV. Anything else takes the op-by-op path.

Shape legend: T tokens (one a sequence), H hidden, Hq / Hkv query / kv heads, D head dim,
E experts, K top-k, N pairs, F expert width, L layers, NB pool blocks, BT positions a block,
nb blocks of a sequence.
"""
import functools
import hashlib
import operator
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

import cpu_kernels
from cpu_kernels import activation, attention, moe_combine, rmsnorm, rope, routing
from cpu_kernels.twins import renamed_copy

from ..arch.recipe import FullAttention, GatedAttention, MoE, SoftmaxTopK, SwiGLU

# The op-by-op path's thresholds, the same choices here.
from .cpu_thresholds import (SERIAL_MAX_ATTENTION, SERIAL_MAX_ELEMENTS, SERIAL_MAX_WEIGHT_BYTES, TINY_MAX_ATTENTION,
                             TINY_MAX_ELEMENTS)

NO_NORM = np.ones(1, dtype=np.float32)  # the q/k norm weight of families without one
_INSTANCES = {}  # (template name, suffix) -> compiled instance


def instance(template, suffix, parallel=False, **kernels):
    """`template` compiled with `kernels` as its globals, named template_suffix_digest (its own cache files). Numba
    checks a cached function against its own file only, not the callees it compiled in: the digest covers those
    (the kernels' names, which carry their own digests where generated, and cpu_kernels' sources), so a changed
    kernel gives a new name, compiled afresh, rather than a stale cached instance."""
    key = (template.__name__, suffix)
    found = _INSTANCES.get(key)
    if found is None:
        options = dict(parallel=True) if parallel else {}
        named = renamed_copy(template, f"{suffix}_{_digest(kernels)}", **kernels)
        found = _INSTANCES[key] = njit(nogil=True, cache=True, **options)(named)
    return found


def _digest(kernels):
    """8 hex digits over the globals an instance is given and the sources of cpu_kernels."""
    digest = hashlib.sha1(_kernel_sources_digest())
    for name, value in sorted(kernels.items()):
        func = getattr(value, "py_func", None)
        digest.update((f"{name}={func.__module__}.{func.__qualname__}" if func is not None else f"{name}={value!r}").encode())
        digest.update(b";")
    return digest.hexdigest()[:8]


@functools.lru_cache(maxsize=None)
def _kernel_sources_digest():
    """cpu_kernels' sources and the decode templates' (a template calls helpers of another template file; the fused
    layer's worker calls the feed-forward workers of cpu_decode_fused_ffn.py)."""
    root = os.path.dirname(os.path.abspath(cpu_kernels.__file__))
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(root, name) for name in sorted(os.listdir(root)) if name.endswith(".py")]
    files += [os.path.join(here, name) for name in ("cpu_decode.py", "cpu_decode_ffn.py", "cpu_decode_fused_ffn.py")]
    digest = hashlib.sha1()
    for path in files:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    return digest.digest()


# -- linear runners: fn(raws, x, expert_ids, row_starts, outs, act_quant), as the quantized kernels are ----

def dense_one(raws, x, expert_ids, row_starts, outs, act_quant):
    """A float format's kernel (COMPILED, with its widening RECIPE) over raws already viewed as its words."""
    COMPILED(raws, x, expert_ids, row_starts, RECIPE, outs)  # noqa: F821 (instance globals)


def split_pair(raws, x, expert_ids, row_starts, outs, act_quant):
    """Two weights of different formats (an expert's gate and up) on the same rows, one after the other."""
    FIRST((raws[0],), x, expert_ids, row_starts, (outs[0],), act_quant)  # noqa: F821
    SECOND((raws[1],), x, expert_ids, row_starts, (outs[1],), act_quant)  # noqa: F821


# -- the layer --------------------------------------------------------------------------------------------

@njit(inline="always", nogil=True)
def _small(work, tiny_max, one_thread_max, one_thread):
    return work <= tiny_max or (work <= one_thread_max and one_thread)


@njit(inline="always", nogil=True)
def _rmsnorm(x, weight, eps, out, one_thread):
    if _small(x.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        rmsnorm.rmsnorm_serial(x, weight, eps, out)
    else:
        rmsnorm.rmsnorm(x, weight, eps, out)


@njit(inline="always", nogil=True)
def _rope(x, positions, inv_freq, scale, one_thread):
    if _small(x.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        rope.rope_neox_freqs_serial(x, positions, inv_freq, scale, x)
    else:
        rope.rope_neox_freqs(x, positions, inv_freq, scale, x)


@njit(inline="always", nogil=True)
def _add_bias(x, bias):
    """x [T, R] += bias [R] (where the part has one: QKV_BIAS / O_BIAS)."""
    for t in range(x.shape[0]):
        for r in range(x.shape[1]):
            x[t, r] += bias[r]


def layer_template(x, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, mixer_args, ffn_args):
    """x [T, H] += the mixer block (MIXER), then += the feed-forward block (FFN), for T one-token chunks: token t
    at position positions[t] of the sequence whose blocks are tables[t] (int32 [T, nb]); K/V go to
    k_pool / v_pool [L, NB, BT, Hkv, D] at layer_index. Returns the FFN block's routing ids int64 [T, K]. Sizes
    are arguments, never globals: an instance serves every model of its formats."""
    h = np.empty_like(x)  # [T, H]: a block's normed input
    MIXER(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, mixer_args)  # noqa: F821
    return FFN(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, ffn_args)  # noqa: F821


# -- parts: fn(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, args) -> ids [T, K]
# (a [T, 0] array for a part that does not route); x += the block, h is work space [T, H] -----------------

def full_attention_template(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, args):
    """x += o_proj(attention(rope(norm_heads(q, k)), v)) of rmsnorm(x); serial[i]: whether the q, k, v and o
    weights are small enough for their serial kernels on one thread. The FullAttention variants: biases on q, k, v
    (QKV_BIAS) and o (O_BIAS), RoPE over the first 2 * len(inv_freq) dims with cos / sin times rope_scale, the
    last `window` positions only (> 0), each head's sink logit in the softmax (SINKS); GATED (GatedAttention): the q
    projection gives each head's query then its output gate, and the attention's output is times sigmoid(gate)."""
    (norm, q_norm, k_norm, eps, inv_freq, rope_scale, scale, num_heads, num_kv_heads, head_dim, q_raws, k_raws,
     v_raws, o_raws, serial, biases, window, sinks) = args
    num_tokens, hidden = x.shape
    one_token_serial = num_tokens == 1 and one_thread
    # built here, not module constants: Numba would pass those read-only, a second typing of every kernel
    one_expert = np.zeros(1, dtype=np.int64)  # [1]
    row_starts = np.array([0, num_tokens], dtype=np.int64)  # [2]: all tokens in one group
    no_lse = np.empty((0, 0), dtype=np.float32)
    _rmsnorm(x, norm, eps, h, one_thread)
    q = np.empty((num_tokens, num_heads * head_dim * (2 if GATED else 1)), dtype=np.float32)  # noqa: F821 [T, Hq*D(*2)]
    k = np.empty((num_tokens, num_kv_heads * head_dim), dtype=np.float32)  # [T, Hkv*D]
    v = np.empty((num_tokens, num_kv_heads * head_dim), dtype=np.float32)  # [T, Hkv*D]
    if one_token_serial and serial[0]:
        Q_SER(q_raws, h, one_expert, row_starts, (q,), act_quant)  # noqa: F821
    else:
        Q_PAR(q_raws, h, one_expert, row_starts, (q,), act_quant)  # noqa: F821
    if one_token_serial and serial[1]:
        K_SER(k_raws, h, one_expert, row_starts, (k,), act_quant)  # noqa: F821
    else:
        K_PAR(k_raws, h, one_expert, row_starts, (k,), act_quant)  # noqa: F821
    if one_token_serial and serial[2]:
        V_SER(v_raws, h, one_expert, row_starts, (v,), act_quant)  # noqa: F821
    else:
        V_PAR(v_raws, h, one_expert, row_starts, (v,), act_quant)  # noqa: F821
    if QKV_BIAS:  # noqa: F821
        _add_bias(q, biases[0])
        _add_bias(k, biases[1])
        _add_bias(v, biases[2])
    gate = np.empty((0, 0, 0), dtype=np.float32)
    if GATED:  # noqa: F821
        pairs = q.reshape(num_tokens, num_heads, 2, head_dim)  # per head: its query, then its gate
        gate = np.ascontiguousarray(pairs[:, :, 1])  # [T, Hq, D]
        q = np.ascontiguousarray(pairs[:, :, 0]).reshape(num_tokens, num_heads * head_dim)
    q3 = q.reshape(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    k3 = k.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    v3 = v.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    if QK_NORM:  # noqa: F821
        q_rows = q.reshape(num_tokens * num_heads, head_dim)
        k_rows = k.reshape(num_tokens * num_kv_heads, head_dim)
        _rmsnorm(q_rows, q_norm, eps, q_rows, one_thread)
        _rmsnorm(k_rows, k_norm, eps, k_rows, one_thread)
    _rope(q3, positions, inv_freq, rope_scale, one_thread)
    _rope(k3, positions, inv_freq, rope_scale, one_thread)
    att = np.empty((num_tokens, num_heads, head_dim), dtype=np.float32)  # [T, Hq, D]
    lse = np.empty((1, num_heads), dtype=np.float32) if SINKS else no_lse  # noqa: F821 ([1, Hq]: a token's)
    layer_k, layer_v = k_pool[layer_index], v_pool[layer_index]  # [NB, BT, Hkv, D]
    for t in range(num_tokens):
        start = positions[t]  # one token a chunk: its position is where the chunk starts
        attention.write_rows(k_pool, layer_index, tables[t], start, k3[t:t + 1])
        attention.write_rows(v_pool, layer_index, tables[t], start, v3[t:t + 1])
        work = (start + 1) * num_heads * head_dim
        if _small(work, TINY_MAX_ATTENTION, SERIAL_MAX_ATTENTION, one_thread):
            attention.attention_serial(q3[t:t + 1], layer_k, layer_v, tables[t], start, 0, start + 1, scale,
                                       att[t:t + 1], lse, attention.NO_SCALES, attention.NO_SCALES, window)
        else:
            attention.attention(q3[t:t + 1], layer_k, layer_v, tables[t], start, 0, start + 1, scale, att[t:t + 1],
                                lse, attention.NO_SCALES, attention.NO_SCALES, window)
        if SINKS:  # noqa: F821
            attention.apply_sinks(att[t:t + 1], lse, sinks)
    if GATED:  # noqa: F821
        for t in range(num_tokens):
            for head in range(num_heads):
                for d in range(head_dim):
                    att[t, head, d] *= np.float32(1.0) / (np.float32(1.0) + np.exp(-gate[t, head, d]))
    o = np.empty((num_tokens, hidden), dtype=np.float32)  # [T, H]
    att2 = att.reshape(num_tokens, num_heads * head_dim)
    if one_token_serial and serial[3]:
        O_SER(o_raws, att2, one_expert, row_starts, (o,), act_quant)  # noqa: F821
    else:
        O_PAR(o_raws, att2, one_expert, row_starts, (o,), act_quant)  # noqa: F821
    if O_BIAS:  # noqa: F821
        _add_bias(o, biases[3])
    x += o
    return np.empty((num_tokens, 0), dtype=np.int64)


def moe_template(x, h, positions, tables, k_pool, v_pool, layer_index, one_thread, act_quant, args):
    """x += the routed experts' weighted sum for rmsnorm(x): router logits (R_PAR / R_SER; serial: whether the
    router weight is small enough for its serial kernel on one thread), the router part (ROUTE, its own arguments
    route_args), the pairs grouped by expert, the experts part (MIXTURE, glu_args), then the shared expert's
    output added to theirs (SHARED, shared_args; a no-op without one)."""
    norm, eps, r_raws, gu_raws, d_raws, top_k, normalize, serial, route_args, glu_args, shared_args = args
    num_tokens, hidden = x.shape
    one_expert = np.zeros(1, dtype=np.int64)  # [1]
    row_starts = np.array([0, num_tokens], dtype=np.int64)  # [2]
    _rmsnorm(x, norm, eps, h, one_thread)
    num_experts = r_raws[0].shape[1]  # the router's rows
    logits = np.empty((num_tokens, num_experts), dtype=np.float32)  # [T, E]
    if num_tokens == 1 and one_thread and serial:
        R_SER(r_raws, h, one_expert, row_starts, (logits,), act_quant)  # noqa: F821
    else:
        R_PAR(r_raws, h, one_expert, row_starts, (logits,), act_quant)  # noqa: F821
    ids = np.empty((num_tokens, top_k), dtype=np.int64)  # [T, K]
    weights = np.empty((num_tokens, top_k), dtype=np.float32)  # [T, K]
    ROUTE(logits, top_k, normalize, route_args, ids, weights, one_thread)  # noqa: F821
    order, expert_ids, pair_starts = routing.group_by_expert(ids, num_experts)
    moe = np.zeros((num_tokens, hidden), dtype=np.float32)  # [T, H]
    MIXTURE(h, order, expert_ids, pair_starts, weights, gu_raws, d_raws, one_thread, act_quant, glu_args,  # noqa: F821
            moe)
    SHARED(h, one_thread, act_quant, shared_args, moe)  # noqa: F821
    x += moe
    return ids


@njit(nogil=True, cache=True)
def softmax_topk_route(logits, top_k, normalize, route_args, ids, weights, one_thread):
    """The SoftmaxTopK router part: logits [T, E] -> ids, weights [T, K]."""
    if _small(logits.size, TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread):
        routing.route_softmax_topk_serial(logits, top_k, normalize, ids, weights)
    else:
        routing.route_softmax_topk(logits, top_k, normalize, ids, weights)


def expert_mixture_template(h, order, expert_ids, row_starts, weights, gu_raws, d_raws, one_thread, act_quant,
                            glu_args, out):
    """out [T, H] += for each pair row i (pair order[i] = t * K + j, sorted by expert: rows row_starts[g]:row_starts[g
    + 1] of expert expert_ids[g]) weights[t, j] * expert(h[t]): gather, gate/up (GU_PAR), the activation (ACTIVATE:
    SwiGLU, or the clamped one with the experts' biases in glu_args), down (D_PAR) and its bias (DOWN_BIAS), the
    weighted sum, each serial or parallel by size as grouped_experts chooses. h [T, H], weights [T, K]."""
    top_k, hidden = weights.shape[1], h.shape[1]
    num_pairs, width = order.size, gu_raws[0].shape[1]
    small = _small(num_pairs * max(hidden, width), TINY_MAX_ELEMENTS, SERIAL_MAX_ELEMENTS, one_thread)
    xs = np.empty((num_pairs, hidden), dtype=np.float32)  # [N, H]
    if small:
        moe_combine.gather_rows_serial(h, order, top_k, xs)
    else:
        moe_combine.gather_rows(h, order, top_k, xs)
    gate = np.empty((num_pairs, width), dtype=np.float32)  # [N, F]
    up = np.empty((num_pairs, width), dtype=np.float32)  # [N, F]
    GU_PAR(gu_raws, xs, expert_ids, row_starts, (gate, up), act_quant)  # noqa: F821 (instance globals)
    ACTIVATE(gate, up, expert_ids, row_starts, glu_args, small)  # noqa: F821
    down = np.empty((num_pairs, hidden), dtype=np.float32)  # [N, H]
    D_PAR(d_raws, gate, expert_ids, row_starts, (down,), act_quant)  # noqa: F821
    DOWN_BIAS(down, expert_ids, row_starts, glu_args, small)  # noqa: F821
    if small:
        moe_combine.scatter_add_weighted_serial(down, order, weights.reshape(-1), top_k, out)
    else:
        moe_combine.scatter_add_weighted(down, order, weights.reshape(-1), top_k, out)


# -- per layer: the instance and its arguments ------------------------------------------------------------

def _runners(backend, weight):
    """(parallel, serial, raws, bytes, format name) of a weight: its format's kernels, or for a float format
    instances of dense_one over word views of its raws."""
    kernels = backend._kernels_of(weight)
    name = kernels.fmt.__name__.rsplit(".", 1)[-1]
    par, ser, raws = kernels.parallel, kernels.serial, kernels.raws
    dense = getattr(par, "compiled", None)
    if dense is not None:
        raws = tuple(raw.view(par.word_dtype) for raw in raws)
        par = instance(dense_one, f"{name}_parallel", COMPILED=par.compiled, RECIPE=par.recipe)
        ser = instance(dense_one, f"{name}_serial", COMPILED=ser.compiled, RECIPE=ser.recipe)
    return par, ser, raws, weight.raw.nbytes, name


@njit(nogil=True, cache=True)
def swiglu_activate(gate, up, expert_ids, row_starts, glu_args, small):
    """The SwiGLU experts' activation: gate [N, F] = silu(gate) * up."""
    if small:
        activation.swiglu_serial(gate, up, gate)
    else:
        activation.swiglu(gate, up, gate)


@njit(nogil=True, cache=True)
def no_down_bias(down, expert_ids, row_starts, glu_args, small):
    """Experts without a bias on their down projection."""


@njit(nogil=True, cache=True)
def no_shared(h, one_thread, act_quant, shared_args, out):
    """A MoE without a shared expert."""


def expert_mixture(backend, layer, what, activate=swiglu_activate, down_bias=no_down_bias, glu_name="swiglu"):
    """(expert_mixture_template's instance, gate+up raws, down raws, format names) of a layer's experts: gate and
    up in one region where they share a format, as grouped_experts runs them, else split_pair; activate /
    down_bias: the experts' activation and down bias functions (SwiGLU's by default). `what` names the caller in
    the error raised when the three weights' shapes do not fit together."""
    gate, up, down = (_runners(backend, w) for w in (layer.gate_exps, layer.up_exps, layer.down_exps))
    paired = (layer.up_exps.qtype == layer.gate_exps.qtype and layer.up_exps.raw.shape == layer.gate_exps.raw.shape
              and layer.up_exps.raw.flags.writeable == layer.gate_exps.raw.flags.writeable)
    gu = gate[0] if paired else instance(split_pair, f"{gate[4]}_{up[4]}", FIRST=gate[0], SECOND=up[0])
    hidden, width = layer.gate_exps.shape[2], layer.gate_exps.shape[1]
    if (backend._kernels_of(layer.down_exps).cols, layer.down_exps.shape[1]) != (width, hidden):
        raise ValueError(f"{what}: {layer.gate_exps.name} {layer.gate_exps.shape} and "
                         f"{layer.down_exps.name} {layer.down_exps.shape} do not fit")
    names = [gate[4], up[4], down[4], "paired" if paired else "split", glu_name]
    mixture = instance(expert_mixture_template, "_".join(names), GU_PAR=gu, D_PAR=down[0], ACTIVATE=activate,
                       DOWN_BIAS=down_bias)
    return mixture, gate[2] + up[2], down[2], names


@dataclass(frozen=True)
class Part:
    """A part's compiled implementation: takes(part) whether it runs that variant; make(backend, layer, block or
    part) -> (function, arguments, name), the name unique per function (its instances' cache key)."""

    takes: Callable
    make: Callable


def _linear_kernels(backend, keyed_weights):
    """({KEY_PAR, KEY_SER: runners}, (raws, ...), serial bool [n], format names) of (key, weight) pairs."""
    kernels, raws_of, serial, names = {}, [], [], []
    for key, weight in keyed_weights:
        par, ser, raws, nbytes, name = _runners(backend, weight)
        kernels.update({f"{key}_PAR": par, f"{key}_SER": ser})
        raws_of.append(raws)
        serial.append(nbytes <= SERIAL_MAX_WEIGHT_BYTES)
        names.append(name)
    return kernels, tuple(raws_of), np.array(serial), names


def make_full_attention(backend, layer, block):
    return _attention(backend, layer, block, block.part, gated=False)


def make_gated_attention(backend, layer, block):
    """GatedAttention: full_attention_template with q/k norm, no biases, sinks or window, and its output gate."""
    return _attention(backend, layer, block, FullAttention(qk_norm=True), gated=True)


def _attention(backend, layer, block, part, gated):
    kernels, raws, serial, names = _linear_kernels(backend, (("Q", layer.attn_q), ("K", layer.attn_k),
                                                             ("V", layer.attn_v), ("O", layer.attn_output)))
    flags = dict(QK_NORM=part.qk_norm, QKV_BIAS=part.qkv_bias, O_BIAS=part.o_bias, SINKS=part.sinks, GATED=gated)
    name = "_".join(names + ([key.lower() for key, on in flags.items() if on] or ["plain"]))
    fn = instance(full_attention_template, name, **flags, **kernels)
    q_norm, k_norm = (layer.attn_q_norm, layer.attn_k_norm) if part.qk_norm else (NO_NORM, NO_NORM)
    biases = tuple(getattr(layer, f) if on else NO_NORM for f, on in (
        ("attn_q_bias", part.qkv_bias), ("attn_k_bias", part.qkv_bias), ("attn_v_bias", part.qkv_bias),
        ("attn_output_bias", part.o_bias)))
    args = (getattr(layer, block.norm), q_norm, k_norm, float(layer.eps), layer.rope_freqs, float(layer.rope_scale),
            float(1.0 / np.sqrt(layer.head_dim)), layer.num_heads, layer.num_kv_heads, layer.head_dim) + raws + (
        serial, biases, int(part.window), layer.attn_sinks if part.sinks else NO_NORM)
    return fn, args, "attention_" + name


def make_moe(backend, layer, block):
    part = block.part
    route, route_args, route_name = COMPILED_PARTS[type(part.router)].make(backend, layer, part.router)
    mixture, gu_raws, d_raws, expert_names, glu_args = COMPILED_PARTS[type(part.experts)].make(backend, layer,
                                                                                               part.experts)
    shared, shared_args, shared_name = ((no_shared, (), "noshared") if part.shared is None else
                                        COMPILED_PARTS[type(part.shared)].make(backend, layer, part.shared))
    kernels, (r_raws,), serial, names = _linear_kernels(backend, (("R", layer.router),))
    name = "_".join(names + [route_name] + expert_names + [shared_name])
    fn = instance(moe_template, name, ROUTE=route, MIXTURE=mixture, SHARED=shared, **kernels)
    args = (getattr(layer, block.norm), float(layer.eps), r_raws, gu_raws, d_raws, layer.num_experts_per_tok,
            bool(layer.norm_topk_prob), bool(serial[0]), route_args, glu_args, shared_args)
    return fn, args, "moe_" + name


def make_swiglu(backend, layer, part):
    """(expert_mixture's instance, gate+up raws, down raws, names, its activation's arguments: none)."""
    return expert_mixture(backend, layer, f"decode layer {layer.index}") + ((),)


# The compiled implementation of each part type (hybrid/arch/recipe.py).
# The compiled implementation of each part type (hybrid/arch/recipe.py); cpu_decode_ffn.register() adds the
# feed-forward block's newer parts.
COMPILED_PARTS = {
    FullAttention: Part(takes=lambda part: part.rope in ("neox", "yarn"), make=make_full_attention),
    GatedAttention: Part(takes=lambda part: True, make=make_gated_attention),
    MoE: Part(takes=lambda part: True, make=make_moe),  # its router, experts and shared expert are parts too
    SoftmaxTopK: Part(takes=lambda part: True, make=lambda backend, layer, part: (softmax_topk_route, (), "softmax")),
    SwiGLU: Part(takes=lambda part: True, make=make_swiglu),
}


def compiles(block):
    """Whether the block's part, and each part nested in it (a MoE's), has a compiled implementation that takes it."""
    part = block.part
    nested = (part.router, part.experts, part.shared) if isinstance(part, MoE) else ()
    return all(type(p) in COMPILED_PARTS and COMPILED_PARTS[type(p)].takes(p) for p in (part,) + nested
               if p is not None)


class LayerPlan:
    """One layer's compiled decode functions and the arguments that do not change between steps: `fn` / `args`
    the whole layer's (layer_template over its blocks' parts) where every block compiles, else None; `blocks` each
    block's (function, arguments), or None for a block the plain runner's steps run (`compiled`: which)."""

    def __init__(self, backend, layer, recipe, compiled):
        self.weights = _weights(layer)
        self.raws = tuple(map(_RAW, self.weights))  # rebuilt when a weight's raw is replaced
        made = [COMPILED_PARTS[type(b.part)].make(backend, layer, b) if on else None
                for b, on in zip(recipe.blocks, compiled)]
        self.blocks = tuple(None if m is None else (m[0], m[1]) for m in made)
        self.fn = self.args = None
        if all(compiled):
            mixer, ffn = made
            self.fn = instance(layer_template, f"{mixer[2]}__{ffn[2]}", MIXER=mixer[0], FFN=ffn[0])
            self.args = (mixer[1], ffn[1])
        self.layer = layer
        self.fused_call = None  # (the layer's fused instance, its arguments after `work`): set by the runner
        self.shapes = None  # what cpu_decode_fused.new_work's arrays depend on: set by the runner for a fused layer

    def current(self, layer):
        """Whether the layer's weights still hold the raws this plan was made for (C-level loops: this runs
        once a layer a step, with the interpreter's data cold after the layer before)."""
        return all(map(operator.is_, map(_RAW, self.weights), self.raws))


_RAW = operator.attrgetter("raw")
WEIGHT_FIELDS = ("attn_q", "attn_k", "attn_v", "attn_output", "router", "gate_exps", "up_exps", "down_exps",
                 "gate_shexp", "up_shexp", "down_shexp", "shexp_gate", "ffn_gate", "ffn_up", "ffn_down")


def _weights(layer):
    """The layer's quantized weights a plan's functions read (those it has)."""
    return tuple(w for w in map(layer.__dict__.get, WEIGHT_FIELDS) if w is not None)


class DecodeStep:
    """A decode batch's per-step arrays: positions int64 [T] (one token a sequence: where each starts), block
    tables int32 [T, nb], and the KV pool its sequences share."""

    def __init__(self, batch):
        self.pool = batch.chunks[0].kv.pool
        if any(c.kv.pool is not self.pool for c in batch.chunks):
            raise ValueError("a compiled decode step needs the batch's sequences in one KV pool")
        self.positions = batch.positions
        width = max(len(c.kv.table) for c in batch.chunks)
        self.tables = np.zeros((len(batch.chunks), width), dtype=np.int32)
        for t, chunk in enumerate(batch.chunks):
            chunk.kv.check_room(chunk.start, 1)  # the compiled writer does not check bounds
            self.tables[t, :len(chunk.kv.table)] = chunk.kv.table
