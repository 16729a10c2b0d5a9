"""A decode layer as one parallel region, its ops as stages the threads meet between.

The compiled decode layer (cpu_decode.py) still opens a parallel region per op: eight a layer
(q, k, v, o, router, attention, the experts' gate+up and down), each with a serial prologue (the
rounding of x, the work split) while the other threads wait. On 16 cores a region costs 5-6 us
before any work and a meeting of the threads inside one ~2 us. Here the threads enter one region a layer and
run it as llama.cpp runs its graph: every thread does the small serial work itself (norms, the
rounding of x, the routing, the merge of attention splits: a few us, the same on every thread, so
nobody waits for it), and the item-parallel ops claim items from counters and meet when all are
done (cpu_kernels.sync). Seven meetings a layer.

The layer is composed from per-part implementations, as cpu_decode's is: FUSED_MIXERS and FUSED_FFNS
give each part type its worker (its stages, from a first stage number it is given), the serial
prologue it needs before the region, its work arrays and its arguments; the region
(cpu_fused_region.py) runs worker_template, which calls the mixer's worker, then the feed-forward
part's with the mixer's output. Each op runs the same kernels on the same items as cpu_decode's layer.

Shape legend: T tokens (one a sequence), H hidden, Hq / Hkv query / kv heads, G = Hq / Hkv, D head
dim, E experts, K top-k, N pairs, F expert width, P key splits, W workers (the region's iterations).
"""
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numba import njit

from cpu_kernels import attention, rmsnorm, rope, sync

from ..arch.recipe import FullAttention
from .cpu_decode import NO_NORM, instance
from .cpu_fused_region import region_template

QKV, ROPE_KV, ATTEND, OUT = range(4)  # the FullAttention part's stages, from its first
ROUTER, GATE_UP, DOWN, COMBINE = range(4)  # the MoE part's
ATTENTION_STAGES = MOE_STAGES = 4
NUM_STAGES = ATTENTION_STAGES + MOE_STAGES  # a layer's: the mixer's, then the feed-forward part's
COMBINE_COLUMNS = 64  # output columns of a combine item
# trace columns (fused_layer): per stage a worker's own work, items, wait; then its start after the call's
# first line (the serial prologue and the region's fork); then, in row 0, the call's first line to its return
# (the serial prologue alone: row 0's PROLOGUE)
START, WHOLE, PROLOGUE = 3 * NUM_STAGES, 3 * NUM_STAGES + 1, 3 * NUM_STAGES + 2
TRACE_COLUMNS = PROLOGUE + 1


# -- dense formats: the quantized formats' (prepare, run_item) signature over RECIPE ----------------------

def dense_prepare(raws, x, expert_ids, row_starts, act_quant):
    return PREPARE(raws, x, expert_ids, row_starts)  # noqa: F821 (instance globals)


def dense_run_item(raws, x, items, prep, outs, i, act_quant):
    RUN_ITEM(raws, x, items, prep, RECIPE, outs, i)  # noqa: F821


def format_parts(backend, weight):
    """(prepare, run_item, raws) of a weight's format: moe_matmul's serial part and one of its items."""
    kernels = backend._kernels_of(weight)
    par, raws = kernels.parallel, kernels.raws
    if getattr(par, "compiled", None) is not None:  # a float format: its words, and instances over its recipe
        name = kernels.fmt.__name__.rsplit(".", 1)[-1]
        raws = tuple(raw.view(par.word_dtype) for raw in raws)
        return (instance(dense_prepare, name, PREPARE=par.prepare),
                instance(dense_run_item, name, RUN_ITEM=par.run_item, RECIPE=par.recipe), raws)
    return kernels.fmt._prepare, kernels.fmt._run_item, raws


