"""Gated DeltaNet kernels (cpu_kernels/delta_net.py) against the NumPy references (tests/delta_net_reference.py),
and the references against transformers' torch functions of modeling_qwen3_next, on random data and state."""
import numpy as np
import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from cpu_kernels import delta_net
from tests import delta_net_reference as ref

HK, HV, DK, DV, WIDTH = 2, 4, 16, 24, 4  # two value heads a key head; Dk != Dv catches a transposed state


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def delta_inputs(num_tokens, seed=0):
    """(q, k, v, g, beta, state): random, the decay in (exp(-1.2), 1) as trained models' gates give."""
    rng = np.random.default_rng(seed)
    q, k = randn(rng, num_tokens, HK, DK), randn(rng, num_tokens, HK, DK)
    v = randn(rng, num_tokens, HV, DV)
    a, b = randn(rng, num_tokens, HV), randn(rng, num_tokens, HV)
    g, beta = ref.gates(a, b, -np.exp(randn(rng, HV, scale=0.5)), randn(rng, HV, scale=0.3) - 1.0)
    return q, k, v, g.astype(np.float32), beta.astype(np.float32), randn(rng, HV, DK, DV, scale=0.3)


def torch_of(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))[None] for a in arrays]


@pytest.mark.parametrize("num_tokens", [1, 150])
def test_reference_matches_transformers(num_tokens):
    q, k, v, g, beta, state = delta_inputs(num_tokens)
    tq, tk, tv, tg, tb = torch_of(q, k, v, g, beta)
    ts = torch.from_numpy(state.astype(np.float64))[None]
    for fn, ours in ((hf.torch_recurrent_gated_delta_rule, ref.delta_rule_recurrent),
                     (hf.torch_chunk_gated_delta_rule, ref.delta_rule_chunked)):
        out, final = fn(tq, tk, tv, g=tg, beta=tb, initial_state=ts.clone(), output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        mine, mine_state = ours(q, k, v, g, beta, state)
        np.testing.assert_allclose(mine, out[0].numpy(), rtol=1e-4, atol=1e-5)  # torch's are float32 inside
        np.testing.assert_allclose(mine_state, final[0].numpy(), rtol=1e-4, atol=1e-5)


def test_conv_and_gated_norm_references_match_transformers():
    rng = np.random.default_rng(1)
    channels, prompt = 40, 9
    x, weight, state = randn(rng, prompt + 1, channels), randn(rng, channels, WIDTH), randn(rng, WIDTH - 1, channels)
    tw = torch.from_numpy(weight.astype(np.float64))
    full = np.concatenate([state, x])
    whole = hf.causal_conv1d_fn(torch.from_numpy(full.T.astype(np.float64))[None], tw, activation="silu")
    out, new_state = ref.conv1d(x[:prompt], weight, state)
    np.testing.assert_allclose(out, whole[0].numpy().T[WIDTH - 1:WIDTH - 1 + prompt], rtol=1e-12)
    conv_state = torch.from_numpy(np.concatenate([new_state[:1], new_state]).T.astype(np.float64))[None]
    step = hf.causal_conv1d_update(torch.from_numpy(x[prompt:].T.astype(np.float64))[None], conv_state, tw,
                                   activation="silu")  # its state holds W inputs, the oldest never read
    np.testing.assert_allclose(ref.conv1d(x[prompt:], weight, new_state)[0], step[0].numpy().T, rtol=1e-12)

    z, w = randn(rng, 5, HV, DV), randn(rng, DV)
    hv = randn(rng, 5, HV, DV)
    norm = hf.Qwen3NextRMSNormGated(DV, eps=1e-6).double()
    norm.weight.data = torch.from_numpy(w.astype(np.float64))
    expected = norm(torch.from_numpy(hv.astype(np.float64)), torch.from_numpy(z.astype(np.float64)))
    np.testing.assert_allclose(ref.rmsnorm_gated(hv, z, w, 1e-6), expected.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [1, 3, 150])
def test_conv1d_silu(num_tokens):
    rng = np.random.default_rng(2)
    channels = 2 * HK * DK + HV * DV
    x, weight, state = randn(rng, num_tokens, channels), randn(rng, channels, WIDTH), randn(rng, WIDTH - 1, channels)
    expected, expected_state = ref.conv1d(x, weight, state)
    for kernel in (delta_net.conv1d_silu, delta_net.conv1d_silu_serial):
        out, s = np.empty_like(x), state.copy()
        kernel(x, np.ascontiguousarray(weight.T), s, out)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(s, expected_state.astype(np.float32))


@pytest.mark.slow  # by default the model tests run them (tests/hybrid/test_qwen3next*.py), compiled once
@pytest.mark.parametrize("num_tokens,tiled", [(1, False), (7, True), (150, False)])
def test_delta_rule_kernels(num_tokens, tiled):
    q, k, v, g, beta, state = delta_inputs(num_tokens, seed=num_tokens)
    expected, expected_state = ref.delta_rule_recurrent(q, k, v, g, beta, state, tiled)
    kernels = [delta_net.delta_rule_recurrent, delta_net.delta_rule_chunked]
    if num_tokens == 1:
        kernels.append(delta_net.delta_rule_recurrent_serial)
    for kernel in kernels:
        out, s = np.empty_like(v), state.copy()
        kernel(q, k, v, g, beta, s, out, tiled)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=kernel.__name__)
        np.testing.assert_allclose(s, expected_state, rtol=1e-4, atol=1e-4, err_msg=kernel.__name__)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_delta_rule_rows_past_a_multiple_of_four(num_tokens):
    """Key heads of Dk % 4 != 0 (the kernel's passes take four state rows at a time, then the rest one by one)."""
    rng = np.random.default_rng(7)
    dk = 18
    q, k, v = randn(rng, num_tokens, HK, dk), randn(rng, num_tokens, HK, dk), randn(rng, num_tokens, HV, DV)
    g, beta = ref.gates(randn(rng, num_tokens, HV), randn(rng, num_tokens, HV), -np.exp(randn(rng, HV, scale=0.5)),
                        randn(rng, HV, scale=0.3) - 1.0)
    g, beta, state = g.astype(np.float32), beta.astype(np.float32), randn(rng, HV, dk, DV, scale=0.3)
    expected, expected_state = ref.delta_rule_recurrent(q, k, v, g, beta, state)
    for kernel in (delta_net.delta_rule_recurrent, delta_net.delta_rule_recurrent_serial):
        out, s = np.empty_like(v), state.copy()
        kernel(q, k, v, g, beta, s, out)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4, err_msg=kernel.__name__)
        np.testing.assert_allclose(s, expected_state, rtol=1e-4, atol=1e-4, err_msg=kernel.__name__)


