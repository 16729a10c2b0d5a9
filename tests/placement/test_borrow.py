"""The prefill borrow cost model: the device's own resident work counts against borrowing."""
from types import SimpleNamespace

import numpy as np

from hybrid.pair_groups import PairGroups
from placement.borrow import BorrowModel, expert_bytes, expert_flops_per_row


def make_layer(hidden=256, width=128, bytes_per_expert=3 * 40_000):
    raw = SimpleNamespace(nbytes=bytes_per_expert // 3 * 8, shape=(8,))
    tensor = SimpleNamespace(shape=(8, width, hidden), raw=raw)
    return SimpleNamespace(gate_exps=tensor, up_exps=tensor, down_exps=tensor)


def groups_of(rows):
    rows = np.asarray(rows)
    return PairGroups(np.arange(rows.sum()), np.arange(len(rows)), np.concatenate([[0], np.cumsum(rows)]))


def test_an_idle_device_borrows_more_than_a_busy_one():
    layer, groups = make_layer(), groups_of([400, 300, 200, 100, 50, 20])
    model = BorrowModel()
    model.host_flops, model.device_flops = 1e11, 1e12
    copy_speed = 1e9
    idle = ~model.plan(layer, groups, copy_speed, device_rows=0)
    busy = ~model.plan(layer, groups, copy_speed, device_rows=20_000)
    assert idle.sum() > busy.sum() >= 0
    assert idle[0] and not idle[-1]  # the most used first


def test_borrowing_never_lengthens_the_longer_side():
    rng = np.random.default_rng(3)
    layer = make_layer()
    flops = expert_flops_per_row(layer)
    for _ in range(50):
        rows = rng.integers(1, 500, size=int(rng.integers(1, 12)))
        model = BorrowModel()
        model.host_flops, model.device_flops = rng.uniform(1e10, 1e12), rng.uniform(1e11, 1e13)
        speed, device_rows = rng.uniform(1e8, 1e10), int(rng.integers(0, 5000))
        keep = model.plan(layer, groups_of(rows), speed, device_rows=device_rows)
        host = rows[keep].sum() * flops / model.host_flops
        device = device_rows * flops / model.device_flops + (~keep).sum() * expert_bytes(layer) / speed \
            + rows[~keep].sum() * flops / model.device_flops
        before = max(rows.sum() * flops / model.host_flops, device_rows * flops / model.device_flops)
        assert max(host, device) <= before * (1 + 1e-12)


def test_device_speed_is_measured_from_large_parts_only():
    layer, model = make_layer(), BorrowModel()
    start = model.device_flops
    model.measure_device(layer, 10, 1e-3)
    assert model.device_flops == start
    model.measure_device(layer, 4096, 1e-3)
    assert model.device_flops == 0.5 * start + 0.5 * 4096 * expert_flops_per_row(layer) / 1e-3
