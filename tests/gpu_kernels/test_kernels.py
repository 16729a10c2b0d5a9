"""Every GPU kernel against its NumPy reference on fresh random data, at decode and prefill sizes."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gpu_kernels.errors import KernelCompileError
from gpu_kernels.kernels import takes_int16
from hybrid.backends.gpu_experts import work_tiles
from hybrid.formats.synthetic import encode

from .conftest import xq_rounded

pytestmark = pytest.mark.gpu

FORMATS = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def quant(rng, qtype, shape):
    return encode("w", rng.standard_normal(shape).astype(np.float32), qtype, rng).raw


ACT_QUANTS = ["float", "int16", "auto"]
INT_TOL = 1e-4  # the `_1q` kernels against x rounded as they round it (K-quant min terms use the unrounded sums)


def decode_x(act_quant, qtype, x):
    """(x the reference multiplies, tolerance) for a one-token kernel taking x as act_quant."""
    if takes_int16(act_quant, qtype):
        return xq_rounded(x), INT_TOL
    return x, 1e-5


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_dequant_rows_bit_exact_with_gguf(runtime, kernels, qtype):
    rng = np.random.default_rng(int(qtype))
    raw = quant(rng, qtype, (41, 512))  # [R, B]
    row_ids = np.array([0, 40, 7, 7, 23], dtype=np.int64)
    out = runtime.empty((len(row_ids), 512), np.float32)
    kernels.dequant_rows(runtime.to_device(raw), qtype, runtime.to_device(row_ids), out)
    ref = np.asarray(gguf_dequantize(raw[row_ids], qtype), dtype=np.float32)
    assert np.array_equal(runtime.to_host(out), ref, equal_nan=True)


@pytest.mark.parametrize("decode_rows,lane_slices,min_blocks", [(1, 1, 0), (2, 2, 0), (4, 4, 0), (8, 8, 0), (8, 2, 0),
                                                               (2, 8, 4), (4, 8, 3), (4, 4, 4)])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("act_quant", ACT_QUANTS)
def test_matvec_tunings(runtime, reference_kernels, qtype, decode_rows, lane_slices, min_blocks, act_quant):
    """The one-token kernel at every tuning the benchmark sweeps (rows past the end, lanes past the slices,
    registers capped by launch bounds), x as float and, for INT_DECODE formats, as int16."""
    from gpu_kernels.kernels import Kernels

    rng = np.random.default_rng(int(qtype) + decode_rows)
    raw = quant(rng, qtype, (67, 2048))  # [R, B]
    x = (rng.standard_normal((1, 2048)) * rng.uniform(0.01, 10, (1, 64)).repeat(32, axis=1)).astype(np.float32)
    out = runtime.empty((1, 67), np.float32)
    kernels = Kernels(runtime, decode_rows=decode_rows, lane_slices=lane_slices, min_blocks=min_blocks,
                      act_quant=act_quant)
    kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    ref = np.empty((1, 67), np.float32)
    x_ref, tol = decode_x(act_quant, qtype, x)
    reference_kernels.matmul(raw, qtype, x_ref, ref)
    assert rel_err(runtime.to_host(out), ref) < tol


@pytest.mark.parametrize("num_tokens", [1, 19])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_matmul(runtime, kernels, reference_kernels, qtype, num_tokens):
    rng = np.random.default_rng(int(qtype) * 10 + num_tokens)
    raw = quant(rng, qtype, (67, 768))  # [R, B]
    x = rng.standard_normal((num_tokens, 768)).astype(np.float32)  # [T, C]
    out = runtime.empty((num_tokens, 67), np.float32)
    kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    ref = np.empty((num_tokens, 67), np.float32)
    x_ref, tol = decode_x(kernels.act_quant, qtype, x) if num_tokens == 1 else (x, 1e-5)
    reference_kernels.matmul(raw, qtype, x_ref, ref)
    assert rel_err(runtime.to_host(out), ref) < tol


@pytest.mark.parametrize("rows_per_expert,tile_tokens", [([1, 0, 2, 1], 1), ([1, 0, 2, 1], 8), ([13, 1, 30, 9], 8)],
                         ids=["decode", "decode-tiled", "prefill"])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("act_quant", ACT_QUANTS)
def test_moe_matmul_all_experts_in_one_launch(runtime, reference_kernels, qtype, rows_per_expert, tile_tokens,
                                              act_quant):
    from gpu_kernels.kernels import Kernels

    kernels = Kernels(runtime, act_quant=act_quant)
    rng = np.random.default_rng(int(qtype) + 100)
    raw = quant(rng, qtype, (4, 51, 768))  # [S, R, B]
    sizes = np.array(rows_per_expert)
    slots = np.flatnonzero(sizes)[::-1].copy()  # groups in another order than the slots
    row_starts = np.concatenate([[0], np.cumsum(sizes[slots])])
    tiles = work_tiles(row_starts, slots, tile_tokens)  # [3, W]
    x = rng.standard_normal((row_starts[-1], 768)).astype(np.float32)  # [N, C]
    out = runtime.empty((len(x), 51), np.float32)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out,
                       *[runtime.to_device(np.ascontiguousarray(t)) for t in tiles], tile_tokens=tile_tokens)
    ref = np.empty((len(x), 51), np.float32)
    x_ref, tol = decode_x(act_quant, qtype, x) if tile_tokens == 1 else (x, 1e-5)
    reference_kernels.moe_matmul(raw, qtype, x_ref, ref, *tiles)
    assert rel_err(runtime.to_host(out), ref) < tol


@pytest.mark.parametrize("row_chunks", [2, 3])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("act_quant", ["float", "int16"])
def test_one_token_blocks_walking_several_runs_of_rows(runtime, reference_kernels, qtype, row_chunks, act_quant):
    """One-token blocks that take several runs of rows (matmul.cu's block_walk): runs past the last row, a last
    block with fewer runs, x staged once for all runs (int16), the loads carried from one run into the next;
    dense and MoE."""
    from gpu_kernels.kernels import Kernels

    kernels = Kernels(runtime, decode_rows=2, lane_slices=4, act_quant=act_quant, row_chunks=row_chunks)
    rng = np.random.default_rng(int(qtype) * 7 + row_chunks)
    raw = quant(rng, qtype, (3, 300, 768))  # [S, R, B]: 300 rows, several blocks of runs, the last one short
    x = (rng.standard_normal((1, 768)) * rng.uniform(0.1, 4)).astype(np.float32)  # [1, C]
    x_ref, tol = decode_x(act_quant, qtype, x)
    out = runtime.empty((1, 300), np.float32)
    kernels.matmul(runtime.to_device(raw[1]), qtype, runtime.to_device(x), out)
    ref = np.empty((1, 300), np.float32)
    reference_kernels.matmul(raw[1], qtype, x_ref, ref)
    assert rel_err(runtime.to_host(out), ref) < tol
    tiles = work_tiles(np.array([0, 1]), np.array([2]), 1)  # [3, W]: the one token's pair with expert slot 2
    out = runtime.zeros((1, 300), np.float32)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out,
                       *[runtime.to_device(np.ascontiguousarray(t)) for t in tiles], tile_tokens=1)
    reference_kernels.moe_matmul(raw, qtype, x_ref, ref, *tiles)
    assert rel_err(runtime.to_host(out), ref) < tol


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("act_quant", ["float", "int16"])
def test_one_token_blocks_with_the_last_slices_peeled(runtime, reference_kernels, monkeypatch, qtype, act_quant):
    """test_one_token_blocks_walking_several_runs_of_rows with matmul.cu's PEEL_LAST_SLICE (a chunk's last slices, which
    load the next chunk's first, out of the slice loop), at 2 and 3 runs a block."""
    from gpu_kernels import kernels as kernels_module

    source, name = kernels_module.tuned_source, kernels_module.tuned_module_name
    monkeypatch.setattr(kernels_module, "tuned_source", lambda q, r, b, defines="": source(
        q, r, b, "#define PEEL_LAST_SLICE 1\n" + defines))
    monkeypatch.setattr(kernels_module, "tuned_module_name", lambda q, r, b: f"{name(q, r, b)}_peel")
    for row_chunks in (2, 3):
        test_one_token_blocks_walking_several_runs_of_rows(runtime, reference_kernels, qtype, row_chunks, act_quant)


@pytest.mark.parametrize("rows,width", [(1, 2048), (37, 96), (64, 128)])
def test_rmsnorm(runtime, kernels, reference_kernels, rows, width):
    rng = np.random.default_rng(rows)
    x = (3 * rng.standard_normal((rows, width))).astype(np.float32)
    w = rng.standard_normal(width).astype(np.float32)
    dev = runtime.to_device(x)
    kernels.rmsnorm(dev, runtime.to_device(w), 1e-6, dev)  # in place, as per-head norms run
    ref = np.empty_like(x)
    reference_kernels.rmsnorm(x, w, 1e-6, ref)
    assert rel_err(runtime.to_host(dev), ref) < 1e-5


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 1e6)])
def test_rope_neox_matches_cpu_kernel(runtime, kernels, head_dim, theta):
    from cpu_kernels.rope import inv_freq_f32, rope_neox

    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((9, 4, head_dim)).astype(np.float32)  # [T, nH, D]
    positions = np.array([0, 1, 2, 100, 511, 1000, 2047, 4000, 8191], dtype=np.int64)
    dev = runtime.to_device(x)
    kernels.rope_neox(dev, runtime.to_device(positions), runtime.to_device(inv_freq_f32(theta, head_dim)))
    ref = np.empty_like(x)
    rope_neox(x, positions, theta, ref)
    assert np.abs(runtime.to_host(dev) - ref).max() < 2e-5


