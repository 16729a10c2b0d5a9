"""The expert weights page-locked in place for borrowed experts' copies (hybrid/backends/gpu_page_lock.py)."""
import gc
from types import SimpleNamespace

import numpy as np

from hybrid.backends.gpu_page_lock import PAGE_BYTES, PageLocked, lock_experts, page_ranges


class CountingRuntime:
    """A runtime that page-locks until `refuse_after` ranges, recording what is locked now."""

    def __init__(self, refuse_after=None):
        self.refuse_after, self.locked, self.calls = refuse_after, {}, 0

    def page_lock(self, address, num_bytes):
        self.calls += 1
        if self.refuse_after is not None and self.calls > self.refuse_after:
            return False
        assert address % PAGE_BYTES == 0 and num_bytes % PAGE_BYTES == 0 and address not in self.locked
        self.locked[address] = num_bytes
        return True

    def page_unlock(self, address):
        del self.locked[address]


class Owner:
    """A backend stand-in: what the locked pages live as long as."""


def make_layers(buffer, num_layers=2, shape=(4, 3, 1000)):
    """Layers whose expert tensors are back-to-back views of `buffer` (as in a mapped GGUF file)."""
    size, offset, layers = int(np.prod(shape)), 0, []
    for _ in range(num_layers):
        tensors = []
        for _ in range(3):
            tensors.append(SimpleNamespace(raw=buffer[offset:offset + size].reshape(shape)))
            offset += size
        layers.append(SimpleNamespace(gate_exps=tensors[0], up_exps=tensors[1], down_exps=tensors[2]))
    return layers


def test_page_ranges_cover_whole_pages_and_merge_neighbours():
    buffer = np.random.default_rng(0).integers(0, 255, 10 * PAGE_BYTES, dtype=np.uint8)
    a, b, far = buffer[100:5000], buffer[5000:9000], buffer[8 * PAGE_BYTES + 7: 8 * PAGE_BYTES + 9]
    ranges = page_ranges([far, b, a])
    base = buffer.ctypes.data
    assert all(lo % PAGE_BYTES == 0 and hi % PAGE_BYTES == 0 for lo, hi in ranges)
    assert ranges[0][0] <= base + 100 and base + 9000 <= ranges[0][1]  # a and b share a page: one range
    assert ranges[-1][0] <= far.ctypes.data and far.ctypes.data + 2 <= ranges[-1][1]
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(ranges, ranges[1:]))
    locked = PageLocked(ranges)
    assert locked.holds(a) and locked.holds(b) and locked.holds(far)
    assert not locked.holds(np.zeros(10, np.uint8))


def test_lock_experts_locks_every_expert_tensor_until_the_owner_goes():
    buffer = np.random.default_rng(1).integers(0, 255, 80_000, dtype=np.uint8)
    layers, rt = make_layers(buffer), CountingRuntime()
    owner = Owner()
    locked = lock_experts(rt, layers, owner)
    assert all(locked.holds(t.raw) and locked.holds(t.raw[1]) for layer in layers
               for t in (layer.gate_exps, layer.up_exps, layer.down_exps))
    assert sum(rt.locked.values()) == locked.num_bytes >= 72_000
    del owner
    gc.collect()
    assert rt.locked == {}


def test_a_refused_range_leaves_nothing_locked():
    buffer = np.random.default_rng(2).integers(0, 255, 40 * PAGE_BYTES, dtype=np.uint8)
    layers = make_layers(buffer[: 24 * PAGE_BYTES], num_layers=1, shape=(2, 2, 2 * PAGE_BYTES))  # 24 pages, a range
    spread = make_layers(buffer[30 * PAGE_BYTES:], num_layers=1, shape=(1, 1, 8))  # another range
    spread[0].gate_exps.raw = buffer[35 * PAGE_BYTES: 35 * PAGE_BYTES + 8].reshape(1, 1, 8)  # a third, apart
    rt = CountingRuntime(refuse_after=1)
    locked = lock_experts(rt, layers + spread, Owner())
    assert locked.ranges == [] and rt.locked == {} and rt.calls == 2
