"""The MoE block, written once: route (top-k), run the chosen experts, combine.

With an `ExpertSplit`, each (token, expert) pair runs where its expert lives: pairs of resident
experts as one grouped launch on the device backend, the others on the host backend at the
same time (submit, run the host part, wait, combine).
Shape legend: T tokens, H hidden, E experts, K experts per token, N pairs, G experts with pairs.
"""
from dataclasses import dataclass

import numpy as np


@dataclass
class PairGroups:
    """(token, expert) pairs sorted by expert: pair order[i] = t * K + j; group g holds rows
    row_starts[g]:row_starts[g+1], all of expert expert_ids[g]."""

    order: np.ndarray  # int64 [N]
    expert_ids: np.ndarray  # int64 [G]
    row_starts: np.ndarray  # int64 [G+1]

    def __iter__(self):
        return iter((self.order, self.expert_ids, self.row_starts))

    @property
    def num_groups(self):
        return len(self.expert_ids)

    def select(self, keep):
        """The groups where keep bool [G] is set, rows renumbered from 0."""
        sizes = np.diff(self.row_starts)[keep]  # [G']
        rows = np.repeat(keep, np.diff(self.row_starts))  # [N]
        return PairGroups(self.order[rows], self.expert_ids[keep], np.concatenate([[0], np.cumsum(sizes)]))


class ExpertSplit:
    """Runs each layer's pairs on `device` (resident experts) and `host` (the rest) at once.

    resident: bool [L, E], the experts the device holds.
    """

    def __init__(self, host, resident):
        self.host, self.resident = host, np.asarray(resident, dtype=bool)

    def run(self, device, layer, h, ids, weights):
        ids_host = device.to_host(ids).astype(np.int64, copy=False)  # [T, K]
        weights_host = device.to_host(weights)  # [T, K]
        groups = PairGroups(*self.host.group_pairs(ids_host, self.resident.shape[1]))
        on_device = self.resident[layer.index][groups.expert_ids]  # [G]
        device_groups, host_groups = groups.select(on_device), groups.select(~on_device)
        x_host = device.to_host(h) if host_groups.num_groups else None  # [T, H], before the device work queues
        pending = device.submit_experts(layer, h, ids, weights, device_groups) if device_groups.num_groups else None
        host_out = None
        if host_groups.num_groups:
            host_out = self.host.grouped_experts(x_host, weights_host, host_groups, layer.gate_exps,
                                                 layer.up_exps, layer.down_exps)  # [T, H]
        out = device.wait_experts(pending) if pending is not None else device.zeros_like(h)  # [T, H]
        if host_out is not None:
            out = device.add_from_host(out, host_out)
        return out


def moe_block(backend, spec, layer, h, split=None, usage=None):
    """h [T, H] (normed hidden) -> expert mixture [T, H]; `usage`: an ExpertUsage that records the routing."""
    router_logits = backend.linear(layer.router, h)  # [T, E]
    ids, weights = backend.route(router_logits, layer.num_experts_per_tok, layer.norm_topk_prob)  # [T, K]
    if usage is not None:
        usage.record(layer.index, backend.to_host(ids))
    if split is None:
        return backend.experts(h, ids, weights, layer.gate_exps, layer.up_exps, layer.down_exps)  # [T, H]
    return split.run(backend, layer, h, ids, weights)
