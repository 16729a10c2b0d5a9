"""A decode layer as one parallel region, its ops as stages the threads meet between.

The compiled decode layer (cpu_decode.py) still opens a parallel region per op: eight a layer
(q, k, v, o, router, attention, the experts' gate+up and down), each with a serial prologue (the
rounding of x, the work split) while the other threads wait. On 16 cores a region costs 5-6 us
before any work and a meeting of the threads inside one ~2 us. Here the threads enter one region a layer and
run it as llama.cpp runs its graph: every thread does the small serial work itself (norms, the
rounding of x, the routing, the merge of attention splits: a few us, the same on every thread, so
nobody waits for it), and the item-parallel ops claim items from counters and meet when all are
done (cpu_kernels.sync). Seven meetings a layer.

Each op runs the same kernels on the same items as cpu_decode's layer; the float sums may group
differently where the compiler inlines differently, so the two agree to rounding, not bit for bit.

Shape legend: T tokens (one a sequence), H hidden, Hq / Hkv query / kv heads, G = Hq / Hkv, D head
dim, E experts, K top-k, N pairs, F expert width, P key splits, W workers (the region's iterations).
"""
import numpy as np
from numba import njit, prange

from cpu_kernels import activation, attention, moe_combine, rmsnorm, rope, routing, simd, sync

from ..arch.recipe import FullAttention, MoE, SoftmaxTopK, SwiGLU
from .cpu_decode import NO_NORM, instance

NUM_STAGES = 8
QKV, ROPE_KV, ATTEND, OUT, ROUTER, GATE_UP, DOWN, COMBINE = range(NUM_STAGES)
COMBINE_COLUMNS = 64  # output columns of a combine item
# trace columns (fused_template): per stage a worker's own work, items, wait; then its start after the call's
# first line (the serial prologue and the region's fork); then, in row 0, the call's first line to its return
# (the serial prologue alone: row 0's PROLOGUE)
START, WHOLE, PROLOGUE = 3 * NUM_STAGES, 3 * NUM_STAGES + 1, 3 * NUM_STAGES + 2
TRACE_COLUMNS = PROLOGUE + 1


def fuses(recipe):
    """Whether fused_template implements the layer recipe: it is written as one piece for attention (NeoX RoPE,
    q/k norms or none), then a MoE with softmax top-k routing and SwiGLU experts."""
    mixer, ffn = recipe.mixer.part, recipe.ffn.part
    return (type(mixer) is FullAttention and mixer.rope == "neox" and type(ffn) is MoE
            and type(ffn.router) is SoftmaxTopK and type(ffn.experts) is SwiGLU)


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


# -- the layer --------------------------------------------------------------------------------------------

@njit(nogil=True)
def _rows_of_pairs(order, rows):
    """rows [T*K]: the row of each flat pair in `order`, -1 where it has none."""
    rows[:] = -1
    for r in range(order.size):
        rows[order[r]] = r


def new_work(layer, num_tokens, num_workers):
    """The arrays a fused layer call writes besides x (fused_template's `work`), made once per batch size
    and thread count and kept (cpu_layer.CompiledRunner): allocated afresh at every call, the ~13 shared
    and ~10 per-worker arrays cost tens of us of the call's serial prologue, cold allocator state each
    time. Shapes: see the legend;
    P = the most key splits attention.num_key_splits gives, W = num_workers."""
    hidden, width, num_experts = layer.gate_exps.shape[2], layer.gate_exps.shape[1], layer.gate_exps.shape[0]
    heads, kv_heads, head_dim, top_k = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.num_experts_per_tok
    group, pairs, splits = heads // kv_heads, num_tokens * top_k, max(1, attention.TARGET_ITEMS // kv_heads)
    f32 = lambda *shape: np.empty(shape, dtype=np.float32)  # noqa: E731
    i64 = lambda *shape: np.empty(shape, dtype=np.int64)  # noqa: E731
    return (f32(num_tokens, heads * head_dim), f32(num_tokens, kv_heads * head_dim),  # q, k
            f32(num_tokens, kv_heads * head_dim),  # v
            f32(num_tokens, kv_heads, splits, group, head_dim),  # acc
            np.empty((num_tokens, kv_heads, splits, group, 2), dtype=np.float64),  # stats
            f32(num_tokens, hidden), f32(num_tokens, num_experts),  # o, router logits
            f32(pairs, width), f32(pairs, width), f32(pairs, hidden), f32(num_tokens, hidden),  # gate, up, down, moe
            i64(num_tokens), i64(num_tokens + 1),  # splits, split_starts
            sync.new_counters(NUM_STAGES, num_workers),  # counters
            np.zeros(1, dtype=np.int64), np.array([0, num_tokens], dtype=np.int64),  # one_expert, row_starts
            # per worker
            f32(num_workers, num_tokens, hidden), f32(num_workers, num_tokens, heads * head_dim),  # h, att
            f32(num_workers, num_tokens, hidden), f32(num_workers, num_tokens, hidden),  # x2, h2
            i64(num_workers, num_tokens, top_k), f32(num_workers, num_tokens, top_k),  # ids, weights
            f32(num_workers, pairs, hidden), f32(num_workers, pairs, width), i64(num_workers, pairs))  # xs, act, rows