def new_work(layer, recipe, num_tokens, num_workers):
    """The arrays a fused layer call writes besides x (its `work`): (counters, one_expert, row_starts, the mixer
    part's arrays, the feed-forward part's), made once per batch size and thread count and kept
    (cpu_layer.CompiledRunner): allocated afresh at every call, the ~13 shared and ~10 per-worker arrays cost
    tens of us of the call's serial prologue, cold allocator state each time."""
    return (sync.new_counters(NUM_STAGES, num_workers), np.zeros(1, dtype=np.int64),
            np.array([0, num_tokens], dtype=np.int64),
            FUSED_MIXERS[type(recipe.mixer.part)].new_work(layer, recipe.mixer.part, num_tokens, num_workers),
            FUSED_FFNS[type(recipe.ffn.part)].new_work(layer, recipe.ffn.part, num_tokens, num_workers))


def _f32(*shape):
    return np.empty(shape, dtype=np.float32)


def _i64(*shape):
    return np.empty(shape, dtype=np.int64)


def new_attention_work(layer, part, num_tokens, num_workers):
    """The FullAttention part's arrays (see the legend; P = the most key splits attention.num_key_splits
    gives, W = num_workers)."""
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    hidden, group, splits = layer.attn_output.shape[0], heads // kv_heads, max(1, attention.TARGET_ITEMS // kv_heads)
    return (_f32(num_tokens, heads * head_dim), _f32(num_tokens, kv_heads * head_dim),  # q, k
            _f32(num_tokens, kv_heads * head_dim),  # v
            _f32(num_tokens, kv_heads, splits, group, head_dim),  # acc
            np.empty((num_tokens, kv_heads, splits, group, 2), dtype=np.float64),  # stats
            _f32(num_tokens, hidden), _i64(num_tokens), _i64(num_tokens + 1),  # o, splits, split_starts
            # per worker: h (then o plus its bias), att, each head's log-sum-exp (sinks)
            _f32(num_workers, num_tokens, hidden), _f32(num_workers, num_tokens, heads * head_dim),
            _f32(num_workers, num_tokens, heads))


@njit(nogil=True)
def attention_prologue(positions, work, args):
    """The FullAttention part's serial work before the region: each token's key splits (over the window's keys
    where the layer has one, as attention.attention splits them)."""
    splits, split_starts = work[6], work[7]
    num_kv_heads, window = args[7], args[14]
    num_tokens = positions.shape[0]
    for tt in range(num_tokens):
        num_keys = positions[tt] + 1
        splits[tt] = attention.num_key_splits(num_kv_heads, min(num_keys, window) if window > 0 else num_keys)
    split_starts[0] = 0
    for tt in range(num_tokens):
        split_starts[tt + 1] = split_starts[tt] + num_kv_heads * splits[tt]
    return np.empty((num_tokens, 0), dtype=np.int64)


@njit(nogil=True)
def _add_row(row, bias):
    """row [R] += bias [R]."""
    for r in range(row.shape[0]):
        row[r] += bias[r]


@njit(nogil=True)
def _add_columns(a, b, c0, c1, out):
    """out[:, c0:c1] = a + b over those columns."""
    for t in range(out.shape[0]):
        for c in range(c0, c1):
            out[t, c] = a[t, c] + b[t, c]


