"""The per-call preparation of the expert matmuls (token panels, sub-block sums) against NumPy, on both
sides of the row / chunk counts where it turns parallel."""
import numpy as np
import pytest

from cpu_kernels.prefill import PARALLEL_MIN_PANELS, token_panels
from cpu_kernels.tiles import PARALLEL_MIN_SUM_ROWS, TOKENS_PER_ITEM, sub_block_sums, work_items


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
    expected_chunks = items[-1, 4] + 1
    assert panels.shape == (expected_chunks, 96, TOKENS_PER_ITEM)
    for s in range(expected_chunks):
        t0, t1 = items[items[:, 4] == s][0, 2:4]
        np.testing.assert_array_equal(panels[s, :, :t1 - t0], x[t0:t1].T)
        assert not panels[s, :, t1 - t0:].any()  # zero past the chunk's end
