"""The routers of routing.cu (a lane group a token) against the one-thread-a-token kernels they replace
(serial_routers.cu: the same ids, the same weights but for the order of a float64 sum) and the NumPy references, at
decode (1 token) and prefill (64, 512 tokens) sizes, 8 to 512 experts, top 1 to 16, with ties."""
from pathlib import Path

import numpy as np
import pytest

from gpu_kernels.sources import SRC

pytestmark = pytest.mark.gpu

SERIAL = ("serial_route_topk", "serial_route_topk_softmax", "serial_route_sigmoid")
TOKENS = [1, 64, 512]
SHAPES = [(8, 1), (8, 8), (32, 4), (128, 8), (160, 6), (256, 16), (512, 10)]  # (E, K)


@pytest.fixture(scope="module")
def serial(runtime):
    source = (SRC / "common.cuh").read_text() + (Path(__file__).parent / "serial_routers.cu").read_text()
    return runtime.compile("serial_routers", source, SERIAL)


def make_logits(rng, num_tokens, num_experts, tied):
    """Normal logits, or halves of small integers (many equal values: ties go to the lower id)."""
    if tied:
        return (rng.integers(-4, 5, (num_tokens, num_experts)) / 2).astype(np.float32)
    return (2 * rng.standard_normal((num_tokens, num_experts))).astype(np.float32)


def run_serial(runtime, fn, logits, k, arrays, after=()):
    """A serial router over logits [T, E] (one thread a token) into fresh ids, weights [T, K]."""
    num_tokens, num_experts = logits.shape
    ids, weights = runtime.empty((num_tokens, k), np.int32), runtime.empty((num_tokens, k), np.float32)
    args = (runtime.to_device(logits), *arrays, ids, weights, np.int32(num_tokens), np.int32(num_experts),
            np.int32(k), *after)
    runtime.launch(fn, (-(-num_tokens // 64),), (64,), args)
    return runtime.to_host(ids), runtime.to_host(weights)


def run_new(runtime, launch, logits, k):
    num_tokens = logits.shape[0]
    ids, weights = runtime.empty((num_tokens, k), np.int32), runtime.empty((num_tokens, k), np.float32)
    launch(runtime.to_device(logits), ids, weights)
    return runtime.to_host(ids), runtime.to_host(weights)


def check(got, want, ref=None):
    """got and want (ids, weights): the same ids, weights to a float64 sum's order; ref: the NumPy reference's."""
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=0)
    if ref is not None:
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tied", [False, True], ids=["normal", "tied"])
@pytest.mark.parametrize("num_experts,k", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_route_topk(runtime, kernels, reference_kernels, serial, num_tokens, num_experts, k, tied):
    rng = np.random.default_rng(num_tokens * num_experts + k)
    logits = make_logits(rng, num_tokens, num_experts, tied)
    for normalize in (True, False):
        got = run_new(runtime, lambda x, i, w: kernels.route_topk(x, k, normalize, i, w), logits, k)
        want = run_serial(runtime, serial["serial_route_topk"], logits, k, (), (np.int32(normalize),))
        ref_ids, ref_w = np.empty((num_tokens, k), np.int64), np.empty((num_tokens, k), np.float32)
        reference_kernels.route_topk(logits, k, normalize, ref_ids, ref_w)
        check(got, want, (ref_ids, ref_w))


@pytest.mark.parametrize("tied", [False, True], ids=["normal", "tied"])
@pytest.mark.parametrize("num_experts,k", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_route_topk_softmax(runtime, kernels, reference_kernels, serial, num_tokens, num_experts, k, tied):
    rng = np.random.default_rng(num_tokens * num_experts + k + 1)
    logits = make_logits(rng, num_tokens, num_experts, tied)
    got = run_new(runtime, lambda x, i, w: kernels.route_topk_softmax(x, k, i, w), logits, k)
    want = run_serial(runtime, serial["serial_route_topk_softmax"], logits, k, ())
    ref_ids, ref_w = np.empty((num_tokens, k), np.int64), np.empty((num_tokens, k), np.float32)
    reference_kernels.route_topk_softmax(logits, k, ref_ids, ref_w)
    check(got, want, (ref_ids, ref_w))


# (E, K, groups, groups kept, normalize, scale)
SIGMOID_CASES = [(16, 4, 4, 2, True, 2.5), (128, 8, 1, 1, True, 2.5), (160, 8, 1, 1, True, 1.0),
                 (256, 8, 8, 4, True, 2.5), (128, 4, 64, 3, False, 1.5), (512, 16, 16, 5, True, 1.0)]


@pytest.mark.parametrize("tied", [False, True], ids=["normal", "tied"])
@pytest.mark.parametrize("num_experts,k,num_groups,topk_groups,normalize,scale", SIGMOID_CASES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_route_sigmoid(runtime, kernels, reference_kernels, serial, num_tokens, num_experts, k, num_groups,
                       topk_groups, normalize, scale, tied):
    rng = np.random.default_rng(num_tokens * num_experts + k + 2)
    logits = make_logits(rng, num_tokens, num_experts, tied)
    bias = np.zeros(num_experts, np.float32) if tied else (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
    dev_bias = runtime.to_device(bias)
    got = run_new(runtime, lambda x, i, w: kernels.route_sigmoid(x, dev_bias, k, num_groups, topk_groups, normalize,
                                                                  scale, i, w), logits, k)
    want = run_serial(runtime, serial["serial_route_sigmoid"], logits, k, (dev_bias,),
                      (np.int32(num_groups), np.int32(topk_groups), np.int32(normalize), np.float32(scale)))
    ref = None
    if not tied:  # float64 scores may split float32 ties of the group sums
        ref = np.empty((num_tokens, k), np.int64), np.empty((num_tokens, k), np.float32)
        reference_kernels.route_sigmoid(logits, bias, k, num_groups, topk_groups, normalize, scale, *ref)
    check(got, want, ref)


def test_router_bounds(kernels, runtime):
    logits = runtime.zeros((2, 600), np.float32)
    ids, weights = runtime.empty((2, 8), np.int32), runtime.empty((2, 8), np.float32)
    with pytest.raises(ValueError, match="at most 512 experts"):
        kernels.route_topk(logits, 8, True, ids, weights)
