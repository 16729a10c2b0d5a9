"""A decode token's host experts (the hybrid split's CPU part) as one compiled call a layer.

In a hybrid decode step the CPU runs the token's pairs whose experts the device does not hold. The
op-by-op way (ExpertSplit's bookkeeping in NumPy, then CpuBackend.grouped_experts) costs ~20 Python
operations and five kernel calls a layer, and between layers the interpreter runs cold (its data evicted
by the layer's weights: ~4x a warm operation's cost, bench/results/vs_llamacpp.md, session 21). Here the
selection of the host's pairs, their order by expert, the gather, gate/up, SwiGLU, down and the weighted
sum are one call into an instance of host_experts_template over the layer's expert formats: the same
kernels on the same rows as grouped_experts, so the result is bit-identical.

Shape legend: H hidden, F expert width, E experts, K top-k, N the host's pairs (<= K).
"""
import operator

import numpy as np

from cpu_kernels.mailbox import WAIT_OK, atomic_store, wait_for
from cpu_kernels.sync import LINE, cycles

from .cpu_decode import expert_mixture, instance


def host_experts_template(x, ids, weights, resident, gu_raws, d_raws, one_thread, act_quant):
    """(out [1, H], N): out = the sum over the token's pairs j whose expert ids[0, j] is not resident of
    weights[0, j] * expert(x [1, H]); resident bool [E]. The pairs run in expert order (stable), as
    ExpertSplit groups them. N = 0: out is zeros."""
    top_k, hidden = ids.shape[1], x.shape[1]
    order = np.empty(top_k, dtype=np.int64)  # [K], the first N used: pair slots by expert id
    num_pairs = 0
    for j in range(top_k):
        if not resident[ids[0, j]]:
            i = num_pairs
            while i > 0 and ids[0, order[i - 1]] > ids[0, j]:  # insertion keeps equal ids in slot order
                order[i] = order[i - 1]
                i -= 1
            order[i] = j
            num_pairs += 1
    out = np.zeros((1, hidden), dtype=np.float32)  # [1, H]
    if num_pairs == 0:
        return out, 0
    order = order[:num_pairs]  # [N]
    expert_ids = np.empty(num_pairs, dtype=np.int64)  # [N]: one pair an expert (a token routes each once)
    for i in range(num_pairs):
        expert_ids[i] = ids[0, order[i]]
    row_starts = np.arange(num_pairs + 1)  # [N + 1]
    MIXTURE(x, order, expert_ids, row_starts, weights, gu_raws, d_raws, one_thread, act_quant, out)  # noqa: F821
    return out, num_pairs


def host_relay_template(inbox, inbox_bits, outbox, flags_in, flags_out, abort, index, seq, limit_ticks, resident,
                        gu_raws, d_raws, one_thread, act_quant):
    """Layer `index`'s host side of the decode relay (hybrid/relay.py): wait until flags_in[index * LINE] reaches
    seq, run the token's non-resident pairs (HOST: this plan's host experts) on inbox[index] f32 [2K + H] (ids
    [K] as int32 bits, read through inbox_bits, weights [K], x [H]), write their sum to outbox[index] f32 [H]
    and post seq on flags_out[index * LINE]. Returns (status, pairs, ticks when the routing was seen, ticks
    when the rows were posted); a wait that ends without the routing (aborted, timed out) posts nothing."""
    status = wait_for(flags_in, index * LINE, seq, abort, limit_ticks)
    seen = cycles()
    if status != WAIT_OK:
        return status, 0, seen, seen
    hidden = outbox.shape[1]
    top_k = (inbox.shape[1] - hidden) // 2
    ids = np.empty((1, top_k), dtype=np.int32)  # [1, K]
    weights = np.empty((1, top_k), dtype=np.float32)  # [1, K]
    for j in range(top_k):
        ids[0, j] = inbox_bits[index, j]
        weights[0, j] = inbox[index, top_k + j]
    x = np.empty((1, hidden), dtype=np.float32)  # [1, H]
    for d in range(hidden):
        x[0, d] = inbox[index, 2 * top_k + d]
    out, pairs = HOST(x, ids, weights, resident, gu_raws, d_raws, one_thread, act_quant)  # noqa: F821
    for d in range(hidden):
        outbox[index, d] = out[0, d]
    atomic_store(flags_out, index * LINE, seq)
    return WAIT_OK, pairs, seen, cycles()


class HostExpertsPlan:
    """One layer's compiled host-experts function and its weights' raws (an instance per format pair)."""

    def __init__(self, backend, layer):
        what = f"host experts of layer {layer.index}"
        if layer.up_exps.shape != layer.gate_exps.shape:
            raise ValueError(f"{what}: {layer.gate_exps.name} {layer.gate_exps.shape} and {layer.up_exps.name} "
                             f"{layer.up_exps.shape} do not fit")
        mixture, self.gu_raws, self.d_raws, names = expert_mixture(backend, layer, what)
        self.fn = instance(host_experts_template, "_".join(names), MIXTURE=mixture)
        self.relay = instance(host_relay_template, "_".join(names), HOST=self.fn)
        self.raws = tuple(w.raw for w in (layer.gate_exps, layer.up_exps, layer.down_exps))

    def current(self, layer):
        """Whether the layer's expert weights still hold the raws this plan was made for."""
        return all(map(operator.is_, map(_RAW, (layer.gate_exps, layer.up_exps, layer.down_exps)), self.raws))


_RAW = operator.attrgetter("raw")