def attention_worker_template(w, num_workers, x, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,
                              counters, first, one_expert, row_starts, work, args, t):
    """Worker w's share of the FullAttention part: its stages (from stage `first`), meeting the other workers
    between them. Returns (ticks for the trace, the part's output o [T, H], which x does not include yet). The
    FullAttention variants as cpu_decode.full_attention_template runs them: QKV_BIAS, O_BIAS, `window`, SINKS."""
    (attn_norm, q_norm, k_norm, eps, rope_freqs, scale, num_heads, num_kv_heads, head_dim, q_raws, k_raws, v_raws,
     o_raws, biases, window, sinks) = args
    q, k, v, acc, stats, o, splits, split_starts, h_of, att_of, lse_of = work
    num_tokens = x.shape[0]
    group = num_heads // num_kv_heads
    scale32 = np.float32(scale)
    layer_k, layer_v = k_pool[layer_index], v_pool[layer_index]  # [NB, BT, Hkv, D]
    q3 = q.reshape(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    k3 = k.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    v3 = v.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    # q, k, v: each thread norms x and rounds it for the three formats itself
    h = h_of[w]  # [T, H]
    rmsnorm.rmsnorm_serial(x, attn_norm, eps, h)
    q_items, q_prep = Q_PREP(q_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    k_items, k_prep = K_PREP(k_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    v_items, v_prep = V_PREP(v_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    nq, nk, nv = q_items.shape[0], k_items.shape[0], v_items.shape[0]
    done = 0
    t = sync.mark(trace, w, 3 * (first + QKV), t)
    i, tried = sync.take(counters, first + QKV, w, num_workers, nq + nk + nv, 0)
    while i < nq + nk + nv:
        if i < nq:
            Q_ITEM(q_raws, h, q_items, q_prep, (q,), i, act_quant)  # noqa: F821
        elif i < nq + nk:
            K_ITEM(k_raws, h, k_items, k_prep, (k,), i - nq, act_quant)  # noqa: F821
        else:
            V_ITEM(v_raws, h, v_items, v_prep, (v,), i - nq - nk, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, first + QKV, w, num_workers, nq + nk + nv, tried)
    t = sync.mark(trace, w, 3 * (first + QKV) + 1, t)
    sync.finish(counters, first + QKV, num_workers, done, nq + nk + nv)
    t = sync.mark(trace, w, 3 * (first + QKV) + 2, t)
    # per token: q / k norms, RoPE, the K/V rows into the cache
    done = 0
    t = sync.mark(trace, w, 3 * (first + ROPE_KV), t)
    tok, tried = sync.take(counters, first + ROPE_KV, w, num_workers, num_tokens, 0)
    while tok < num_tokens:
        if QKV_BIAS:  # noqa: F821
            _add_row(q[tok], biases[0])
            _add_row(k[tok], biases[1])
            _add_row(v[tok], biases[2])
        if QK_NORM:  # noqa: F821
            q_rows, k_rows = q3[tok], k3[tok]  # [Hq, D], [Hkv, D]
            rmsnorm.rmsnorm_serial(q_rows, q_norm, eps, q_rows)
            rmsnorm.rmsnorm_serial(k_rows, k_norm, eps, k_rows)
        inv_freq, rope_scale = rope_freqs  # RoPE over the first 2 * len(inv_freq) dims, cos / sin times rope_scale
        rope.rope_neox_freqs_serial(q3[tok:tok + 1], positions[tok:tok + 1], inv_freq, rope_scale, q3[tok:tok + 1])
        rope.rope_neox_freqs_serial(k3[tok:tok + 1], positions[tok:tok + 1], inv_freq, rope_scale, k3[tok:tok + 1])
        attention.write_rows(k_pool, layer_index, tables[tok], positions[tok], k3[tok:tok + 1])
        attention.write_rows(v_pool, layer_index, tables[tok], positions[tok], v3[tok:tok + 1])
        done = done + 1
        tok, tried = sync.take(counters, first + ROPE_KV, w, num_workers, num_tokens, tried)
    t = sync.mark(trace, w, 3 * (first + ROPE_KV) + 1, t)
    sync.finish(counters, first + ROPE_KV, num_workers, done, num_tokens)
    t = sync.mark(trace, w, 3 * (first + ROPE_KV) + 2, t)
    # attention: (token, kv head, key split) items, as cpu_kernels.attention splits them
    num_attend = split_starts[num_tokens]
    done = 0
    t = sync.mark(trace, w, 3 * (first + ATTEND), t)
    i, tried = sync.take(counters, first + ATTEND, w, num_workers, num_attend, 0)
    while i < num_attend:
        tok = 0
        while split_starts[tok + 1] <= i:
            tok += 1
        num_splits, rank = splits[tok], i - split_starts[tok]
        kv, s = rank // num_splits, rank % num_splits
        lo = 0 if window <= 0 else max(0, positions[tok] + 1 - window)
        num_keys = positions[tok] + 1 - lo
        j0, j1 = lo + s * num_keys // num_splits, lo + (s + 1) * num_keys // num_splits
        if j1 > j0:
            attention._partial(q3, layer_k, layer_v, attention.NO_SCALES, attention.NO_SCALES, tables[tok], tok,
                               kv, j0, j1, scale32, acc[tok, kv, s], stats[tok, kv, s])
        else:
            stats[tok, kv, s, :, 1] = 0.0
        done = done + 1
        i, tried = sync.take(counters, first + ATTEND, w, num_workers, num_attend, tried)
    t = sync.mark(trace, w, 3 * (first + ATTEND) + 1, t)
    sync.finish(counters, first + ATTEND, num_workers, done, num_attend)
    t = sync.mark(trace, w, 3 * (first + ATTEND) + 2, t)
    # o: each thread merges the splits itself (a few us), then the rows are shared out
    att, lse = att_of[w], lse_of[w]  # [T, Hq*D], [T, Hq]
    for tok in range(num_tokens):
        for head in range(num_heads):
            lse[tok, head] = attention._merge(acc[tok, head // group, :splits[tok], head % group],
                                              stats[tok, head // group, :splits[tok], head % group],
                                              att[tok, head * head_dim:(head + 1) * head_dim])
    if SINKS:  # noqa: F821
        attention.apply_sinks(att.reshape(num_tokens, num_heads, head_dim), lse, sinks)
    o_items, o_prep = O_PREP(o_raws, att, one_expert, row_starts, act_quant)  # noqa: F821
    done = 0
    t = sync.mark(trace, w, 3 * (first + OUT), t)
    i, tried = sync.take(counters, first + OUT, w, num_workers, o_items.shape[0], 0)
    while i < o_items.shape[0]:
        O_ITEM(o_raws, att, o_items, o_prep, (o,), i, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, first + OUT, w, num_workers, o_items.shape[0], tried)
    t = sync.mark(trace, w, 3 * (first + OUT) + 1, t)
    sync.finish(counters, first + OUT, num_workers, done, o_items.shape[0])
    t = sync.mark(trace, w, 3 * (first + OUT) + 2, t)
    if O_BIAS:  # noqa: F821: o + its bias on each thread (h is free again)
        for tok in range(num_tokens):
            for c in range(o.shape[1]):
                h[tok, c] = o[tok, c] + biases[3][c]
        return t, h
    return t, o


def worker_template(w, num_workers, entry, x, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,
                    counters, one_expert, row_starts, mixer_work, ffn_work, mixer_args, ffn_args, ids_out):
    """Worker w's share of the fused layer: the mixer part (MIXER), then the feed-forward part (FFN), whose
    stages follow the mixer's (MIXER_STAGES of them)."""
    t = sync.mark(trace, w, START, entry)
    t, y = MIXER(w, num_workers, x, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,  # noqa: F821
                 counters, 0, one_expert, row_starts, mixer_work, mixer_args, t)
    FFN(w, num_workers, x, y, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,  # noqa: F821
        counters, MIXER_STAGES, one_expert, row_starts, ffn_work, ffn_args, ids_out, t)  # noqa: F821


def _parts(backend, keyed_weights):
    """({KEY_PREP, KEY_ITEM: kernels}, (raws, ...), format names) of (key, weight) pairs."""
    kernels, raws, names = {}, [], []
    for key, weight in keyed_weights:
        prepare, run_item, weight_raws = format_parts(backend, weight)
        kernels.update({f"{key}_PREP": prepare, f"{key}_ITEM": run_item})
        raws.append(weight_raws)
        names.append(backend._kernels_of(weight).fmt.__name__.rsplit(".", 1)[-1])
    return kernels, tuple(raws), names


def fused_attention(backend, layer, block):
    """(worker instance, prologue, arguments, name, stages) of a FullAttention mixer."""
    part = block.part
    kernels, raws, names = _parts(backend, (("Q", layer.attn_q), ("K", layer.attn_k), ("V", layer.attn_v),
                                            ("O", layer.attn_output)))
    flags = dict(QK_NORM=part.qk_norm, QKV_BIAS=part.qkv_bias, O_BIAS=part.o_bias, SINKS=part.sinks)
    name = "_".join(names + ([key.lower() for key, on in flags.items() if on] or ["plain"]))
    q_norm, k_norm = (layer.attn_q_norm, layer.attn_k_norm) if part.qk_norm else (NO_NORM, NO_NORM)
    biases = tuple(getattr(layer, f) if on else NO_NORM for f, on in (
        ("attn_q_bias", part.qkv_bias), ("attn_k_bias", part.qkv_bias), ("attn_v_bias", part.qkv_bias),
        ("attn_output_bias", part.o_bias)))
    args = (getattr(layer, block.norm), q_norm, k_norm, float(layer.eps), (layer.rope_freqs, float(layer.rope_scale)),
            float(1.0 / np.sqrt(layer.head_dim)), layer.num_heads, layer.num_kv_heads, layer.head_dim) + raws + (
        biases, int(part.window), layer.attn_sinks if part.sinks else NO_NORM)
    worker = instance(attention_worker_template, name, **flags, **kernels)
    return worker, attention_prologue, args, "attention_" + name, ATTENTION_STAGES


def fused_layer(backend, layer, recipe):
    """(the layer's fused instance, its arguments after `work`): the region (cpu_fused_region.py) whose workers run
    the mixer part's stages, then the feed-forward part's. Its call: fn(x [T, H], positions, tables, k_pool,
    v_pool, layer_index, act_quant, trace, work, *arguments) -> routing ids [T, K], x updated in place as
    cpu_decode.layer_template does. trace int64 [W, TRACE_COLUMNS] (zero rows: no profile) gains each worker's
    ticks per stage (its own serial work, its items, its wait for the others), and those of the region's start
    and of the whole call. work: new_work's arrays for this batch size and thread count. The region's body is one
    call of the worker (worker_template): Numba's parfor passes over the whole body inline were most of this
    layer's compile time."""
    mixer = FUSED_MIXERS[type(recipe.mixer.part)].make(backend, layer, recipe.mixer)
    ffn = FUSED_FFNS[type(recipe.ffn.part)].make(backend, layer, recipe.ffn)
    if mixer[4] + ffn[4] > NUM_STAGES:
        raise ValueError(f"fused layer: {mixer[3]} and {ffn[3]} take more than {NUM_STAGES} stages")
    suffix = f"{mixer[3]}__{ffn[3]}"
    worker = instance(worker_template, suffix, MIXER=mixer[0], FFN=ffn[0], MIXER_STAGES=mixer[4])
    work = new_work(layer, recipe, 1, 1)
    region = region_template((len(work[3]), len(work[4]), len(mixer[2]), len(ffn[2])), NUM_STAGES, PROLOGUE, WHOLE,
                             (__file__, FFN_SOURCE))
    fn = instance(region, suffix, parallel=True, WORKER=worker, MIXER_PROLOGUE=mixer[1], FFN_PROLOGUE=ffn[1])
    return fn, (mixer[2], ffn[2])


@dataclass(frozen=True)
class FusedPart:
    """A part's fused implementation: takes(part) whether it runs that variant; make(backend, layer, block) ->
    (worker instance, serial prologue, arguments, name, stages); new_work(layer, part, T, W) its work arrays."""

    takes: Callable
    make: Callable
    new_work: Callable


# The fused implementations of the parts, by where they sit: a mixer part's worker returns its output, which the
# feed-forward part's worker adds to x with its own. cpu_decode_fused_ffn.register() fills FUSED_FFNS.
FUSED_MIXERS = {FullAttention: FusedPart(lambda part: part.rope in ("neox", "yarn"), fused_attention,
                                         new_attention_work)}
FUSED_FFNS = {}
FFN_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode_fused_ffn.py")  # its workers' file


def fuses(recipe):
    """Whether the fused layer implements the recipe (declared: FUSED_MIXERS, FUSED_FFNS)."""
    mixer, ffn = recipe.mixer.part, recipe.ffn.part
    return (type(mixer) in FUSED_MIXERS and FUSED_MIXERS[type(mixer)].takes(mixer)
            and type(ffn) in FUSED_FFNS and FUSED_FFNS[type(ffn)].takes(ffn))
