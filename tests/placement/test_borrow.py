"""The prefill borrow cost model: the device's own resident work counts against borrowing; the device's speed is
kept per weight format, its estimate until measured."""
from types import SimpleNamespace

import numpy as np

from hybrid.pair_groups import PairGroups
from placement.borrow import DEVICE_FLOPS_DEFAULT, BorrowModel, expert_bytes, expert_flops_per_row


def make_layer(hidden=256, width=128, bytes_per_expert=3 * 40_000, qtype=12):
    raw = SimpleNamespace(nbytes=bytes_per_expert // 3 * 8, shape=(8,))
    tensor = SimpleNamespace(shape=(8, width, hidden), raw=raw, qtype=qtype)
    return SimpleNamespace(gate_exps=tensor, up_exps=tensor, down_exps=tensor)


def groups_of(rows):
    rows = np.asarray(rows)
    return PairGroups(np.arange(rows.sum()), np.arange(len(rows)), np.concatenate([[0], np.cumsum(rows)]))


def test_an_idle_device_borrows_more_than_a_busy_one():
    layer, groups = make_layer(), groups_of([400, 300, 200, 100, 50, 20])
    model = BorrowModel()
    model.host_flops, model.gather_bytes_per_second = 1e11, 1e12
    copy_speed = 1e9
    idle = ~model.plan(layer, groups, copy_speed, device_rows=0, device_estimate=1e12)
    busy = ~model.plan(layer, groups, copy_speed, device_rows=20_000, device_estimate=1e12)
    assert idle.sum() > busy.sum() >= 0
    assert idle[0] and not idle[-1]  # the most used first


def test_borrowing_never_lengthens_the_longer_side():
    rng = np.random.default_rng(3)
    layer = make_layer()
    flops = expert_flops_per_row(layer)
    for _ in range(50):
        rows = rng.integers(1, 500, size=int(rng.integers(1, 12)))
        model = BorrowModel()
        model.host_flops, device_flops = rng.uniform(1e10, 1e12), rng.uniform(1e11, 1e13)
        model.gather_bytes_per_second = rng.uniform(1e9, 1e10)
        speed, device_rows = rng.uniform(1e8, 1e10), int(rng.integers(0, 5000))
        keep = model.plan(layer, groups_of(rows), speed, device_rows=device_rows, device_estimate=device_flops)
        host = rows[keep].sum() * flops / model.host_flops
        fetch = expert_bytes(layer) * (1 / model.gather_bytes_per_second + 1 / speed)
        device = device_rows * flops / device_flops + (~keep).sum() * fetch + rows[~keep].sum() * flops / device_flops
        before = max(rows.sum() * flops / model.host_flops, device_rows * flops / device_flops)
        assert max(host, device) <= before * (1 + 1e-12)


def test_device_speed_is_measured_per_format_from_large_parts_only():
    layer, model = make_layer(), BorrowModel()
    assert model.device_speed(layer) == DEVICE_FLOPS_DEFAULT
    assert model.device_speed(layer, 3e12) == 3e12  # the device's estimate until measured
    model.measure_device(layer, 10, 1e-3)
    assert model.device_speed(layer, 3e12) == 3e12
    first = 4096 * expert_flops_per_row(layer) / 1e-3
    model.measure_device(layer, 4096, 1e-3)
    assert model.device_speed(layer, 3e12) == first  # the first measurement replaces the estimate
    model.measure_device(layer, 4096, 2e-3)
    assert model.device_speed(layer) == 0.5 * first + 0.25 * first
    other = make_layer(qtype=39)  # another weight format keeps its own estimate
    assert model.device_speed(other, 3e11) == 3e11


def test_a_part_with_borrowed_experts_is_measured_net_of_gather_and_copy():
    """A device part with borrowed experts: the gather's time gives the gather speed, and the part's time less
    the gather and the copy gives the device's expert speed."""
    layer, model = make_layer(), BorrowModel()
    borrowed_bytes, copy_speed = 1 << 26, 1e10
    gather_s, run_s = borrowed_bytes / 4e9, 2e-3
    model.measure_device(layer, 8192, gather_s + borrowed_bytes / copy_speed + run_s, borrowed_bytes, gather_s,
                         copy_speed)
    assert model.gather_bytes_per_second == 0.5 * 5e9 + 0.5 * 4e9
    assert np.isclose(model.device_speed(layer), 8192 * expert_flops_per_row(layer) / run_s)


def test_a_slow_format_measured_once_stops_the_borrowing():
    """An estimate 100x too fast borrows; once one part shows the real speed, the same chunk borrows nothing."""
    layer, groups = make_layer(), groups_of([400, 300, 200, 100])
    model = BorrowModel()
    model.host_flops, model.gather_bytes_per_second = 1e11, 1e12
    assert not model.plan(layer, groups, 1e12, device_rows=2000, device_estimate=1e13).all()
    model.measure_device(layer, 2000, 2000 * expert_flops_per_row(layer) / 1e11)  # as fast as the host
    assert model.plan(layer, groups, 1e12, device_rows=2000, device_estimate=1e13).all()
