"""A decode step's host experts (the hybrid split's CPU part) as one compiled call a layer.

In a hybrid decode step the CPU runs the token's pairs whose experts the device does not hold. The
op-by-op way (ExpertSplit's bookkeeping in NumPy, then CpuBackend.grouped_experts) costs ~20 Python
operations and five kernel calls a layer, and between layers the interpreter runs cold (its data evicted
by the layer's weights: several times a warm operation's cost, bench/results/vs_llamacpp.md). Here the
selection of the host's pairs, their order by expert, the gather, gate/up, SwiGLU, down and the weighted
sum are one call into an instance of host_experts_template over the layer's expert formats: the same
kernels on the same rows as grouped_experts, so the result is bit-identical.

Shape legend: n tokens (a decode step's), H hidden, F expert width, E experts, K top-k, N the host's pairs
(<= n * K), G their distinct experts.
"""
import operator

import numpy as np
from numba import prange

from cpu_kernels import simd, sync
from cpu_kernels.mailbox import WAIT_OK, atomic_store, wait_for
from cpu_kernels.sync import LINE, cycles

from .cpu_decode import expert_mixture, expert_mixture_template, instance, no_down_bias, swiglu_activate
from .cpu_decode_fused import format_parts


def host_experts_template(x, ids, weights, resident, gu_raws, d_raws, one_thread, act_quant):
    """(out [n, H], N): out = per token t the sum over its pairs j whose expert ids[t, j] is not resident of
    weights[t, j] * expert(x[t]); resident bool [E]. The pairs (p = t * K + j) run in expert order, stable, as
    ExpertSplit groups them: one group a distinct expert. N = 0: out is zeros."""
    num_tokens, top_k, hidden = ids.shape[0], ids.shape[1], x.shape[1]
    order = np.empty(num_tokens * top_k, dtype=np.int64)  # [n*K], the first N used: pairs by expert id
    num_pairs = 0
    for p in range(num_tokens * top_k):
        expert = ids[p // top_k, p % top_k]
        if not resident[expert]:
            i = num_pairs
            while i > 0 and ids[order[i - 1] // top_k, order[i - 1] % top_k] > expert:  # equal ids keep pair order
                order[i] = order[i - 1]
                i -= 1
            order[i] = p
            num_pairs += 1
    out = np.zeros((num_tokens, hidden), dtype=np.float32)  # [n, H]
    if num_pairs == 0:
        return out, 0
    order = order[:num_pairs]  # [N]
    expert_ids = np.empty(num_pairs, dtype=np.int64)  # [G <= N]
    row_starts = np.empty(num_pairs + 1, dtype=np.int64)  # [G + 1]
    num_groups = 0
    for i in range(num_pairs):
        expert = ids[order[i] // top_k, order[i] % top_k]
        if num_groups == 0 or expert_ids[num_groups - 1] != expert:
            expert_ids[num_groups] = expert
            row_starts[num_groups] = i
            num_groups += 1
    row_starts[num_groups] = num_pairs
    MIXTURE(x, order, expert_ids[:num_groups], row_starts[:num_groups + 1], weights, gu_raws, d_raws,  # noqa: F821
            one_thread, act_quant, (), out)  # (): SwiGLU's activation takes no arguments
    return out, num_pairs


def host_relay_template(inbox, inbox_bits, outbox, flags_in, flags_out, abort, index, seq, limit_ticks, resident,
                        gu_raws, d_raws, one_thread, act_quant, num_tokens, top_k, hidden):
    """Layer `index`'s host side of the decode relay (hybrid/relay.py): wait until flags_in[index * LINE] reaches
    seq, run the non-resident pairs of the step's n = num_tokens tokens (HOST: this plan's host experts) on
    inbox[index] f32 [n * (2K + H)] (ids [n, K] as int32 bits, read through inbox_bits, weights [n, K], x [n, H]),
    write their sums to outbox[index] f32 [n * H] and post seq on flags_out[index * LINE]. Returns (status,
    pairs, time-stamp counter ticks when the wait began, when the routing was seen, when the rows were posted);
    a wait that ends without the routing (aborted, timed out) posts nothing."""
    entered = cycles()
    status = wait_for(flags_in, index * LINE, seq, abort, limit_ticks)
    seen = cycles()
    if status != WAIT_OK:
        return status, 0, entered, seen, seen
    pairs_n = num_tokens * top_k
    ids = np.empty((num_tokens, top_k), dtype=np.int32)  # [n, K]
    weights = np.empty((num_tokens, top_k), dtype=np.float32)  # [n, K]
    for p in range(pairs_n):
        ids[p // top_k, p % top_k] = inbox_bits[index, p]
        weights[p // top_k, p % top_k] = inbox[index, pairs_n + p]
    x = np.empty((num_tokens, hidden), dtype=np.float32)  # [n, H]
    for i in range(num_tokens * hidden):
        x[i // hidden, i % hidden] = inbox[index, 2 * pairs_n + i]
    out, pairs = HOST(x, ids, weights, resident, gu_raws, d_raws, one_thread, act_quant)  # noqa: F821
    for i in range(num_tokens * hidden):
        outbox[index, i] = out[i // hidden, i % hidden]
    atomic_store(flags_out, index * LINE, seq)
    return WAIT_OK, pairs, entered, seen, cycles()


def claimed_matmul_template(raws, x, expert_ids, row_starts, outs, act_quant):
    """The format's moe_matmul (outs[k][rows of group g] = x[same rows] @ raws[k][expert_ids[g]].T for each weight k)
    with its items claimed: its serial part (PREPARE), then one parallel region whose W workers each take their
    static share of the items first and then what the others have left (cpu_kernels/sync.py take). The same items
    run the same kernel (RUN_ITEM), each output row written by one, so the result is moe_matmul's bit for bit; a
    thread that runs slow (its core shared with another busy thread) holds up only the items it claimed."""
    items, prep = PREPARE(raws, x, expert_ids, row_starts, act_quant)  # noqa: F821 (instance globals)
    num_items = items.shape[0] * len(raws)
    num_workers = simd.num_threads()
    counters = sync.new_counters(1, num_workers)
    for w in prange(num_workers):
        i, tried = sync.take(counters, 0, w, num_workers, num_items, 0)
        while i < num_items:
            RUN_ITEM(raws, x, items, prep, outs, i, act_quant)  # noqa: F821
            i, tried = sync.take(counters, 0, w, num_workers, num_items, tried)


def claimed_mixture(backend, layer, names):
    """expert_mixture_template's instance over the layer's formats with claimed_matmul as its gate+up and down
    regions, or None where gate and up are not one paired region (`names`: expert_mixture's)."""
    if names[3] != "paired" or names[4] != "swiglu":
        return None
    regions = []
    for weight, name in ((layer.gate_exps, names[0]), (layer.down_exps, names[2])):
        prepare, run_item, _ = format_parts(backend, weight)
        regions.append(instance(claimed_matmul_template, name, parallel=True, PREPARE=prepare, RUN_ITEM=run_item))
    return instance(expert_mixture_template, "_".join(names) + "_claimed", GU_PAR=regions[0], D_PAR=regions[1],
                    ACTIVATE=swiglu_activate, DOWN_BIAS=no_down_bias)


class HostExpertsPlan:
    """One layer's compiled host-experts function and its weights' raws (an instance per format pair).

    claimed: the gate+up and down regions claim their items (claimed_matmul_template) where the layer's formats
    allow it (self.claimed says whether they do), else moe_matmul's static shares."""

    def __init__(self, backend, layer, claimed=False):
        what = f"host experts of layer {layer.index}"
        if layer.up_exps.shape != layer.gate_exps.shape:
            raise ValueError(f"{what}: {layer.gate_exps.name} {layer.gate_exps.shape} and {layer.up_exps.name} "
                             f"{layer.up_exps.shape} do not fit")
        mixture, self.gu_raws, self.d_raws, names = expert_mixture(backend, layer, what)
        found = claimed_mixture(backend, layer, names) if claimed else None
        self.claimed, suffix = found is not None, "_".join(names) + ("_claimed" if found is not None else "")
        self.asked = claimed
        self.fn = instance(host_experts_template, suffix, MIXTURE=found or mixture)
        self.relay = instance(host_relay_template, suffix, HOST=self.fn)
        self.raws = tuple(w.raw for w in (layer.gate_exps, layer.up_exps, layer.down_exps))

    def current(self, layer, claimed=False):
        """Whether the layer's expert weights still hold the raws this plan was made for, and it was made with
        `claimed` asked."""
        return self.asked == claimed and all(map(operator.is_, map(_RAW, (layer.gate_exps, layer.up_exps,
                                                                           layer.down_exps)), self.raws))


_RAW = operator.attrgetter("raw")
