"""The paged KV kernels (kv.cu's paged_attention and kv_write, ops.cu's attn_merge) against their NumPy
references on fresh random data, and those references against a dense softmax (without a GPU)."""
from dataclasses import dataclass, fields
from itertools import product

import numpy as np
import pytest

from gpu_kernels.attention_plan import SHORT_ATTENTION_KEYS
from hybrid import kv_store

NAN_BITS = {"f32": np.float32(np.nan), "f16": np.uint16(0x7E00), "bf16": np.int16(0x7FC0), "int8": np.int8(0)}
KV_INDEX = {d: i for i, d in enumerate(kv_store.KV_DTYPES)}


@dataclass
class PagedCache:
    """One layer's paged K/V as the kernels take it: pools [NB, BT, Hkv, D], scales [NB, BT, Hkv] (int8),
    table int32 [nb], stage (k, v, k_scale, v_scale) [nS, BT, Hkv(, D)] or None."""

    k_pool: object
    v_pool: object
    k_scale: object
    v_scale: object
    table: object
    stage: tuple = None

    def on(self, runtime):
        def move(a):
            return None if a is None else runtime.to_device(a)

        moved = {f.name: move(getattr(self, f.name)) for f in fields(self) if f.name != "stage"}
        return PagedCache(**moved, stage=None if self.stage is None else tuple(map(move, self.stage)))

    def args(self):
        return self.k_pool, self.v_pool, self.k_scale, self.v_scale, self.table


def nan_rows(shape, kv_dtype):
    """Storage whose rows decode to NaN (int8: through a NaN scale), so reading an unwritten row shows."""
    return np.full(shape, NAN_BITS[kv_dtype], kv_store.STORAGE[kv_dtype])


def nan_scales(shape, kv_dtype):
    return np.full(shape, np.nan, np.float32) if kv_dtype == "int8" else None