def test_swiglu(runtime, kernels, reference_kernels):
    rng = np.random.default_rng(5)
    gate = (10 * rng.standard_normal((13, 300))).astype(np.float32)
    up = rng.standard_normal((13, 300)).astype(np.float32)
    dev = runtime.to_device(gate)
    kernels.swiglu(dev, runtime.to_device(up), dev)
    ref = np.empty_like(gate)
    reference_kernels.swiglu(gate, up, ref)
    assert rel_err(runtime.to_host(dev), ref) < 1e-6


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("num_tokens,num_experts,k", [(1, 8, 2), (33, 128, 8)])
def test_route_topk(runtime, kernels, reference_kernels, num_tokens, num_experts, k, normalize):
    rng = np.random.default_rng(num_experts + k)
    logits = rng.standard_normal((num_tokens, num_experts)).astype(np.float32)
    ids = runtime.empty((num_tokens, k), np.int32)
    weights = runtime.empty((num_tokens, k), np.float32)
    kernels.route_topk(runtime.to_device(logits), k, normalize, ids, weights)
    ref_ids, ref_w = np.empty((num_tokens, k), np.int64), np.empty((num_tokens, k), np.float32)
    reference_kernels.route_topk(logits, k, normalize, ref_ids, ref_w)
    assert (runtime.to_host(ids) == ref_ids).all()
    assert rel_err(runtime.to_host(weights), ref_w) < 1e-5