@pytest.mark.slow
def test_prompt_then_decode_continues_the_state():
    """A prompt by chunks then tokens one by one equals the whole sequence at once."""
    q, k, v, g, beta, state = delta_inputs(70, seed=5)
    expected, _ = ref.delta_rule_recurrent(q, k, v, g, beta, state)
    out, s = np.empty_like(v), state.copy()
    delta_net.delta_rule_chunked(q[:67], k[:67], v[:67], g[:67], beta[:67], s, out[:67])
    for t in range(67, 70):
        delta_net.delta_rule_recurrent(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s, out[t:t + 1])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_gates_and_gated_norm(num_tokens):
    rng = np.random.default_rng(3)
    a, b = randn(rng, num_tokens, HV, scale=4.0), randn(rng, num_tokens, HV, scale=4.0)
    ssm_a, dt_bias = -np.exp(randn(rng, HV)), randn(rng, HV)
    g, beta = np.empty_like(a), np.empty_like(a)
    delta_net.delta_gates(a, b, ssm_a, dt_bias, g, beta)
    expected_g, expected_beta = ref.gates(a, b, ssm_a, dt_bias)
    np.testing.assert_allclose(g, expected_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(beta, expected_beta, rtol=1e-5, atol=1e-6)

    x, z, w = randn(rng, num_tokens, HV, DV, scale=2.0), randn(rng, num_tokens, HV, DV), randn(rng, DV)
    expected = ref.rmsnorm_gated(x, z, w, 1e-6)
    for kernel in (delta_net.rmsnorm_gated, delta_net.rmsnorm_gated_serial):
        out = np.empty_like(x)
        kernel(x, z, w, 1e-6, out)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
