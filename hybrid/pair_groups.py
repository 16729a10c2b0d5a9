"""(token, expert) pairs grouped by expert: the unit the hybrid split divides between device and host.
Shape legend: N pairs, G experts with pairs, K experts per token."""
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

    @classmethod
    def of_slots(cls, experts, slots):
        """One token's pairs in `slots` (indices j into its experts int64 [K]), each expert its own group (a token
        routes each expert once), by expert id."""
        order = slots[np.argsort(experts[slots], kind="stable")]  # [N]
        return cls(order, experts[order], np.arange(len(order) + 1))
