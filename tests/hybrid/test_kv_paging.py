"""Paged KV: sequences share one pool of blocks, grow without copying what they hold, give blocks back
when cut or dropped; a pool with a limit refuses with an error that names the budget."""
import gc

import numpy as np
import pytest

from hybrid.errors import RequestError
from hybrid.host_memory import host_array
from hybrid.kv_cache import BLOCK_TOKENS, KVPool, SequenceKV

L, HKV, D = 2, 2, 16


def rows(rng, n):
    return [rng.standard_normal((L, n, HKV, D)).astype(np.float32) for _ in range(2)]


@pytest.mark.parametrize("dtype,tol", [("f32", 0), ("f16", 1e-3), ("bf16", 8e-3), ("int8", 8e-3)])
def test_interleaved_sequences_keep_their_rows(dtype, tol):
    """Two sequences growing in turns get interleaved blocks; each reads back its own rows."""
    rng = np.random.default_rng(0)
    pool = KVPool(L, HKV, D, dtype, num_blocks=2)
    seqs = [SequenceKV(pool, 1000) for _ in range(2)]
    want = [rows(rng, 300) for _ in seqs]
    steps = ((0, 5), (5, 70), (70, 200), (200, 255), (255, 256), (256, 257), (257, 300))  # one-row steps at a block edge
    for lo, hi in steps:  # starts inside blocks, growing the pool
        for seq, (k, v) in zip(seqs, want):
            seq.reserve(hi)
            for layer in range(L):
                seq.write(layer, lo, k[layer, lo:hi], v[layer, lo:hi])
            seq.commit(hi)
    assert pool.num_blocks >= 2 * 300 // BLOCK_TOKENS
    assert sorted(seqs[0].blocks + seqs[1].blocks) == sorted(set(seqs[0].blocks + seqs[1].blocks))  # no sharing
    for seq, (k, v) in zip(seqs, want):
        k_out, v_out = seq.export(300)
        np.testing.assert_allclose(k_out, k, rtol=0, atol=tol * np.abs(k).max())
        np.testing.assert_allclose(v_out, v, rtol=0, atol=tol * np.abs(v).max())


def test_blocks_go_back_when_cut_or_dropped():
    pool = KVPool(L, HKV, D, num_blocks=8, max_blocks=8)
    seq = SequenceKV(pool, 8 * BLOCK_TOKENS)
    seq.reserve(5 * BLOCK_TOKENS)
    seq.commit(5 * BLOCK_TOKENS)
    assert pool.blocks_free == 3
    seq.truncate(BLOCK_TOKENS + 1)  # keeps two blocks: the second holds one position
    assert pool.blocks_free == 6 and seq.length == BLOCK_TOKENS + 1
    other = SequenceKV(pool, 8 * BLOCK_TOKENS)
    other.reserve(6 * BLOCK_TOKENS)
    assert pool.blocks_free == 0
    del other
    gc.collect()
    assert pool.blocks_free == 6


def test_load_replaces_what_a_sequence_held():
    rng = np.random.default_rng(1)
    pool = KVPool(L, HKV, D, num_blocks=4)
    seq = SequenceKV(pool, 1000)
    seq.load(*rows(rng, 200))
    k, v = rows(rng, 70)
    seq.load(k, v)
    assert seq.length == 70 and len(seq.blocks) == 2 and pool.blocks_free == pool.num_blocks - 2
    np.testing.assert_array_equal(seq.export(70)[0], k)


def test_limited_pool_refuses_with_the_budget():
    pool = KVPool(L, HKV, D, num_blocks=4, max_blocks=4)
    seq = SequenceKV(pool, 10_000)
    seq.reserve(3 * BLOCK_TOKENS)
    with pytest.raises(RequestError, match=r"KV cache full: 2 more blocks .* 1 of 4 free"):
        seq.reserve(5 * BLOCK_TOKENS)
    assert seq.capacity == 3 * BLOCK_TOKENS  # what it held is kept


def test_context_overflow_is_a_request_error():
    seq = SequenceKV(KVPool(L, HKV, D), 100)
    with pytest.raises(RequestError, match="context overflow: 101 tokens exceed the context of 100"):
        seq.reserve(101)


def test_large_host_arrays_are_reserved_not_committed():
    """A 4 GiB pool array costs no resident memory until written."""
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    big = host_array((1 << 30,), np.float32)
    big[:1024] = 1.0
    assert rss() - before < 256 << 20
    del big


def test_write_past_the_reserved_positions_is_refused():
    """The compiled row writer has no bounds checks: the sequence refuses a write its blocks cannot hold."""
    rng = np.random.default_rng(1)
    seq = SequenceKV(KVPool(L, HKV, D, "f32", num_blocks=2), 1000)
    seq.reserve(BLOCK_TOKENS)
    k, v = rows(rng, 2)
    with pytest.raises(ValueError, match="past the"):
        seq.write(0, BLOCK_TOKENS - 1, k[0], v[0])


def test_write_of_rows_that_do_not_fit_the_pool_is_refused():
    seq = SequenceKV(KVPool(L, HKV, D, "f32", num_blocks=2), 1000)
    seq.reserve(4)
    wrong = np.ones((2, HKV, D + 1), dtype=np.float32)
    with pytest.raises(ValueError, match="the pool holds float32 rows of"):
        seq.write(0, 0, wrong, wrong)
