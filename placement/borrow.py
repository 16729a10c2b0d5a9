"""Prefill borrow: which of a large chunk's non-resident experts the device should copy in and run.

For a chunk of many tokens, a non-resident expert many tokens use may be cheaper to copy to the device
and run there than to run on the host. The two sides run at once, so the chunk's expert time is the
longer of: the host's rows (from the host's measured expert FLOP/s), and the device's own resident rows
plus, per borrowed expert, the host's gather of its weights into the staging buffer, their copy (the
device's measured copy speed) and its rows (the device's expert FLOP/s for the layer's weight formats).
Experts are borrowed most-used first while that shortens the longer side, so a device busy with its
resident experts borrows little and an idle one borrows much. A fixed `cpu_share` (0..1) instead keeps
that share of the rows (the least-used experts) on the host.

The device's expert speed differs by weight format by more than 10x (a format with the tiled GEMM against
one without), so it is kept per format: the device's own estimate until a part of that format is timed.
Shape legend: G expert groups, H hidden, F expert width.
"""
import numpy as np

BORROW_MIN_TOKENS = 32  # chunks of fewer tokens never borrow
HOST_FLOPS_DEFAULT = 2e11  # the host's expert FLOP/s until measured
HOST_FLOPS_MIN_ROWS = 256  # host calls of at least this many pair rows update the measured speed
DEVICE_FLOPS_DEFAULT = 2e13  # the device's expert FLOP/s where it gives no estimate of its own
GATHER_BYTES_PER_SECOND_DEFAULT = 5e9  # the host's gather of borrowed experts into staging, until measured
GATHER_MIN_BYTES = 1 << 24  # gathers of at least this many bytes update the measured speed


def expert_flops_per_row(layer):
    """FLOPs of one pair row through one SwiGLU expert of `layer`."""
    hidden, width = layer.gate_exps.shape[2], layer.gate_exps.shape[1]
    return 6.0 * hidden * width  # gate, up: 2 H F each; down: 2 F H


def expert_bytes(layer):
    """Bytes of one expert of `layer` as stored (gate + up + down): what a borrow copies."""
    return sum(t.raw.nbytes // t.raw.shape[0] for t in (layer.gate_exps, layer.up_exps, layer.down_exps))


def expert_formats(layer):
    """The weight formats of `layer`'s experts (gate, up, down): what the device's expert speed depends on."""
    return tuple(getattr(t, "qtype", None) for t in (layer.gate_exps, layer.up_exps, layer.down_exps))


class BorrowModel:
    """The borrow decision of one split. host_flops: the host's expert speed, measured as it runs (`measure`);
    device_flops: {expert_formats: the device's measured expert speed} (`measure_device`); gather_bytes_per_second:
    the host's measured gather of borrowed weights; cpu_share: None for the cost model, else the share of rows kept
    on the host."""

    def __init__(self, cpu_share=None):
        if cpu_share is not None and not 0.0 <= cpu_share <= 1.0:
            raise ValueError(f"prefill CPU share {cpu_share}: expected a number from 0 to 1")
        self.cpu_share = cpu_share
        self.host_flops = HOST_FLOPS_DEFAULT
        self.device_flops = {}
        self.gather_bytes_per_second = GATHER_BYTES_PER_SECOND_DEFAULT

    def device_speed(self, layer, estimate=None):
        """The device's expert FLOP/s for layer's formats: measured, else `estimate` (the device's own)."""
        measured = self.device_flops.get(expert_formats(layer))
        return measured if measured is not None else estimate or DEVICE_FLOPS_DEFAULT

    def plan(self, layer, groups, bytes_per_second, device_rows=0, device_estimate=None):
        """keep bool [G]: True where a host group stays on the host, False where its expert is borrowed.
        bytes_per_second: the host -> device copy speed; device_rows: the pair rows the device runs anyway (its
        resident experts'); device_estimate: the device's expected FLOP/s for layer's formats, until measured."""
        rows = np.diff(groups.row_starts)  # [G]
        if self.cpu_share is not None:
            order = np.argsort(rows, kind="stable")  # least-used first
            keep = np.zeros(len(rows), dtype=bool)
            keep[order[np.cumsum(rows[order]) <= self.cpu_share * rows.sum()]] = True
            return keep
        flops, device_flops = expert_flops_per_row(layer), self.device_speed(layer, device_estimate)
        host_s = rows * flops / self.host_flops  # [G]
        fetch_s = expert_bytes(layer) * (1.0 / self.gather_bytes_per_second + 1.0 / bytes_per_second)
        device_s = fetch_s + rows * flops / device_flops  # [G] gather, copy, then run
        keep = np.ones(len(rows), dtype=bool)
        host_total, device_total = host_s.sum(), device_rows * flops / device_flops
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

    def measure_device(self, layer, num_rows, seconds, borrowed_bytes=0, gather_seconds=0.0, bytes_per_second=None):
        """Fold a device part of layer into the measured speeds: num_rows pair rows (resident and borrowed) that took
        `seconds` of the device's time from its first event to its last, of which gather_seconds went to gathering
        borrowed_bytes of borrowed weights on the host before their copies were queued, and their copy took
        borrowed_bytes / bytes_per_second. The first measurement of a format replaces the device's estimate; later
        ones are averaged in (large parts only)."""
        if borrowed_bytes >= GATHER_MIN_BYTES and gather_seconds > 0:
            self.gather_bytes_per_second = 0.5 * self.gather_bytes_per_second + 0.5 * borrowed_bytes / gather_seconds
        compute_s = seconds - gather_seconds - (borrowed_bytes / bytes_per_second if borrowed_bytes else 0.0)
        if num_rows < HOST_FLOPS_MIN_ROWS or compute_s <= 0:
            return
        speed, key = num_rows * expert_flops_per_row(layer) / compute_s, expert_formats(layer)
        self.device_flops[key] = speed if key not in self.device_flops else 0.5 * self.device_flops[key] + 0.5 * speed
