"""A prompt's several-token decode items (tiles.PROMPT_ITEMS, cpu_kernels/tokens_dot.py) against NumPy float64 and
against the one-token dots they stand in for, on random weights and x: groups of 2..PROMPT_ITEM_MAX_TOKENS tokens (4
at a time, then 2, then one), beside a one-token group and a prefill-sized one."""
import gguf
import numpy as np
import pytest

from cpu_kernels import iq4_nl, q4_0, q4_k, q6_k, q8_0
from cpu_kernels.act_quant import INT16
from cpu_kernels.tiles import DECODE_MAX_TOKENS, KERNELS, NO_CHUNK, PROMPT_ITEM_MAX_TOKENS, PROMPT_ITEMS, work_items

from .conftest import _act_rounding_bound

FORMATS = [q4_0, q8_0, q4_k, q6_k, iq4_nl]  # plain blocks, (scale, min) and Q6_K's K-quants, a table-word format
R, C = 37, 512  # odd rows: the one-row tail of an item
GROUPS = [2, 3, 4, 5, 1, 6, 7, DECODE_MAX_TOKENS, PROMPT_ITEM_MAX_TOKENS - 1, PROMPT_ITEM_MAX_TOKENS + 3]


def test_prompt_items_take_every_token_of_a_few_token_group_a_row_range():
    starts = np.concatenate([[0], np.cumsum(GROUPS)]).astype(np.int64)
    experts = np.arange(len(GROUPS), dtype=np.int64)
    items = work_items(experts, starts, len(GROUPS), 200, 0, True)  # [W, 6]
    covered = np.zeros((starts[-1], 200), dtype=np.int64)
    for expert, r0, t0, t1, chunk, r1 in items:
        covered[t0:t1, r0:r1] += 1
        if GROUPS[expert] <= PROMPT_ITEM_MAX_TOKENS:
            assert (t0, t1, chunk) == (starts[expert], starts[expert + 1], NO_CHUNK)
    assert (covered == 1).all()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_prompt_items_match_numpy_and_the_one_token_dots(fmt):
    rng = np.random.default_rng(7)
    raw = fmt.random_blocks(rng, (len(GROUPS), R, C), 0.02)  # [E, R, B]
    starts = np.concatenate([[0], np.cumsum(GROUPS)]).astype(np.int64)  # [G+1]
    experts = np.arange(len(GROUPS), dtype=np.int64)[::-1].copy()  # [G]
    x = rng.standard_normal((starts[-1], C)).astype(np.float32)  # [N, C]
    kernel = KERNELS[fmt.__name__][0]
    several, single = (np.full((len(x), R), np.nan, dtype=np.float32) for _ in range(2))
    kernel((raw,), x, experts, starts, (several,), INT16 + PROMPT_ITEMS)
    kernel((raw,), x, experts, starts, (single,), INT16)
    for g, e in enumerate(experts):
        rows = slice(starts[g], starts[g + 1])
        w = gguf.quants.dequantize(raw[e], fmt.QTYPE).astype(np.float64)  # [R, C]
        ref = x[rows].astype(np.float64) @ w.T
        bound = C * np.finfo(np.float32).eps * (np.abs(x[rows]) @ np.abs(w).T)
        if GROUPS[g] <= PROMPT_ITEM_MAX_TOKENS:
            bound = bound + _act_rounding_bound(x[rows], np.abs(w), "int16")
            assert np.all(np.abs(several[rows] - ref) <= bound)
        else:  # prefill tiles: the same under either code
            assert np.array_equal(several[rows], single[rows])
    scale = np.abs(single).max()
    decode = np.repeat(np.array(GROUPS) <= DECODE_MAX_TOKENS, GROUPS)  # [N]: the rows one-token dots read singly
    assert np.abs(several - single)[decode].max() <= 1e-6 * scale  # the same integer dots, summed in another order