def test_gather_and_combine_rows(runtime, kernels, reference_kernels):
    rng = np.random.default_rng(7)
    num_tokens, k, hidden = 11, 4, 200
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    order = rng.permutation(num_tokens * k)[:25].astype(np.int32)  # a subset of the pairs
    xs = runtime.empty((len(order), hidden), np.float32)
    kernels.gather_rows(runtime.to_device(x), runtime.to_device(order), k, xs)
    assert np.array_equal(runtime.to_host(xs), x[order // k])
    row_of_pair = np.full(num_tokens * k, -1, np.int32)
    row_of_pair[order] = np.arange(len(order))
    weights = rng.random(num_tokens * k).astype(np.float32)
    expert_out = rng.standard_normal((len(order), hidden)).astype(np.float32)
    out = runtime.empty((num_tokens, hidden), np.float32)
    kernels.combine_rows(runtime.to_device(expert_out), runtime.to_device(row_of_pair), runtime.to_device(weights),
                         k, out)
    ref = np.empty((num_tokens, hidden), np.float32)
    reference_kernels.combine_rows(expert_out, row_of_pair, weights, k, ref)
    assert rel_err(runtime.to_host(out), ref) < 1e-6


def test_pack_decode_and_add_from_mapped_host_memory(runtime, kernels):
    """A decode token's routing and row packed side by side; a host row added straight from pinned memory
    (the device address the runtime maps it at)."""
    rng = np.random.default_rng(8)
    k, hidden = 8, 300
    ids = rng.integers(0, 64, (1, k)).astype(np.int32)
    weights = rng.random((1, k)).astype(np.float32)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    packed = runtime.empty((2 * k + hidden,), np.float32)
    kernels.pack_decode(runtime.to_device(ids), runtime.to_device(weights), runtime.to_device(x), packed)
    got = runtime.to_host(packed)
    assert np.array_equal(got[:k].view(np.int32), ids[0]) and np.array_equal(got[k:2 * k], weights[0])
    assert np.array_equal(got[2 * k:], x[0])
    host = runtime.pinned_empty((1, hidden), np.float32)
    host[:] = rng.standard_normal((1, hidden))
    address = runtime.mapped_address(host)
    assert address  # CUDA maps pinned memory into the device's address space
    out = runtime.to_device(x)
    kernels.add_into(out, np.uint64(address))
    assert np.array_equal(runtime.to_host(out), x + host)


def test_compile_error_names_the_module(runtime):
    with pytest.raises(KernelCompileError, match="'broken_module'") as info:
        runtime.compile("broken_module", 'extern "C" __global__ void f(float* x) { x[0] = nope; }', ["f"])
    assert "nope" in str(info.value)
