"""The per-call preparation of the expert matmuls (token panels, sub-block sums) against NumPy, on both
sides of the row / chunk counts where it turns parallel."""
import numpy as np
import pytest

from cpu_kernels.prefill import PARALLEL_MIN_PANELS, token_panels
from cpu_kernels.tiles import (DECODE_ITEMS_PER_THREAD, DECODE_MAX_ITEM_BYTES, DECODE_MAX_ROWS_PER_ITEM,
                               DECODE_MAX_TOKENS, NO_CHUNK, PARALLEL_MIN_SUM_ROWS, ROWS_PER_ITEM, TOKENS_PER_ITEM,
                               decode_rows_per_item, sub_block_sums, work_items)


@pytest.mark.parametrize("num_rows", [16, 200, 768])
@pytest.mark.parametrize("tokens_per_expert", [[1], [1] * 8, [1, 70, 1, 3], [5, DECODE_MAX_TOKENS + 1]])
def test_work_items_cover_every_row_and_token_once(tokens_per_expert, num_rows):
    row_starts = np.concatenate([[0], np.cumsum(tokens_per_expert)]).astype(np.int64)
    expert_ids = np.arange(len(tokens_per_expert), dtype=np.int64)[::-1].copy()
    items = work_items(expert_ids, row_starts, len(tokens_per_expert), num_rows)  # [W, 6]
    covered = np.zeros((row_starts[-1], num_rows), dtype=np.int64)  # [N, R]
    for expert, r0, t0, t1, _, r1 in items:
        g = np.flatnonzero(expert_ids == expert)[0]
        assert row_starts[g] <= t0 < t1 <= row_starts[g + 1] and 0 <= r0 < r1 <= num_rows
        assert r1 - r0 <= (DECODE_MAX_ROWS_PER_ITEM if t1 - t0 == 1 else ROWS_PER_ITEM)
        covered[t0:t1, r0:r1] += 1
    assert (covered == 1).all()