@njit(fastmath=True, nogil=True)
def _weighted_columns(down, row_of_pair, weights, top_k, c0, c1, moe):
    """moe[t, c0:c1] (zero) += each token's weighted pair rows of down, by slot, as scatter_add_weighted
    sums them (the same fused multiply-adds in the same order)."""
    for t in range(moe.shape[0]):
        for j in range(top_k):
            i = row_of_pair[t * top_k + j]
            if i < 0:
                continue
            w = weights[t, j]
            for c in range(c0, c1):
                moe[t, c] += w * down[i, c]


@njit(nogil=True)
def _add_columns(a, b, c0, c1, out):
    """out[:, c0:c1] = a + b over those columns."""
    for t in range(out.shape[0]):
        for c in range(c0, c1):
            out[t, c] = a[t, c] + b[t, c]


def worker_template(w, num_workers, entry, x, positions, tables, k_pool, v_pool, layer_index, act_quant, trace,
                    work, ids_out, attn_norm, ffn_norm, q_norm, k_norm, eps, theta, scale32, num_heads, num_kv_heads,
                    head_dim, q_raws, k_raws, v_raws, o_raws, r_raws, g_raws, u_raws, d_raws, top_k, normalize):
    """Worker w's share of fused_template's layer: every stage, meeting the other workers between them."""
    num_tokens, hidden = x.shape
    group = num_heads // num_kv_heads
    num_experts = r_raws[0].shape[1]
    (q, k, v, acc, stats, o, logits, gate, up, down, moe, splits, split_starts, counters, one_expert, row_starts,
     h_of, att_of, x2_of, h2_of, ids_of, weights_of, xs_of, act_of, rows_of) = work
    layer_k, layer_v = k_pool[layer_index], v_pool[layer_index]  # [NB, BT, Hkv, D]
    q3 = q.reshape(num_tokens, num_heads, head_dim)  # [T, Hq, D]
    k3 = k.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    v3 = v.reshape(num_tokens, num_kv_heads, head_dim)  # [T, Hkv, D]
    t = sync.mark(trace, w, START, entry)
    # q, k, v: each thread norms x and rounds it for the three formats itself
    h = h_of[w]  # [T, H]
    rmsnorm.rmsnorm_serial(x, attn_norm, eps, h)
    q_items, q_prep = Q_PREP(q_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    k_items, k_prep = K_PREP(k_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    v_items, v_prep = V_PREP(v_raws, h, one_expert, row_starts, act_quant)  # noqa: F821
    nq, nk, nv = q_items.shape[0], k_items.shape[0], v_items.shape[0]
    done = 0
    t = sync.mark(trace, w, 3 * QKV, t)
    i, tried = sync.take(counters, QKV, w, num_workers, nq + nk + nv, 0)
    while i < nq + nk + nv:
        if i < nq:
            Q_ITEM(q_raws, h, q_items, q_prep, (q,), i, act_quant)  # noqa: F821
        elif i < nq + nk:
            K_ITEM(k_raws, h, k_items, k_prep, (k,), i - nq, act_quant)  # noqa: F821
        else:
            V_ITEM(v_raws, h, v_items, v_prep, (v,), i - nq - nk, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, QKV, w, num_workers, nq + nk + nv, tried)
    t = sync.mark(trace, w, 3 * QKV + 1, t)
    sync.finish(counters, QKV, num_workers, done, nq + nk + nv)
    t = sync.mark(trace, w, 3 * QKV + 2, t)
    # per token: q / k norms, RoPE, the K/V rows into the cache
    done = 0
    t = sync.mark(trace, w, 3 * ROPE_KV, t)
    tok, tried = sync.take(counters, ROPE_KV, w, num_workers, num_tokens, 0)
    while tok < num_tokens:
        if QK_NORM:  # noqa: F821
            q_rows, k_rows = q3[tok], k3[tok]  # [Hq, D], [Hkv, D]
            rmsnorm.rmsnorm_serial(q_rows, q_norm, eps, q_rows)
            rmsnorm.rmsnorm_serial(k_rows, k_norm, eps, k_rows)
        rope.rope_neox_serial(q3[tok:tok + 1], positions[tok:tok + 1], theta, q3[tok:tok + 1])
        rope.rope_neox_serial(k3[tok:tok + 1], positions[tok:tok + 1], theta, k3[tok:tok + 1])
        attention.write_rows(k_pool, layer_index, tables[tok], positions[tok], k3[tok:tok + 1])
        attention.write_rows(v_pool, layer_index, tables[tok], positions[tok], v3[tok:tok + 1])
        done = done + 1
        tok, tried = sync.take(counters, ROPE_KV, w, num_workers, num_tokens, tried)
    t = sync.mark(trace, w, 3 * ROPE_KV + 1, t)
    sync.finish(counters, ROPE_KV, num_workers, done, num_tokens)
    t = sync.mark(trace, w, 3 * ROPE_KV + 2, t)
    # attention: (token, kv head, key split) items, as cpu_kernels.attention splits them
    num_attend = split_starts[num_tokens]
    done = 0
    t = sync.mark(trace, w, 3 * ATTEND, t)
    i, tried = sync.take(counters, ATTEND, w, num_workers, num_attend, 0)
    while i < num_attend:
        tok = 0
        while split_starts[tok + 1] <= i:
            tok += 1
        num_splits, rank = splits[tok], i - split_starts[tok]
        kv, s = rank // num_splits, rank % num_splits
        num_keys = positions[tok] + 1
        j0, j1 = s * num_keys // num_splits, (s + 1) * num_keys // num_splits
        if j1 > j0:
            attention._partial(q3, layer_k, layer_v, attention.NO_SCALES, attention.NO_SCALES, tables[tok], tok,
                               kv, j0, j1, scale32, acc[tok, kv, s], stats[tok, kv, s])
        else:
            stats[tok, kv, s, :, 1] = 0.0
        done = done + 1
        i, tried = sync.take(counters, ATTEND, w, num_workers, num_attend, tried)
    t = sync.mark(trace, w, 3 * ATTEND + 1, t)
    sync.finish(counters, ATTEND, num_workers, done, num_attend)
    t = sync.mark(trace, w, 3 * ATTEND + 2, t)
    # o: each thread merges the splits itself (a few us), then the rows are shared out
    att = att_of[w]  # [T, Hq*D]
    for tok in range(num_tokens):
        for head in range(num_heads):
            attention._merge(acc[tok, head // group, :splits[tok], head % group],
                             stats[tok, head // group, :splits[tok], head % group],
                             att[tok, head * head_dim:(head + 1) * head_dim])
    o_items, o_prep = O_PREP(o_raws, att, one_expert, row_starts, act_quant)  # noqa: F821
    done = 0
    t = sync.mark(trace, w, 3 * OUT, t)
    i, tried = sync.take(counters, OUT, w, num_workers, o_items.shape[0], 0)
    while i < o_items.shape[0]:
        O_ITEM(o_raws, att, o_items, o_prep, (o,), i, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, OUT, w, num_workers, o_items.shape[0], tried)
    t = sync.mark(trace, w, 3 * OUT + 1, t)
    sync.finish(counters, OUT, num_workers, done, o_items.shape[0])
    t = sync.mark(trace, w, 3 * OUT + 2, t)
    # router: x + o and its norm stay on each thread until the combine writes x
    x2, h2 = x2_of[w], h2_of[w]  # [T, H] each
    _add_columns(x, o, 0, hidden, x2)
    rmsnorm.rmsnorm_serial(x2, ffn_norm, eps, h2)
    r_items, r_prep = R_PREP(r_raws, h2, one_expert, row_starts, act_quant)  # noqa: F821
    done = 0
    t = sync.mark(trace, w, 3 * ROUTER, t)
    i, tried = sync.take(counters, ROUTER, w, num_workers, r_items.shape[0], 0)
    while i < r_items.shape[0]:
        R_ITEM(r_raws, h2, r_items, r_prep, (logits,), i, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, ROUTER, w, num_workers, r_items.shape[0], tried)
    t = sync.mark(trace, w, 3 * ROUTER + 1, t)
    sync.finish(counters, ROUTER, num_workers, done, r_items.shape[0])
    t = sync.mark(trace, w, 3 * ROUTER + 2, t)
    # experts: each thread routes, groups and rounds the pair rows itself
    ids, weights = ids_of[w], weights_of[w]  # [T, K] each
    routing.route_softmax_topk_serial(logits, top_k, normalize, ids, weights)
    order, expert_ids, pair_starts = routing.group_by_expert(ids, num_experts)
    xs = xs_of[w]  # [N, H]
    moe_combine.gather_rows_serial(h2, order, top_k, xs)
    if GU_PAIRED:  # noqa: F821: one prepare, the items over both weights
        gu_raws = g_raws + u_raws
        gu_items, gu_prep = G_PREP(gu_raws, xs, expert_ids, pair_starts, act_quant)  # noqa: F821
        n_gu = 2 * gu_items.shape[0]
        done = 0
        t = sync.mark(trace, w, 3 * GATE_UP, t)
        i, tried = sync.take(counters, GATE_UP, w, num_workers, n_gu, 0)
        while i < n_gu:
            G_ITEM(gu_raws, xs, gu_items, gu_prep, (gate, up), i, act_quant)  # noqa: F821
            done = done + 1
            i, tried = sync.take(counters, GATE_UP, w, num_workers, n_gu, tried)
    else:
        g_items, g_prep = G_PREP(g_raws, xs, expert_ids, pair_starts, act_quant)  # noqa: F821
        u_items, u_prep = U_PREP(u_raws, xs, expert_ids, pair_starts, act_quant)  # noqa: F821
        ng = g_items.shape[0]
        n_gu = ng + u_items.shape[0]
        done = 0
        t = sync.mark(trace, w, 3 * GATE_UP, t)
        i, tried = sync.take(counters, GATE_UP, w, num_workers, n_gu, 0)
        while i < n_gu:
            if i < ng:
                G_ITEM(g_raws, xs, g_items, g_prep, (gate,), i, act_quant)  # noqa: F821
            else:
                U_ITEM(u_raws, xs, u_items, u_prep, (up,), i - ng, act_quant)  # noqa: F821
            done = done + 1
            i, tried = sync.take(counters, GATE_UP, w, num_workers, n_gu, tried)
    t = sync.mark(trace, w, 3 * GATE_UP + 1, t)
    sync.finish(counters, GATE_UP, num_workers, done, n_gu)
    t = sync.mark(trace, w, 3 * GATE_UP + 2, t)
    act = act_of[w]  # [N, F]
    activation.swiglu_serial(gate, up, act)
    d_items, d_prep = D_PREP(d_raws, act, expert_ids, pair_starts, act_quant)  # noqa: F821
    done = 0
    t = sync.mark(trace, w, 3 * DOWN, t)
    i, tried = sync.take(counters, DOWN, w, num_workers, d_items.shape[0], 0)
    while i < d_items.shape[0]:
        D_ITEM(d_raws, act, d_items, d_prep, (down,), i, act_quant)  # noqa: F821
        done = done + 1
        i, tried = sync.take(counters, DOWN, w, num_workers, d_items.shape[0], tried)
    t = sync.mark(trace, w, 3 * DOWN + 1, t)
    sync.finish(counters, DOWN, num_workers, done, d_items.shape[0])
    t = sync.mark(trace, w, 3 * DOWN + 2, t)
    # combine: column ranges of x, each from this thread's x + o and the weighted pair rows
    row_of_pair = rows_of[w]  # [T*K]
    _rows_of_pairs(order, row_of_pair)
    num_chunks = (hidden + COMBINE_COLUMNS - 1) // COMBINE_COLUMNS
    t = sync.mark(trace, w, 3 * COMBINE, t)
    i, tried = sync.take(counters, COMBINE, w, num_workers, num_chunks, 0)
    while i < num_chunks:
        if i == 0:
            ids_out[:] = ids
        c0, c1 = i * COMBINE_COLUMNS, min(hidden, (i + 1) * COMBINE_COLUMNS)
        _weighted_columns(down, row_of_pair, weights, top_k, c0, c1, moe)
        _add_columns(x2, moe, c0, c1, x)
        i, tried = sync.take(counters, COMBINE, w, num_workers, num_chunks, tried)
    t = sync.mark(trace, w, 3 * COMBINE + 1, t)


def fused_template(x, positions, tables, k_pool, v_pool, layer_index, act_quant, trace, work,
                   attn_norm, ffn_norm, q_norm, k_norm, eps, theta, scale, num_heads, num_kv_heads, head_dim,
                   q_raws, k_raws, v_raws, o_raws, r_raws, g_raws, u_raws, d_raws, top_k, normalize):
    """x [T, H] += attention block, then += MoE block, as cpu_decode.layer_template, in one parallel
    region. Returns the routing ids int64 [T, K]. trace int64 [W, TRACE_COLUMNS] (zero rows: no profile)
    gains each worker's ticks per stage (its own serial work, its items, its wait for the others), and
    those of the region's start and of the whole call. work: new_work's arrays for this batch size and
    thread count. The region's body is one call of the worker (worker_template): Numba's parfor passes over
    the whole body inline were most of this layer's compile time."""
    entry = sync.cycles() if trace.shape[0] else 0
    num_tokens = x.shape[0]
    (q, k, v, acc, stats, o, logits, gate, up, down, moe, splits, split_starts, counters, one_expert, row_starts,
     h_of, att_of, x2_of, h2_of, ids_of, weights_of, xs_of, act_of, rows_of) = work
    num_workers = simd.num_threads()
    if h_of.shape[0] < num_workers or q.shape[0] != num_tokens:
        raise ValueError("fused decode layer: work arrays made for another batch size or thread count")
    for tt in range(num_tokens):
        splits[tt] = attention.num_key_splits(num_kv_heads, positions[tt] + 1)
    split_starts[0] = 0
    for tt in range(num_tokens):
        split_starts[tt + 1] = split_starts[tt] + num_kv_heads * splits[tt]
    moe[:] = 0.0
    counters[:NUM_STAGES * (num_workers + 1) * sync.LINE] = 0
    ids_out = np.empty((num_tokens, top_k), dtype=np.int64)  # [T, K]: returned, so not a work array
    scale32 = np.float32(scale)
    if trace.shape[0]:
        trace[0, PROLOGUE] += sync.cycles() - entry
    # the work tuple is rebuilt inside the region: handed in as one tuple, its arrays gave wrong layers
    for w in prange(num_workers):
        WORKER(np.int64(w), num_workers, entry, x, positions, tables, k_pool, v_pool,  # noqa: F821
               layer_index, act_quant, trace,
               (q, k, v, acc, stats, o, logits, gate, up, down, moe, splits, split_starts, counters, one_expert,
                row_starts, h_of, att_of, x2_of, h2_of, ids_of, weights_of, xs_of, act_of, rows_of),
               ids_out, attn_norm, ffn_norm, q_norm, k_norm, eps, theta, scale32, num_heads, num_kv_heads, head_dim,
               q_raws, k_raws, v_raws, o_raws, r_raws, g_raws, u_raws, d_raws, top_k, normalize)
    if trace.shape[0]:
        trace[0, WHOLE] += sync.cycles() - entry
    return ids_out


def fused_layer(backend, layer, recipe):
    """(the layer's fused instance, its arguments after fused_template's `work`)."""
    kernels, raws = {}, []
    for key, weight in (("Q", layer.attn_q), ("K", layer.attn_k), ("V", layer.attn_v), ("O", layer.attn_output),
                        ("R", layer.router), ("G", layer.gate_exps), ("U", layer.up_exps), ("D", layer.down_exps)):
        prepare, run_item, weight_raws = format_parts(backend, weight)
        kernels.update({f"{key}_PREP": prepare, f"{key}_ITEM": run_item})
        raws.append(weight_raws)
    gate, up = layer.gate_exps, layer.up_exps
    paired = (up.qtype == gate.qtype and up.raw.shape == gate.raw.shape and up.raw.flags.writeable == gate.raw.flags.writeable)
    names = [backend._kernels_of(w).fmt.__name__.rsplit(".", 1)[-1]
             for w in (layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_output, layer.router, gate, up, layer.down_exps)]
    qk_norm = recipe.mixer.part.qk_norm
    suffix = "_".join(names + ["paired" if paired else "split", "qknorm" if qk_norm else "plain"])
    worker = instance(worker_template, suffix, QK_NORM=qk_norm, GU_PAIRED=paired, **kernels)
    q_norm, k_norm = (layer.attn_q_norm, layer.attn_k_norm) if qk_norm else (NO_NORM, NO_NORM)
    args = (getattr(layer, recipe.mixer.norm), getattr(layer, recipe.ffn.norm), q_norm, k_norm, float(layer.eps),
            float(layer.rope_theta), float(1.0 / np.sqrt(layer.head_dim)), layer.num_heads, layer.num_kv_heads,
            layer.head_dim) + tuple(raws) + (layer.num_experts_per_tok, bool(layer.norm_topk_prob))
    return instance(fused_template, suffix, parallel=True, WORKER=worker), args
