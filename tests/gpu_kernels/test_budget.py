"""VRAM budget and default residency (plain Python, no GPU)."""
import numpy as np
import pytest

from gpu_kernels.errors import VramError
from gpu_kernels.expert_cache import MIB, default_residency, plan


def test_default_residency_fills_layer_by_layer():
    mask = default_residency([10, 10, 20], 4, budget=10 * 4 + 10 * 2 + 9)
    assert mask.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]


def test_plan_auto_takes_what_is_left_and_reports():
    budget, mask = plan(free=1000 * MIB, total=1200 * MIB, dense=100 * MIB, kv=50 * MIB, scratch=10 * MIB,
                        reserve=40 * MIB, bytes_per_expert=[100 * MIB] * 3, num_experts=4)
    assert mask.sum() == 8 and budget.slots_resident == 8 and budget.slots_total == 12
    assert budget.expert_cache == 800 * MIB
    text = budget.describe()
    for part in ("dense weights 100 MiB", "KV 50 MiB", "expert slots 8/12", "scratch 10 MiB", "reserve 40 MiB"):
        assert part in text


def test_plan_respects_cache_size_and_placement():
    _, mask = plan(1000 * MIB, 1000 * MIB, 0, 0, 0, 0, [100 * MIB] * 2, 4, cache_bytes=250 * MIB)
    assert mask.sum() == 2
    placed = np.zeros((2, 4), bool)
    placed[1, 3] = True
    _, mask = plan(1000 * MIB, 1000 * MIB, 0, 0, 0, 0, [100 * MIB] * 2, 4, resident=placed)
    assert (mask == placed).all()


def test_vram_too_small_names_the_numbers():
    with pytest.raises(VramError, match=r"500 MiB free.*dense weights 600 MiB"):
        plan(500 * MIB, 500 * MIB, 600 * MIB, 0, 0, 0, [MIB], 4)
    with pytest.raises(VramError, match=r"resident experts.* need 800 MiB"):
        plan(500 * MIB, 500 * MIB, 0, 0, 0, 0, [200 * MIB], 4, resident=np.ones((1, 4), bool))
