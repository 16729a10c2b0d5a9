"""The decode step's small ops after their block-shape rewrite (ops.cu rmsnorm and add_rmsnorm: a float4 a thread
and one shared-memory exchange; combine_rows: a row over several blocks; routing.cu's top-k: sorted held slots)
against the kernels they replace (previous_ops.cu) on random data at decode (1 token) and prefill (64, 512 tokens)
sizes: combine_rows and route_topk bit for bit, the norms to float32 rounding (their sums are added in another
order), and the NumPy references. The one-token matmuls with more slices in flight (matmul.cu's DECODE_PREFETCH
ring) against the double buffer, bit for bit."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu_kernels.sources import SRC

from .test_kernels import quant
from .test_routing_kernels import make_logits

pytestmark = pytest.mark.gpu

PREVIOUS = ("prev_rmsnorm", "prev_add_rmsnorm", "prev_combine_rows", "prev_route_topk")
TOKENS = [1, 64, 512]


@pytest.fixture(scope="module")
def previous(runtime):
    source = (SRC / "common.cuh").read_text() + (Path(__file__).parent / "previous_ops.cu").read_text()
    return runtime.compile("previous_ops", source, PREVIOUS)


def old_threads(work):
    """Kernels._threads as the previous launches took it (a power of two, 32 .. 256)."""
    return int(min(256, max(32, 1 << max(0, work - 1).bit_length())))


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("hidden", [2048, 2880, 7168, 128, 100, 99])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_norms_against_the_previous_kernels(runtime, kernels, reference_kernels, previous, num_tokens, hidden,
                                            offset):
    """rmsnorm and add_rmsnorm (rows one float past a 16-byte boundary take the scalar loop): the residual sum bit for
    bit, the norm within float32 rounding of the previous kernels' and the reference's."""
    rng = np.random.default_rng(num_tokens * hidden + offset)
    x = (3 * rng.standard_normal((num_tokens, hidden))).astype(np.float32)
    y = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    n = num_tokens * hidden

    def rows(values):
        buf = runtime.zeros((n + offset,), np.float32)
        view = buf[offset:].reshape(num_tokens, hidden)
        view[...] = runtime.to_device(values)
        return view

    dev_w, threads = runtime.to_device(w), old_threads(hidden)
    args = (np.int32(hidden), np.float32(1e-6))
    new_x, new_out, old_x, old_out = rows(x), rows(x), rows(x), rows(x)
    kernels.rmsnorm(new_x, dev_w, 1e-6, new_out)
    runtime.launch(previous["prev_rmsnorm"], (num_tokens,), (threads,), (old_x, dev_w, old_out) + args,
                   shared_mem=4 * threads)
    got, old = runtime.to_host(new_out), runtime.to_host(old_out)
    assert rel_err(got, old) < 1e-6
    ref = np.empty_like(x)
    reference_kernels.rmsnorm(x, w, 1e-6, ref)
    assert rel_err(got, ref) < 1e-5
    dev_y = rows(y)
    kernels.add_rmsnorm(new_x, dev_y, dev_w, 1e-6, new_out)
    runtime.launch(previous["prev_add_rmsnorm"], (num_tokens,), (threads,), (old_x, dev_y, dev_w, old_out) + args,
                   shared_mem=4 * threads)
    np.testing.assert_array_equal(runtime.to_host(new_x), runtime.to_host(old_x))
    assert rel_err(runtime.to_host(new_out), runtime.to_host(old_out)) < 1e-6
    ref_x, ref = x.copy(), np.empty_like(x)
    reference_kernels.add_rmsnorm(ref_x, y, w, 1e-6, ref)
    assert rel_err(runtime.to_host(new_out), ref) < 1e-5


@pytest.mark.parametrize("hidden", [2048, 2880, 200, 99])
@pytest.mark.parametrize("k", [8, 4, 1])
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_combine_rows_bit_exact_with_the_previous_kernel(runtime, kernels, reference_kernels, previous, num_tokens, k,
                                                         hidden):
    """Pairs not held here (row -1) skipped; the sum of each column in slot order, as before."""
    rng = np.random.default_rng(num_tokens * k + hidden)
    pairs = num_tokens * k
    held = rng.permutation(pairs)[:max(1, (3 * pairs) // 4)]
    row_of_pair = np.full(pairs, -1, np.int32)
    row_of_pair[held] = rng.permutation(len(held)).astype(np.int32)
    weights = rng.random(pairs).astype(np.float32)
    expert_out = rng.standard_normal((len(held), hidden)).astype(np.float32)
    dev = runtime.to_device
    args = (dev(expert_out), dev(row_of_pair), dev(weights))
    out, old = runtime.empty((num_tokens, hidden), np.float32), runtime.empty((num_tokens, hidden), np.float32)
    kernels.combine_rows(*args, k, out)
    runtime.launch(previous["prev_combine_rows"], (num_tokens,), (old_threads(hidden),),
                   args + (old, np.int32(k), np.int32(hidden)))
    got = runtime.to_host(out)
    np.testing.assert_array_equal(got, runtime.to_host(old))
    ref = np.empty((num_tokens, hidden), np.float32)
    reference_kernels.combine_rows(expert_out, row_of_pair, weights, k, ref)
    assert rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("tied", [False, True], ids=["normal", "tied"])
@pytest.mark.parametrize("num_experts,k", [(8, 8), (32, 1), (128, 8), (160, 6), (256, 16), (512, 10)])
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_route_topk_bit_exact_with_the_previous_kernel(runtime, kernels, previous, num_tokens, num_experts, k, tied):
    """The sorted-slot top-k: the same ids and weights as the scan it replaces, ties to the lower id."""
    rng = np.random.default_rng(num_tokens + num_experts + k)
    logits = runtime.to_device(make_logits(rng, num_tokens, num_experts, tied))
    for normalize in (True, False):
        ids, weights = runtime.empty((num_tokens, k), np.int32), runtime.empty((num_tokens, k), np.float32)
        kernels.route_topk(logits, k, normalize, ids, weights)
        old_ids, old_weights = runtime.empty((num_tokens, k), np.int32), runtime.empty((num_tokens, k), np.float32)
        per_block = min(4, num_tokens)
        runtime.launch(previous["prev_route_topk"], (-(-num_tokens // per_block),), (32 * per_block,),
                       (logits, old_ids, old_weights, np.int32(num_tokens), np.int32(num_experts), np.int32(k),
                        np.int32(normalize)))
        np.testing.assert_array_equal(runtime.to_host(ids), runtime.to_host(old_ids))
        np.testing.assert_array_equal(runtime.to_host(weights).view(np.uint32),
                                      runtime.to_host(old_weights).view(np.uint32))


@pytest.mark.parametrize("prefetch", [4, 8])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32, Q.F16], ids=lambda q: q.name)
def test_prefetch_ring_bit_exact_with_the_double_buffer(runtime, qtype, prefetch):
    """Kernels(prefetch=N): the one-token matmul (rows clamped at the end, blocks walking 1 or 3 runs of rows), the
    expert pair kernel and the SwiGLU down projection (some tiles skipped) give the default kernels' results."""
    from gpu_kernels.kernels import Kernels, fuses_glu

    rng = np.random.default_rng(int(qtype) + prefetch)
    dev = runtime.to_device
    for cols, rows, chunks, decode_rows in ((2048, 300, None, None), (768, 1000, 3, 1), (2048, 77, 3, 2)):
        raw, x = dev(quant(rng, qtype, (rows, cols))), dev(rng.standard_normal((1, cols)).astype(np.float32))
        outs = []
        for pf in (None, prefetch):
            kern = Kernels(runtime, prefetch=pf, row_chunks=chunks, decode_rows=decode_rows)
            out = runtime.zeros((1, rows), np.float32)
            kern.matmul(raw, qtype, x, out)
            outs.append(runtime.to_host(out))
        np.testing.assert_array_equal(outs[1], outs[0])
    slots, rows, cols, pairs = 4, 768, 512, 8
    gate, up = dev(quant(rng, qtype, (slots, rows, cols))), dev(quant(rng, qtype, (slots, rows, cols)))
    down = dev(quant(rng, qtype, (slots, cols, rows)))
    tiles = [dev(np.ascontiguousarray(t)) for t in np.stack([rng.integers(0, slots, pairs), np.arange(pairs),
                                                             rng.random(pairs) < 0.8]).astype(np.int32)]
    xs = dev(rng.standard_normal((pairs, cols)).astype(np.float32))
    got = []
    for pf in (None, prefetch):
        kern = Kernels(runtime, prefetch=pf)
        g, u, d = (runtime.zeros(shape, np.float32) for shape in ((pairs, rows), (pairs, rows), (pairs, cols)))
        kern.moe_matmul2(gate, up, qtype, xs, g, u, *tiles)
        if fuses_glu(kern.act_quant, qtype, rows):
            kern.moe_matmul_glu(down, qtype, g, u, d, *tiles)
        got.append([runtime.to_host(a) for a in (g, u, d)])
    for new, old in zip(got[1], got[0]):
        np.testing.assert_array_equal(new, old)
