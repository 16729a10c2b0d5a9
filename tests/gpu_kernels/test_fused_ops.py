"""The fused launches of a decode step (ops.cu add_rmsnorm, qk_norm_rope, decode_pairs; kv.cu kv_write of k and v at
once; matmul.cu moe_matmul2 of gate and up, moe_matmul_glu of the SwiGLU and down) against the launches they replace
(add_into then rmsnorm; rmsnorm over the heads then rope_neox; decode_tiles and gather_rows; a kv_write each; a
moe_matmul each; swiglu then moe_matmul) and the NumPy references, on random data at decode (1 token) and prefill
(64, 512 tokens) sizes; the expert kernels at decode steps of 1, 4 and 16 tokens."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cpu_kernels.rope import inv_freq_f32
from hybrid import kv_store

from .test_kernels import decode_x, quant

pytestmark = pytest.mark.gpu

TOKENS = [1, 64, 512]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("hidden", [2048, 2880, 96])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_add_rmsnorm(runtime, kernels, reference_kernels, num_tokens, hidden):
    rng = np.random.default_rng(num_tokens + hidden)
    x = (3 * rng.standard_normal((num_tokens, hidden))).astype(np.float32)
    y = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    dev_x, dev_y, dev_w = runtime.to_device(x), runtime.to_device(y), runtime.to_device(w)
    out = runtime.empty(x.shape, np.float32)
    kernels.add_rmsnorm(dev_x, dev_y, dev_w, 1e-6, out)
    two_x, two_out = runtime.to_device(x), runtime.empty(x.shape, np.float32)
    kernels.add_into(two_x, dev_y)
    kernels.rmsnorm(two_x, dev_w, 1e-6, two_out)
    np.testing.assert_array_equal(runtime.to_host(dev_x), runtime.to_host(two_x))
    assert rel_err(runtime.to_host(out), runtime.to_host(two_out)) < 1e-6
    ref_x, ref = x.copy(), np.empty_like(x)
    reference_kernels.add_rmsnorm(ref_x, y, w, 1e-6, ref)
    np.testing.assert_array_equal(runtime.to_host(dev_x), ref_x)
    assert rel_err(runtime.to_host(out), ref) < 1e-5


# (q heads, kv heads, head dim, rotated dims): Qwen3-30B-A3B, partial rotary (GLM-4.5's half), a 256-wide head
SHAPES = [(32, 4, 128, 128), (12, 2, 128, 64), (4, 1, 256, 256), (8, 8, 64, 64)]


@pytest.mark.parametrize("num_q,num_kv,head_dim,rotated", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_qk_norm_rope(runtime, kernels, reference_kernels, num_tokens, num_q, num_kv, head_dim, rotated):
    """q and k side by side (one token's qk view) and q alone (a prompt's), against the unfused launches."""
    rng = np.random.default_rng(num_tokens * head_dim + num_q)
    x = (3 * rng.standard_normal((num_tokens, num_q + num_kv, head_dim))).astype(np.float32)
    wq, wk = (rng.standard_normal(head_dim).astype(np.float32) for _ in range(2))
    positions = np.sort(rng.choice(8192, num_tokens, replace=False)).astype(np.int64)
    inv_freq = inv_freq_f32(1e6, head_dim)[:rotated // 2]
    dev_pos, dev_freq, dev_wq, dev_wk = map(runtime.to_device, (positions, inv_freq, wq, wk))
    for heads_of_q in (num_q, num_q + num_kv):  # q and k as one view; all heads with wq (a separate q array)
        fused = runtime.to_device(x)
        kernels.qk_norm_rope(fused, dev_wq, dev_wk, heads_of_q, 1e-6, dev_pos, dev_freq, 0.9)
        two = runtime.to_device(x)
        parts = [(two[:, :heads_of_q], dev_wq), (two[:, heads_of_q:], dev_wk)]
        for part, weight in parts:
            if part.shape[1]:
                rows = runtime.xp.ascontiguousarray(part).reshape(-1, head_dim)
                kernels.rmsnorm(rows, weight, 1e-6, rows)
                part[...] = rows.reshape(part.shape)
        kernels.rope_neox(two, dev_pos, dev_freq, 0.9)
        got = runtime.to_host(fused)
        assert np.abs(got - runtime.to_host(two)).max() < 1e-6 * np.abs(got).max()
        ref = x.copy()
        reference_kernels.qk_norm_rope(ref, wq, wk, heads_of_q, 1e-6, positions, inv_freq, 0.9)
        assert np.abs(got - ref).max() < 2e-5 * np.abs(ref).max()
        if rotated < head_dim:
            assert rel_err(got[..., rotated:], ref[..., rotated:]) < 1e-5  # the dims past the rotated ones: normed


@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_kv_write_k_and_v_in_one_launch(runtime, kernels, reference_kernels, num_tokens, kv_dtype):
    """kv_write's second pool (v beside k) gets exactly what a launch of its own writes, bit for bit."""
    rng = np.random.default_rng(num_tokens + len(kv_dtype))
    num_kv_heads, head_dim, block_tokens, start = 4, 128, 16, 5
    k, v = (rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2))
    num_blocks = -(-(start + num_tokens) // block_tokens)
    table = rng.permutation(num_blocks).astype(np.int32)
    pools, scales = {}, {}
    for name, x in (("k", k), ("v", v)):
        data, scale = kv_store.encode(np.zeros((num_blocks, block_tokens, num_kv_heads, head_dim), np.float32),
                                      kv_dtype)
        reference_kernels.kv_write(kv_dtype, x, data, scale, table, start)
        pools[name], scales[name] = data, scale
    dev = runtime.to_device
    zeros = kv_store.encode(np.zeros((num_blocks, block_tokens, num_kv_heads, head_dim), np.float32), kv_dtype)
    kp, vp = dev(zeros[0]), dev(zeros[0])
    ks, vs = (None, None) if zeros[1] is None else (dev(zeros[1]), dev(zeros[1]))
    kernels.kv_write(kv_dtype, dev(k), kp, ks, dev(table), start, second=(dev(v), vp, vs))
    for name, got_pool, got_scale in (("k", kp, ks), ("v", vp, vs)):
        assert np.array_equal(runtime.to_host(got_pool).view(np.uint8), pools[name].view(np.uint8)), name
        if got_scale is not None:
            assert np.array_equal(runtime.to_host(got_scale).view(np.uint32), scales[name].view(np.uint32)), name


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_decode_pairs(runtime, kernels, reference_kernels, num_tokens):
    """decode_pairs against decode_tiles + gather_rows (on the GPU, bit for bit) and the NumPy reference: some
    experts not resident."""
    rng = np.random.default_rng(num_tokens)
    k, num_experts, hidden = 8, 128, 2048
    ids = rng.integers(0, num_experts, (1, num_tokens * k)).astype(np.int32)
    slot_map = np.where(rng.random(num_experts) < 0.7, rng.permutation(num_experts), -1).astype(np.int32)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    pairs = num_tokens * k
    dev = runtime.to_device
    tiles, xs = runtime.empty((4, pairs), np.int32), runtime.empty((pairs, hidden), np.float32)
    kernels.decode_pairs(dev(ids), dev(slot_map), k, tiles, dev(x), xs)
    two_tiles, two_xs = runtime.empty((4, pairs), np.int32), runtime.empty((pairs, hidden), np.float32)
    kernels.decode_tiles(dev(ids), dev(slot_map), two_tiles)
    kernels.gather_rows(dev(x), dev(np.arange(pairs, dtype=np.int32)), k, two_xs)
    np.testing.assert_array_equal(runtime.to_host(tiles), runtime.to_host(two_tiles))
    np.testing.assert_array_equal(runtime.to_host(xs), runtime.to_host(two_xs))
    ref_tiles, ref_xs = np.empty((4, pairs), np.int32), np.empty((pairs, hidden), np.float32)
    reference_kernels.decode_pairs(ids, slot_map, k, ref_tiles, x, ref_xs)
    np.testing.assert_array_equal(runtime.to_host(tiles), ref_tiles)
    np.testing.assert_array_equal(runtime.to_host(xs), ref_xs)


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("act_quant", ["float", "int16"])
def test_moe_matmul2_gate_and_up_in_one_launch(runtime, reference_kernels, qtype, act_quant, num_tokens):
    """moe_matmul2 (gate and up over the same decode pairs) against two moe_matmul launches, bit for bit, and the
    NumPy reference; pairs of experts not resident (row count 0) skipped."""
    from gpu_kernels.kernels import Kernels

    kernels = Kernels(runtime, act_quant=act_quant)
    rng = np.random.default_rng(int(qtype) + num_tokens)
    num_slots, rows, cols, pairs = 6, 768, 512, 8 * num_tokens
    gate, up = quant(rng, qtype, (num_slots, rows, cols)), quant(rng, qtype, (num_slots, rows, cols))  # [S, R, B]
    slots = rng.integers(0, num_slots, pairs)
    tiles = np.stack([slots, np.arange(pairs), rng.random(pairs) < 0.8]).astype(np.int32)  # [3, P]: some skipped
    x = rng.standard_normal((pairs, cols)).astype(np.float32)
    dev = runtime.to_device
    dev_tiles = [dev(np.ascontiguousarray(t)) for t in tiles]
    outs = [runtime.zeros((pairs, rows), np.float32) for _ in range(4)]
    kernels.moe_matmul2(dev(gate), dev(up), qtype, dev(x), outs[0], outs[1], *dev_tiles)
    for raw, out in ((gate, outs[2]), (up, outs[3])):
        kernels.moe_matmul(dev(raw), qtype, dev(x), out, *dev_tiles, tile_tokens=1)
    got = [runtime.to_host(o) for o in outs]
    np.testing.assert_array_equal(got[0], got[2])
    np.testing.assert_array_equal(got[1], got[3])
    x_ref, tol = decode_x(act_quant, qtype, x)
    held = tiles[2] > 0
    for raw, out in ((gate, got[0]), (up, got[1])):
        ref = np.zeros((pairs, rows), np.float32)
        reference_kernels.moe_matmul(raw, qtype, x_ref, ref, *tiles)
        assert rel_err(out[held], ref[held]) < tol
        assert not out[~held].any()  # never written


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_moe_matmul_glu_takes_the_swiglu_in(runtime, reference_kernels, qtype, num_tokens):
    """moe_matmul_glu (the down projection over silu(gate) * up, int16 x) against swiglu then moe_matmul, bit for bit,
    and the NumPy reference."""
    from gpu_kernels.kernels import Kernels, fuses_glu

    kernels = Kernels(runtime, act_quant="int16")
    rng = np.random.default_rng(int(qtype) + 7 * num_tokens)
    num_slots, rows, cols, pairs = 6, 2048, 768, 8 * num_tokens
    assert fuses_glu(kernels.act_quant, qtype, cols)
    down = quant(rng, qtype, (num_slots, rows, cols))  # [S, R, B]
    tiles = np.stack([rng.integers(0, num_slots, pairs), np.arange(pairs), rng.random(pairs) < 0.8]).astype(np.int32)
    gate = (4 * rng.standard_normal((pairs, cols))).astype(np.float32)
    up = rng.standard_normal((pairs, cols)).astype(np.float32)
    dev = runtime.to_device
    dev_tiles = [dev(np.ascontiguousarray(t)) for t in tiles]
    fused, two = runtime.zeros((pairs, rows), np.float32), runtime.zeros((pairs, rows), np.float32)
    kernels.moe_matmul_glu(dev(down), qtype, dev(gate), dev(up), fused, *dev_tiles)
    act = dev(gate)
    kernels.swiglu(act, dev(up), act)
    kernels.moe_matmul(dev(down), qtype, act, two, *dev_tiles, tile_tokens=1)
    got = runtime.to_host(fused)
    np.testing.assert_array_equal(got, runtime.to_host(two))
    act_ref = np.empty_like(gate)
    reference_kernels.swiglu(gate, up, act_ref)
    x_ref, tol = decode_x("int16", qtype, act_ref)
    ref = np.zeros((pairs, rows), np.float32)
    reference_kernels.moe_matmul(down, qtype, x_ref, ref, *tiles)
    held = tiles[2] > 0
    assert rel_err(got[held], ref[held]) < tol


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32], ids=lambda q: q.name)
def test_fill_sms_keeps_the_one_token_results(runtime, reference_kernels, qtype):
    """Kernels(fill_sms=True): one-token matmuls of the 30B-A3B decode shapes with fewer blocks than multiprocessors
    take fewer rows a lane group; the results stay the default tuning's and the reference's."""
    from gpu_kernels.kernels import Kernels

    default, filled = Kernels(runtime), Kernels(runtime, fill_sms=True)
    rng = np.random.default_rng(int(qtype))
    for rows, cols in ((4608, 2048), (512, 2048), (128, 2048)):
        raw = quant(rng, qtype, (rows, cols))
        x = rng.standard_normal((1, cols)).astype(np.float32)
        outs = [runtime.empty((1, rows), np.float32) for _ in range(2)]
        for kernels, out in zip((default, filled), outs):
            kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
        got, want = runtime.to_host(outs[1]), runtime.to_host(outs[0])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        x_ref, tol = decode_x(default.act_quant, qtype, x)
        ref = np.empty((1, rows), np.float32)
        reference_kernels.matmul(raw, qtype, x_ref, ref)
        assert rel_err(got, ref) < tol
    fn, num_blocks, _, _ = filled._mm_launch(qtype, "matmul_1", 4608, 2048, raw.shape[-1], True)
    assert num_blocks >= min(runtime.multiprocessors, default._mm_launch(qtype, "matmul_1", 4608, 2048,
                                                                         raw.shape[-1], True)[1] * 4)