def make_cache(rng, kv_dtype, num_positions, num_kv_heads, head_dim, block_tokens, num_stage_blocks=0,
               written_from=0):
    """A paged cache of positions [written_from, num_positions) of fresh random K/V [n, Hkv, D] f32 (also
    returned): the first num_stage_blocks logical blocks in the stage, the others in shuffled pool blocks
    (two spare); every other row NaN."""
    num_blocks = -(-num_positions // block_tokens)
    num_pool = num_blocks - num_stage_blocks + 2
    table = np.full(num_blocks, -1, np.int32)
    table[num_stage_blocks:] = rng.permutation(num_pool)[: num_blocks - num_stage_blocks]
    row_shape = (block_tokens, num_kv_heads, head_dim)
    k, v = (rng.standard_normal((num_positions, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    positions = np.arange(written_from, num_positions)
    blocks, offsets = positions // block_tokens, positions % block_tokens
    in_pool = table[blocks] >= 0
    arrays = []
    for x in (k, v):
        pool, stage = nan_rows((num_pool, *row_shape), kv_dtype), nan_rows((num_stage_blocks, *row_shape), kv_dtype)
        pool_scale, stage_scale = nan_scales(pool.shape[:3], kv_dtype), nan_scales(stage.shape[:3], kv_dtype)
        data, scale = kv_store.encode(x[written_from:], kv_dtype)
        for held, rows, rows_scale, index in ((in_pool, pool, pool_scale, table[blocks]),
                                              (~in_pool, stage, stage_scale, blocks)):
            rows[index[held], offsets[held]] = data[held]
            if scale is not None:
                rows_scale[index[held], offsets[held]] = scale[held]
        arrays.append((pool, pool_scale, stage, stage_scale))
    (k_pool, k_scale, k_stage, k_stage_scale), (v_pool, v_scale, v_stage, v_stage_scale) = arrays
    stage = (k_stage, v_stage, k_stage_scale, v_stage_scale) if num_stage_blocks else None
    return PagedCache(k_pool, v_pool, k_scale, v_scale, table, stage), k, v


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def assert_lse_close(got, ref, tol):
    """Log-sum-exps: -inf exactly where the reference has no key, the others within tol (relative)."""
    assert np.array_equal(np.isneginf(got), np.isneginf(ref))
    finite = np.isfinite(ref)
    if finite.any():
        assert np.abs(got[finite] - ref[finite]).max() <= tol * max(1.0, np.abs(ref[finite]).max())


def run_attention(kern, runtime, kv_dtype, q, cache, start, key_lo, scale, with_lse):
    """kern.paged_attention on device copies (runtime None: NumPy arrays as they are) -> (out, lse or None)."""
    dev = cache if runtime is None else cache.on(runtime)
    put = (lambda a: a) if runtime is None else runtime.to_device
    get = (lambda a: a) if runtime is None else runtime.to_host
    out = put(np.zeros(q.shape, np.float32))
    lse = put(np.zeros(q.shape[:2], np.float32)) if with_lse else None
    kern.paged_attention(kv_dtype, put(q), *dev.args(), start, key_lo, scale, out, lse, dev.stage)
    return get(out), None if lse is None else get(lse)


# (T, start, key_lo, stage blocks, BT): decode at the start, deep, past a prefix, long; prefill chunks,
# some with rows before key_lo (no key), a few tokens over many keys (split)
ATTENTION_CASES = [
    (1, 0, 0, 0, 16), (1, 700, 0, 2, 64), (1, 700, 100, 3, 64), (1, 5000, 0, 4, 64),
    (37, 0, 0, 0, 16), (37, 300, 0, 2, 64), (37, 300, 150, 3, 16), (37, 0, 20, 0, 16),
    (128, 300, 0, 1, 64), (128, 0, 0, 0, 64), (8, 3000, 1000, 5, 64),
]


def check_paged_attention(runtime, kern, reference_kernels, kv_dtype, case, head_dim, group, with_lse,
                          num_kv_heads=2):
    num_tokens, start, key_lo, num_stage, block_tokens = case
    rng = np.random.default_rng([num_tokens, start, key_lo, head_dim, group, KV_INDEX[kv_dtype]])
    cache, _, _ = make_cache(rng, kv_dtype, start + num_tokens, num_kv_heads, head_dim, block_tokens, num_stage,
                             written_from=key_lo)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    out, lse = run_attention(kern, runtime, kv_dtype, q, cache, start, key_lo, scale, with_lse)
    ref, ref_lse = run_attention(reference_kernels, None, kv_dtype, q, cache, start, key_lo, scale, with_lse)
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5
    if with_lse:
        assert_lse_close(lse, ref_lse, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "T{}-s{}-lo{}-st{}-bt{}".format(*c))
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_paged_attention(runtime, kernels, reference_kernels, kv_dtype, case, head_dim, group, with_lse):
    check_paged_attention(runtime, kernels, reference_kernels, kv_dtype, case, head_dim, group, with_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [24, 30, 96, 256])  # 30: rows read value by value; 256: 16-key tiles
@pytest.mark.parametrize("case", [(1, 2000, 0, 3, 64), (37, 300, 150, 3, 16)], ids=["decode", "prefill"])
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_paged_attention_head_dims(runtime, kernels, reference_kernels, kv_dtype, case, head_dim):
    check_paged_attention(runtime, kernels, reference_kernels, kv_dtype, case, head_dim, 4, True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (64, 4), (16, 16), (12, 4)])
def test_paged_attention_decode_heads(runtime, kernels, reference_kernels, num_q_heads, num_kv_heads):
    """Decode at the engine's head counts, incl. more query heads a kv head than a block's rows."""
    check_paged_attention(runtime, kernels, reference_kernels, "f16", (1, 4095, 0, 2, 64), 128,
                          num_q_heads // num_kv_heads, True, num_kv_heads=num_kv_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("start", [40, 700])
def test_paged_attention_fewer_heads_a_block(runtime, kernels, reference_kernels, rows, start):
    """One token with a group of 8 heads taken `rows` heads a block (Kernels.attention_rows): the same result."""
    kernels.attention_rows, kernels.short_attention_keys = rows, 0
    try:
        check_paged_attention(runtime, kernels, reference_kernels, "f16", (1, start, 0, 1, 64), 128, 8, True,
                              num_kv_heads=4)
    finally:
        kernels.attention_rows, kernels.short_attention_keys = 8, SHORT_ATTENTION_KEYS


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,start", [(1, 6000), (8, 3000)])
def test_paged_attention_splits_agree(runtime, kernels, num_tokens, start):
    """Keys split across blocks (and merged) give the one-pass result."""
    from gpu_kernels.kernels import Kernels

    rng = np.random.default_rng(start)
    cache, _, _ = make_cache(rng, "bf16", start + num_tokens, 4, 128, 64, 2)
    q = rng.standard_normal((num_tokens, 16, 128)).astype(np.float32)
    split, split_lse = run_attention(kernels, runtime, "bf16", q, cache, start, 0, 128 ** -0.5, True)
    whole, whole_lse = run_attention(Kernels(runtime, max_splits=1), runtime, "bf16", q, cache, start, 0,
                                     128 ** -0.5, True)
    assert rel_err(split, whole) < 1e-5
    assert_lse_close(split_lse, whole_lse, 1e-6)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # f16 inf, on purpose
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_kv_write_bit_exact(runtime, kernels, reference_kernels, kv_dtype):
    """Positions 37 .. 186 (from mid-block, over several shuffled blocks) of rows with zeros, huge, tiny and
    halfway values, as kv_store.encode writes them; the other rows untouched."""
    rng = np.random.default_rng(KV_INDEX[kv_dtype])
    num_kv_heads, head_dim, block_tokens, start = 2, 64, 32, 37
    x = rng.standard_normal((150, num_kv_heads, head_dim)).astype(np.float32)
    x[3] = 0.0  # int8 scale 1
    x[4, 0, :8] = [1e5, -7e4, 65520.0, 65519.0, 6e-8, -3e-8, 2.0 ** -25, 1.5 * 2.0 ** -24]  # f16 inf, subnormals
    x[5] *= 1e-30
    x[6] = 1.0 + np.array([2.0 ** -8, 2.0 ** -11])[:, None] * np.arange(head_dim)  # ties of bf16, of f16
    table = rng.permutation(9).astype(np.int32)
    pool = nan_rows((9, block_tokens, num_kv_heads, head_dim), kv_dtype)
    scale = nan_scales(pool.shape[:3], kv_dtype)
    ref_pool, ref_scale = pool.copy(), None if scale is None else scale.copy()
    reference_kernels.kv_write(kv_dtype, x, ref_pool, ref_scale, table, start)
    dev_pool, dev_scale = runtime.to_device(pool), None if scale is None else runtime.to_device(scale)
    kernels.kv_write(kv_dtype, runtime.to_device(x), dev_pool, dev_scale, runtime.to_device(table), start)
    assert np.array_equal(runtime.to_host(dev_pool).view(np.uint8), ref_pool.view(np.uint8))
    if scale is not None:
        assert np.array_equal(runtime.to_host(dev_scale).view(np.uint32), ref_scale.view(np.uint32))


def merge_inputs(rng, num_tokens, num_q_heads, head_dim):
    """Two partial results; row 0 of a without keys, row 1 of b, row 2 of both."""
    out_a, out_b = (rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((num_tokens, num_q_heads)).astype(np.float32) * 3 for _ in range(2))
    lse_a[0, 0] = lse_b[0, 1] = lse_a[0, 2] = lse_b[0, 2] = -np.inf
    out_a[0, 0] = out_b[0, 1] = np.nan  # a side without keys is never read
    return out_a, lse_a, out_b, lse_b


@pytest.mark.gpu
def test_attn_merge(runtime, kernels, reference_kernels):
    rng = np.random.default_rng(3)
    out_a, lse_a, out_b, lse_b = merge_inputs(rng, 5, 8, 128)
    ref = np.empty_like(out_a)
    reference_kernels.attn_merge(out_a, lse_a, out_b, lse_b, ref)
    dev_a = runtime.to_device(out_a)
    kernels.attn_merge(dev_a, runtime.to_device(lse_a), runtime.to_device(out_b), runtime.to_device(lse_b), dev_a)
    got = runtime.to_host(dev_a)
    assert (got[0, 2] == 0).all() and np.isfinite(ref).all()
    assert rel_err(got, ref) < 1e-6


def split_and_merge(kern, runtime, kv_dtype, rng, num_tokens, split, group=4):
    """Attention over [0, start + t + 1) == the merge of [0, split) (token by token) and [split, start + t + 1)."""
    start = 900
    cache, _, _ = make_cache(rng, kv_dtype, start + num_tokens, 2, 64, 16, 3)
    q = rng.standard_normal((num_tokens, 2 * group, 64)).astype(np.float32)
    whole, _ = run_attention(kern, runtime, kv_dtype, q, cache, start, 0, 0.125, False)
    head = [run_attention(kern, runtime, kv_dtype, q[t:t + 1], cache, split - 1, 0, 0.125, True)
            for t in range(num_tokens)]
    head_out, head_lse = (np.concatenate(parts) for parts in zip(*head))
    tail_out, tail_lse = run_attention(kern, runtime, kv_dtype, q, cache, start, split, 0.125, True)
    put = (lambda a: a) if runtime is None else runtime.to_device
    merged = put(np.zeros(q.shape, np.float32))
    kern.attn_merge(put(head_out), put(head_lse), put(tail_out), put(tail_lse), merged)
    return whole, merged if runtime is None else runtime.to_host(merged)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_merge_of_key_ranges_is_whole_attention(runtime, kernels, kv_dtype, num_tokens):
    whole, merged = split_and_merge(kernels, runtime, kv_dtype, np.random.default_rng(num_tokens), num_tokens, 333)
    assert rel_err(merged, whole) < 1e-5


# Without a GPU: the launch plans fit the kernels; the references (they drive GpuBackend's Python side
# in CI) are right.


@pytest.mark.parametrize("num_tokens", [1, 37, 512])
@pytest.mark.parametrize("head_dim", [8, 24, 96, 128, 200, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 16])
def test_attention_plan_fits_the_kernels(num_tokens, head_dim, group):
    from gpu_kernels.kernels import PA_OUTS, PA_THREADS, PD_KEYS, attention_plan

    for num_keys, one_token_rows in product((-5, 1, 255, 700, 5000, 40000), (8, 2)):
        plan = attention_plan(num_tokens, group, 4, head_dim, num_keys, one_token_rows=one_token_rows)
        assert plan.shared_mem <= 48 << 10
        assert plan.splits * plan.split_keys >= num_keys and (plan.splits - 1) * plan.split_keys < max(num_keys, 1)
        assert plan.num_tiles * plan.rows >= num_tokens * group
        if plan.kernel == "paged_attention_1s":  # a block a head, every key in shared memory, no split
            assert num_tokens == 1 and plan.rows == 1 and plan.splits == 1 and plan.num_tiles == group
        elif plan.kernel == "paged_attention_1":  # R heads, lanes of 4 values: R <= LG <= 32, 4 LG >= D
            keys_a_group = PD_KEYS * plan.width / PA_THREADS  # kv.cu's PD_MAX_KPG = 8 at most
            assert num_tokens == 1 and plan.rows in (1, 2, 4, 8) and plan.rows <= plan.width <= 32
            assert 4 * plan.width >= head_dim and keys_a_group in (1, 2, 4, 8)
        else:  # kv.cu's PA_ROWS_PER_THREAD = 4 rows a key lane, PA_OUTS values a thread
            assert plan.width in (16, 32) and plan.rows <= PA_THREADS // plan.width * 4
            assert plan.rows * head_dim <= PA_OUTS * PA_THREADS
        if plan.splits > 1:
            assert plan.split_keys % (PD_KEYS if plan.kernel == "paged_attention_1" else plan.width) == 0


def dense_attention(q, k, v, start, key_lo, scale):
    """Float64 softmax attention, query by query and head by head, over contiguous k / v [n, Hkv, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    out, lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for t in range(num_tokens):
        keys = slice(key_lo, start + t + 1)
        for h in range(num_q_heads):
            s = k[keys, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if len(s):
                p = np.exp(s - s.max())
                out[t, h] = p @ v[keys, h // group] / p.sum()
                lse[t, h] = s.max() + np.log(p.sum())
    return out, lse


@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
@pytest.mark.parametrize("num_tokens,start,key_lo,num_stage", [(1, 300, 0, 2), (9, 40, 0, 0), (9, 40, 30, 3),
                                                                (9, 0, 5, 0)])
def test_reference_paged_attention_is_dense_softmax(reference_kernels, kv_dtype, num_tokens, start, key_lo,
                                                     num_stage):
    rng = np.random.default_rng(num_tokens + start)
    cache, k, v = make_cache(rng, kv_dtype, start + num_tokens, 2, 24, 16, num_stage, written_from=key_lo)
    k, v = (kv_store.decode(*kv_store.encode(x, kv_dtype)) for x in (k, v))  # the stored values, contiguous
    q = rng.standard_normal((num_tokens, 6, 24)).astype(np.float32)
    out, lse = run_attention(reference_kernels, None, kv_dtype, q, cache, start, key_lo, 0.3, True)
    ref, ref_lse = dense_attention(q, k, v, start, key_lo, 0.3)
    assert np.abs(out - ref).max() < 1e-6
    assert_lse_close(lse, ref_lse, 1e-6)


@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_reference_kv_write_lands_through_table(reference_kernels, kv_dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((45, 2, 24)).astype(np.float32)
    table = np.array([5, 0, 3, 1], np.int32)
    pool, scale = nan_rows((6, 16, 2, 24), kv_dtype), nan_scales((6, 16, 2), kv_dtype)
    reference_kernels.kv_write(kv_dtype, x, pool, scale, table, 10)
    rows = kv_store.decode(pool[table].reshape(64, 2, 24), None if scale is None else scale[table].reshape(64, 2))
    assert np.array_equal(rows[10:55], kv_store.decode(*kv_store.encode(x, kv_dtype)))
    assert np.isnan(rows[:10]).all() and np.isnan(rows[55:]).all()


def test_reference_attn_merge_skips_empty_sides(reference_kernels):
    out_a, lse_a, out_b, lse_b = merge_inputs(np.random.default_rng(2), 3, 4, 8)
    out = np.empty_like(out_a)
    reference_kernels.attn_merge(out_a, lse_a, out_b, lse_b, out)
    w_a = 1.0 / (1.0 + np.exp(lse_b[1:] - lse_a[1:]))[..., None]
    assert np.allclose(out[1:], w_a * out_a[1:] + (1 - w_a) * out_b[1:], rtol=1e-5, atol=1e-6)
    assert np.array_equal(out[0, 0], out_b[0, 0]) and np.array_equal(out[0, 1], out_a[0, 1])
    assert (out[0, 2] == 0).all()


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_reference_merge_of_key_ranges_is_whole_attention(reference_kernels, num_tokens):
    whole, merged = split_and_merge(reference_kernels, None, "int8", np.random.default_rng(num_tokens), num_tokens,
                                   333)
    assert np.abs(merged - whole).max() < 1e-6
