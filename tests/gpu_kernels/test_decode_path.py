"""The one-token expert path's own kernels on the GPU: tiles from the device-held routing, and the
expert matmul that skips the tiles of non-resident pairs."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hybrid.formats.synthetic import encode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k,num_experts", [(2, 8), (8, 128)])
def test_decode_tiles(runtime, kernels, reference_kernels, k, num_experts):
    rng = np.random.default_rng(k)
    ids = rng.choice(num_experts, size=(1, k), replace=False).astype(np.int32)  # [1, K]
    slot_map = np.full(num_experts, -1, np.int32)  # [E]
    resident = rng.choice(num_experts, size=num_experts // 2, replace=False)
    slot_map[resident] = rng.permutation(len(resident)).astype(np.int32)
    tiles = runtime.zeros((4, k), np.int32)
    kernels.decode_tiles(runtime.to_device(ids), runtime.to_device(slot_map), tiles)
    ref = np.zeros((4, k), np.int32)
    reference_kernels.decode_tiles(ids, slot_map, ref)
    np.testing.assert_array_equal(runtime.to_host(tiles), ref)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_moe_matmul_skips_tiles_without_rows(runtime, kernels, reference_kernels, qtype):
    """count 0 tiles (non-resident pairs) leave their output rows as they were."""
    rng = np.random.default_rng(int(qtype))
    slots, rows, cols, k = 4, 96, 512, 6
    raw = encode("w", rng.standard_normal((slots, rows, cols)).astype(np.float32), qtype, rng).raw  # [S, R, B]
    x = rng.standard_normal((k, cols)).astype(np.float32)  # [K, C]
    tile_slot = np.array([3, 0, 1, 0, 2, 0], np.int32)
    tile_count = np.array([1, 0, 1, 0, 1, 1], np.int32)
    tile_row = np.arange(k, dtype=np.int32)
    before = rng.standard_normal((k, rows)).astype(np.float32)
    out = runtime.to_device(before)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out, runtime.to_device(tile_slot),
                       runtime.to_device(tile_row), runtime.to_device(tile_count), 1)
    ref = before.copy()
    reference_kernels.moe_matmul(raw, qtype, x, ref, tile_slot, tile_row, tile_count)
    got = runtime.to_host(out)
    np.testing.assert_array_equal(got[tile_count == 0], before[tile_count == 0])
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5


def test_add_into(runtime, kernels):
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((3, 1000)).astype(np.float32) for _ in range(2))
    out = runtime.to_device(a)
    kernels.add_into(out, runtime.to_device(b))
    np.testing.assert_array_equal(runtime.to_host(out), a + b)
