"""Decode-path variants: gate and up in one parallel region, serial matvecs, serial twins of small kernels."""
import numpy as np
import pytest

from cpu_kernels import activation, attention, moe_combine, rmsnorm, rope, routing
from cpu_kernels.formats import FORMATS

ALL = sorted(FORMATS.values(), key=lambda m: m.__name__)
DEFAULT = {"f32", "bf16", "q8_0", "q4_0", "q4_k", "q6_k", "iq4_xs", "iq3_s"}  # every driver template; the rest slow


def _name(fmt):
    return fmt.__name__.rsplit(".", 1)[-1]


each_format = pytest.mark.parametrize(
    "fmt", [f if _name(f) in DEFAULT else pytest.param(f, marks=pytest.mark.slow) for f in ALL], ids=_name)
R = 37  # not a multiple of the 4 rows a dot loop reads at once


def _cols(fmt):
    return 2 * max(fmt.BLOCK_SIZE, 256)


@each_format
def test_moe_matmul_pair_equals_two_moe_matmuls(fmt):
    rng = np.random.default_rng(0)
    cols = _cols(fmt)
    gate, up = (fmt.random_blocks(rng, (4, R, cols), 0.02) for _ in range(2))  # [E, R, B]
    expert_ids = np.array([3, 1], dtype=np.int64)
    row_starts = np.array([0, 1, 3], dtype=np.int64)  # a decode (1 row) and a 2-row group
    x = rng.standard_normal((3, cols)).astype(np.float32)
    got_a, got_b, ref_a, ref_b = (np.empty((3, R), dtype=np.float32) for _ in range(4))
    fmt.moe_matmul_pair(gate, up, x, expert_ids, row_starts, got_a, got_b)
    fmt.moe_matmul(gate, x, expert_ids, row_starts, ref_a)
    fmt.moe_matmul(up, x, expert_ids, row_starts, ref_b)
    assert np.array_equal(got_a, ref_a) and np.array_equal(got_b, ref_b)


@each_format
def test_serial_matvec_equals_parallel(fmt):
    rng = np.random.default_rng(1)
    raw = fmt.random_blocks(rng, (R, _cols(fmt)), 0.02)
    x = rng.standard_normal(_cols(fmt)).astype(np.float32)
    serial, parallel = np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32)
    fmt.matvec(raw, x, serial, serial=True)
    fmt.matvec(raw, x, parallel)
    assert np.array_equal(serial, parallel)


def test_pair_refuses_different_shapes():
    fmt = FORMATS[sorted(FORMATS)[0]]
    rng = np.random.default_rng(2)
    a = fmt.random_blocks(rng, (2, 8, 256), 0.02)
    b = fmt.random_blocks(rng, (3, 8, 256), 0.02)
    x = np.zeros((1, 256), dtype=np.float32)
    outs = np.empty((1, 8), dtype=np.float32), np.empty((1, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="moe_matmul_pair"):
        fmt.moe_matmul_pair(a, b, x, np.zeros(1, dtype=np.int64), np.array([0, 1]), *outs)


def _close(a, b):
    """Twins compile apart: fastmath may vectorize (and so round) a loop differently in each."""
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_serial_twins_match_parallel_kernels():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    a, b = np.empty_like(x), np.empty_like(x)
    rmsnorm.rmsnorm(x, w, 1e-6, a)
    rmsnorm.rmsnorm_serial(x, w, 1e-6, b)
    _close(a, b)
    heads = rng.standard_normal((3, 4, 16)).astype(np.float32)
    pos = np.array([0, 5, 9], dtype=np.int64)
    a, b = np.empty_like(heads), np.empty_like(heads)
    rope.rope_neox(heads, pos, 1e6, a)
    rope.rope_neox_serial(heads, pos, 1e6, b)
    _close(a, b)
    g, u = rng.standard_normal((2, 3, 32)).astype(np.float32)
    a, b = np.empty_like(g), np.empty_like(g)
    activation.swiglu(g, u, a)
    activation.swiglu_serial(g, u, b)
    _close(a, b)
    logits = rng.standard_normal((3, 16)).astype(np.float32)
    ids = [np.empty((3, 4), dtype=np.int64) for _ in range(2)]
    wts = [np.empty((3, 4), dtype=np.float32) for _ in range(2)]
    routing.route_softmax_topk(logits, 4, True, ids[0], wts[0])
    routing.route_softmax_topk_serial(logits, 4, True, ids[1], wts[1])
    assert np.array_equal(ids[0], ids[1])
    _close(wts[0], wts[1])
    order, _, _ = routing.group_by_expert(ids[0], 16)
    rows = [np.empty((12, 64), dtype=np.float32) for _ in range(2)]
    moe_combine.gather_rows(x, order, 4, rows[0])
    moe_combine.gather_rows_serial(x, order, 4, rows[1])
    assert np.array_equal(rows[0], rows[1])
    outs = [np.zeros((3, 64), dtype=np.float32) for _ in range(2)]
    moe_combine.scatter_add_weighted(rows[0], order, wts[0].reshape(-1), 4, outs[0])
    moe_combine.scatter_add_weighted_serial(rows[0], order, wts[0].reshape(-1), 4, outs[1])
    _close(outs[0], outs[1])
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 5, 2, 16)).astype(np.float32)  # one pool block of 5 positions each
    table = np.zeros(1, dtype=np.int32)
    a, b = np.empty_like(q), np.empty_like(q)
    extras = (attention.NO_LSE, attention.NO_SCALES, attention.NO_SCALES, 0)  # every argument: the engine's instances
    attention.attention(q, k, v, table, 3, 0, 5, 0.25, a, *extras)
    attention.attention_serial(q, k, v, table, 3, 0, 5, 0.25, b, *extras)
    _close(a, b)
