"""The Gated DeltaNet kernels (src/delta_net.cu through gpu_kernels/delta_launch.py) against the NumPy references
(tests/delta_net_reference.py) on random data and state, at decode and prompt sizes (GPU only)."""
import numpy as np
import pytest

from tests import delta_net_reference as ref

pytestmark = pytest.mark.gpu

SHAPES = [(2, 4, 16, 24), (16, 32, 128, 128)]  # (Hk, Hv, Dk, Dv): tiny, and Qwen3-Next-80B's


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 150])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_delta_rule(runtime, kernels, num_tokens, shape, tiled):
    hk, hv, dk, dv = shape
    rng = np.random.default_rng(num_tokens)
    q, k, v = randn(rng, num_tokens, hk, dk), randn(rng, num_tokens, hk, dk), randn(rng, num_tokens, hv, dv)
    a, b = randn(rng, num_tokens, hv), randn(rng, num_tokens, hv)
    ssm_a, dt_bias, state = -np.exp(randn(rng, hv, scale=0.5)), randn(rng, hv) - 1.0, randn(rng, hv, dk, dv, scale=0.3)
    dev = {name: runtime.to_device(x) for name, x in dict(q=q, k=k, v=v, a=a, b=b, ssm_a=ssm_a, dt_bias=dt_bias,
                                                            state=state).items()}
    g, beta, out = (runtime.zeros(x.shape, np.float32) for x in (a, a, v))
    kernels.delta_gates(dev["a"], dev["b"], dev["ssm_a"], dev["dt_bias"], g, beta)
    expected_g, expected_beta = ref.gates(a, b, ssm_a, dt_bias)
    np.testing.assert_allclose(runtime.to_host(g), expected_g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runtime.to_host(beta), expected_beta, rtol=1e-5, atol=1e-6)
    kernels.delta_rule(dev["q"], dev["k"], dev["v"], g, beta, dev["state"], out, tiled)
    expected, expected_state = ref.delta_rule_recurrent(q, k, v, runtime.to_host(g), runtime.to_host(beta), state,
                                                        tiled)
    np.testing.assert_allclose(runtime.to_host(out), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(runtime.to_host(dev["state"]), expected_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 3, 150])
def test_conv1d_silu(runtime, kernels, num_tokens):
    rng = np.random.default_rng(2)
    channels, width = 8192, 4
    x, weight, state = randn(rng, num_tokens, channels), randn(rng, channels, width), randn(rng, width - 1, channels)
    d_state, out = runtime.to_device(state), runtime.zeros(x.shape, np.float32)
    kernels.delta_conv1d_silu(runtime.to_device(x), runtime.to_device(weight), d_state, out)
    expected, expected_state = ref.conv1d(x, weight, state)
    np.testing.assert_allclose(runtime.to_host(out), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(runtime.to_host(d_state), expected_state.astype(np.float32))


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_rmsnorm_gated_and_sigmoid_mul(runtime, kernels, num_tokens):
    rng = np.random.default_rng(3)
    x, z, w = randn(rng, num_tokens, 32, 128, scale=2.0), randn(rng, num_tokens, 32, 128), randn(rng, 128)
    out = runtime.zeros(x.shape, np.float32)
    kernels.rmsnorm_gated(runtime.to_device(x), runtime.to_device(z), runtime.to_device(w), 1e-6, out)
    np.testing.assert_allclose(runtime.to_host(out), ref.rmsnorm_gated(x, z, w, 1e-6), rtol=1e-5, atol=1e-5)
    y, gate = runtime.to_device(x), runtime.to_device(z)
    kernels.sigmoid_mul(y, gate)
    np.testing.assert_allclose(runtime.to_host(y), x / (1 + np.exp(-z.astype(np.float64))), rtol=1e-5, atol=1e-6)
    y, row_gate = runtime.to_device(x), randn(rng, num_tokens)
    kernels.sigmoid_mul(y, runtime.to_device(row_gate))
    np.testing.assert_allclose(runtime.to_host(y), x / (1 + np.exp(-row_gate.astype(np.float64)))[:, None, None],
                               rtol=1e-5, atol=1e-6)
