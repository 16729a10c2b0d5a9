"""A hybrid decode step's host experts with their items claimed by the threads (CpuBackend.claimed_host_experts,
hybrid/backends/cpu_host_experts.py claimed_matmul_template): the same kernels on the same items as the static
shares, so the rows are bit-identical, at one and two threads, one and several tokens, for a quantized format and a
float one (their items made by different prepare functions)."""
import numba
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.formats import load_model
from hybrid.model import Model



def _case(rng, c, num_tokens, resident_share):
    k = c.num_experts_per_tok
    x = rng.standard_normal((num_tokens, c.hidden_size)).astype(np.float32)  # [n, H]
    ids = np.stack([rng.choice(c.num_experts, k, replace=False) for _ in range(num_tokens)]).astype(np.int32)  # [n, K]
    weights = rng.random((num_tokens, k)).astype(np.float32)  # [n, K]
    resident = rng.random(c.num_experts) < resident_share  # [E]
    resident[ids[0, 0]] = False  # at least one pair on the host
    return x, ids, weights, resident


@pytest.mark.parametrize("model_name,target", [("kquant", "Q4_K_M"), ("small", "F16")])
def test_claimed_host_experts_are_bit_identical(gguf_models, model_name, target):
    weights = load_model(gguf_models(model_name, target)[0])
    c = weights.config
    rng = np.random.default_rng(3)
    hosts = {claimed: CpuBackend() for claimed in (False, True)}
    for claimed, host in hosts.items():
        host.claimed_host_experts = claimed
    layers = {claimed: Model(weights, host).layers for claimed, host in hosts.items()}
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            for num_tokens, share in ((1, 0.0), (1, 0.5), (4, 0.5)):
                case = _case(rng, c, num_tokens, share)
                index = int(rng.integers(c.num_layers))
                static, claimed = (hosts[k].host_decode_experts(layers[k][index], *case) for k in (False, True))
                assert static[1] == claimed[1] > 0, (threads, num_tokens, share)
                assert np.abs(static[0]).max() > 0
                np.testing.assert_array_equal(claimed[0], static[0], err_msg=f"{threads} threads, {num_tokens} tokens")
    finally:
        numba.set_num_threads(before)
    assert hosts[True]._host_plans and all(plan.claimed for plan in hosts[True]._host_plans.values())
