"""Prefill borrow: which of a large chunk's non-resident experts the device should copy in and run.

For a chunk of many tokens, a non-resident expert many tokens use may be cheaper to copy to the device
and run there than to run on the host. The two sides run at once, so the chunk's expert time is the
longer of: the host's rows (from the host's measured expert FLOP/s), and the device's own resident rows
plus, per borrowed expert, the copy of its weights (the device's measured copy speed) and its rows (the
device's measured expert FLOP/s). Experts are borrowed most-used first while that shortens the longer
side, so a device busy with its resident experts borrows little and an idle one borrows much. A fixed
`cpu_share` (0..1) instead keeps that share of the rows (the least-used experts) on the host.
Shape legend: G expert groups, H hidden, F expert width.
"""
import numpy as np

BORROW_MIN_TOKENS = 32  # chunks of fewer tokens never borrow
HOST_FLOPS_DEFAULT = 2e11  # the host's expert FLOP/s until measured
HOST_FLOPS_MIN_ROWS = 256  # host calls of at least this many pair rows update the measured speed
DEVICE_FLOPS_DEFAULT = 2e13  # the device's expert FLOP/s until measured
DEVICE_MIN_WAIT_S = 2e-4  # a device part is timed only when the caller waited this long for it


def expert_flops_per_row(layer):
    """FLOPs of one pair row through one SwiGLU expert of `layer`."""
    hidden, width = layer.gate_exps.shape[2], layer.gate_exps.shape[1]
    return 6.0 * hidden * width  # gate, up: 2 H F each; down: 2 F H


def expert_bytes(layer):
    """Bytes of one expert of `layer` as stored (gate + up + down): what a borrow copies."""
    return sum(t.raw.nbytes // t.raw.shape[0] for t in (layer.gate_exps, layer.up_exps, layer.down_exps))


class BorrowModel:
    """The borrow decision of one split. host_flops: the host's expert speed, measured as it runs (`measure`);
    cpu_share: None for the cost model, else the share of rows kept on the host."""

    def __init__(self, cpu_share=None):
        if cpu_share is not None and not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"prefill CPU share {cpu_share}: expected a number from 0 to 1")
        self.cpu_share = cpu_share
        self.host_flops = HOST_FLOPS_DEFAULT
        self.device_flops = DEVICE_FLOPS_DEFAULT

    def plan(self, layer, groups, bytes_per_second, device_rows=0):
        """keep bool [G]: True where a host group stays on the host, False where its expert is borrowed.
        device_rows: the pair rows the device runs anyway (its resident experts')."""
        rows = np.diff(groups.row_starts)  # [G]
        if self.cpu_share is not None:
            order = np.argsort(rows, kind="stable")  # least-used first
            keep = np.zeros(len(rows), dtype=bool)
            keep[order[np.cumsum(rows[order]) <= self.cpu_share * rows.sum()]] = True
            return keep
        flops = expert_flops_per_row(layer)
        host_s = rows * flops / self.host_flops  # [G]
        device_s = expert_bytes(layer) / bytes_per_second + rows * flops / self.device_flops  # [G] copy, then run
        keep = np.ones(len(rows), dtype=bool)
        host_total, device_total = host_s.sum(), device_rows * flops / self.device_flops
        for g in np.argsort(-rows, kind="stable"):  # most-used first: the largest gain per copy
            if max(host_total - host_s[g], device_total + device_s[g]) >= max(host_total, device_total):
                break
            keep[g] = False
            host_total, device_total = host_total - host_s[g], device_total + device_s[g]
        return keep

    def measure(self, layer, num_rows, seconds):
        """Fold a host call of num_rows pair rows that took `seconds` into host_flops (large calls only)."""
        if num_rows >= HOST_FLOPS_MIN_ROWS and seconds > 0:
            self.host_flops = 0.5 * self.host_flops + 0.5 * num_rows * expert_flops_per_row(layer) / seconds

    def measure_device(self, layer, num_rows, seconds):
        """Fold a device part of num_rows pair rows (no borrowed experts) that took `seconds` from its submission
        into device_flops (large parts only)."""
        if num_rows >= HOST_FLOPS_MIN_ROWS and seconds > 0:
            self.device_flops = 0.5 * self.device_flops + 0.5 * num_rows * expert_flops_per_row(layer) / seconds