def test_a_few_tokens_of_a_group_take_one_token_items_row_range_by_row_range():
    """A verification step's tokens (one group of 1 + k) run the decode dots, each row range's tokens in a row."""
    items = work_items(np.zeros(1, dtype=np.int64), np.array([0, 3], dtype=np.int64), 1, 200)  # [W, 6]
    assert (items[:, 3] - items[:, 2] == 1).all()
    assert (items[:, 2] == np.tile(np.arange(3), len(items) // 3)).all()  # tokens 0, 1, 2 of each row range
    assert (items[::3, 1] == items[1::3, 1]).all() and (items[::3, 1] == items[2::3, 1]).all()
    many = work_items(np.zeros(1, dtype=np.int64), np.array([0, DECODE_MAX_TOKENS + 1], dtype=np.int64), 1, 200)
    assert (many[:, 3] - many[:, 2] == DECODE_MAX_TOKENS + 1).all()  # prefill tiles


def test_decode_items_grow_while_every_thread_keeps_enough():
    assert decode_rows_per_item(8, 768, 1) == DECODE_MAX_ROWS_PER_ITEM  # one thread: the fewest items
    assert decode_rows_per_item(1, 256, 1) == 256 // DECODE_ITEMS_PER_THREAD
    assert decode_rows_per_item(1, 256, 16) == ROWS_PER_ITEM  # 16 threads: 16 items of the fewest rows
    span = decode_rows_per_item(8, 768, 16)
    assert 8 * -(-768 // span) >= DECODE_ITEMS_PER_THREAD * 16 > 8 * -(-768 // (2 * span))


def test_decode_items_of_short_rows_grow_to_the_byte_limit():
    """Short rows (a Q6_K expert down projection of 512 columns: 420 bytes) take items of up to
    DECODE_MAX_ITEM_BYTES; long rows, or rows of unknown size, at most DECODE_MAX_ROWS_PER_ITEM rows."""
    assert decode_rows_per_item(10, 2048, 1) == DECODE_MAX_ROWS_PER_ITEM
    assert decode_rows_per_item(10, 2048, 1, 4608) == DECODE_MAX_ROWS_PER_ITEM
    assert decode_rows_per_item(10, 2048, 1, 420) == 1024 and 1024 * 420 <= DECODE_MAX_ITEM_BYTES < 2048 * 420
    assert decode_rows_per_item(10, 2048, 1, 1152) == 256 and 256 * 1152 <= DECODE_MAX_ITEM_BYTES < 512 * 1152
    span = decode_rows_per_item(10, 2048, 16, 420)  # threads still keep enough items each
    assert 10 * -(-2048 // span) >= DECODE_ITEMS_PER_THREAD * 16 > 10 * -(-2048 // (2 * span))
    expert_ids, row_starts = np.arange(10, dtype=np.int64)[::-1].copy(), np.arange(11, dtype=np.int64)
    items = work_items(expert_ids, row_starts, 10, 2000, 420)  # [W, 6]
    covered = np.zeros((10, 2000), dtype=np.int64)
    for expert, r0, t0, t1, _, r1 in items:
        covered[t0:t1, r0:r1] += 1
    assert (covered == 1).all() and (items[:, 5] - items[:, 1]).max() == 1024


def test_decode_items_of_short_rows_give_the_kernels_results():
    """Q6_K decode dots over items of more than DECODE_MAX_ROWS_PER_ITEM short rows, against NumPy."""
    import gguf

    from cpu_kernels import q6_k

    rng = np.random.default_rng(7)
    raw = q6_k.random_blocks(rng, (3, 600, 256), 0.02)  # [E, R, B]: rows of 210 bytes
    x = rng.standard_normal((6, 256)).astype(np.float32)  # [N, C]: one token a group
    expert_ids, row_starts = np.array([2, 0, 1, 2, 0, 1], dtype=np.int64), np.arange(7, dtype=np.int64)
    assert decode_rows_per_item(6, 600, 1, 210) > DECODE_MAX_ROWS_PER_ITEM
    out = np.full((6, 600), np.nan, dtype=np.float32)
    q6_k.moe_matmul(raw, x, expert_ids, row_starts, out, act_quant="float")
    for n, e in enumerate(expert_ids):
        w = gguf.quants.dequantize(raw[e], q6_k.QTYPE).astype(np.float64)  # [R, C]
        np.testing.assert_allclose(out[n], w @ x[n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_rows", [1, 7, PARALLEL_MIN_SUM_ROWS - 1, PARALLEL_MIN_SUM_ROWS, 700])
def test_sub_block_sums(num_rows):
    x = np.random.default_rng(num_rows).standard_normal((num_rows, 256)).astype(np.float32)
    expected = x.astype(np.float64).reshape(num_rows, 8, 32).sum(axis=2)
    np.testing.assert_allclose(sub_block_sums(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens_per_expert", [[1, 1, 1], [3, 70, 1], [64] * (PARALLEL_MIN_PANELS - 1),
                                               [130, 5, 64, 200, 1, 77]])
def test_token_panels(tokens_per_expert):
    rng = np.random.default_rng(len(tokens_per_expert))
    row_starts = np.concatenate([[0], np.cumsum(tokens_per_expert)]).astype(np.int64)
    expert_ids = np.arange(len(tokens_per_expert), dtype=np.int64)
    x = rng.standard_normal((row_starts[-1], 96)).astype(np.float32)  # [N, C]
    items = work_items(expert_ids, row_starts, len(tokens_per_expert), 48)
    panels = token_panels(x, items)
    if all(n == 1 for n in tokens_per_expert):
        assert panels.shape == (0, 96, TOKENS_PER_ITEM)  # decode reads x directly
        return
    expected_chunks = items[:, 4].max() + 1  # the prefill items' chunks; decode items (<= 8 tokens) have none
    assert expected_chunks == sum(-(-n // TOKENS_PER_ITEM) for n in tokens_per_expert if n > DECODE_MAX_TOKENS)
    group_tokens = np.diff(row_starts)[np.searchsorted(row_starts, items[:, 2], side="right") - 1]  # [W]
    assert ((items[:, 4] == NO_CHUNK) == (group_tokens <= DECODE_MAX_TOKENS)).all()
    assert panels.shape == (expected_chunks, 96, TOKENS_PER_ITEM)
    for s in range(expected_chunks):
        t0, t1 = items[items[:, 4] == s][0, 2:4]
        np.testing.assert_array_equal(panels[s, :, :t1 - t0], x[t0:t1].T)
        assert not panels[s, :, t1 - t0:].any()  # zero past the chunk's end
