"""The Gated DeltaNet kernels (src/delta_net.cu through gpu_kernels/delta_launch.py) against the NumPy references
(tests/delta_net_reference.py) on random data and state, at decode and prompt sizes, the delta rule token by token
and in its chunked form (GPU only)."""
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


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("num_tokens", [64, 150, 600])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_delta_rule_chunked(runtime, kernels, num_tokens, shape, tiled):
    """The chunked form's four kernels, each against its stage reference on the device's inputs, and together
    against the recurrence (out and the state after the last chunk)."""
    from gpu_kernels.delta_launch import DN_CHUNK

    hk, hv, dk, dv = shape
    rng = np.random.default_rng(num_tokens + 1)
    q, k, v = randn(rng, num_tokens, hk, dk), randn(rng, num_tokens, hk, dk), randn(rng, num_tokens, hv, dv)
    g, beta = ref.gates(randn(rng, num_tokens, hv), randn(rng, num_tokens, hv), -np.exp(randn(rng, hv, scale=0.5)),
                        randn(rng, hv) - 1.0)
    g, beta, state = g.astype(np.float32), beta.astype(np.float32), randn(rng, hv, dk, dv, scale=0.3)
    dev = {name: runtime.to_device(x) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta, state=state).items()}
    qn, kn = runtime.zeros(q.shape, np.float32), runtime.zeros(k.shape, np.float32)
    kernels.delta_l2norm(dev["q"], qn, dk ** -0.5)
    kernels.delta_l2norm(dev["k"], kn, 1.0)
    np.testing.assert_allclose(runtime.to_host(qn), ref.l2_normed(q, dk ** -0.5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runtime.to_host(kn), ref.l2_normed(k), rtol=1e-5, atol=1e-6)
    cum, attn = runtime.zeros(g.shape, np.float32), runtime.zeros((hv, num_tokens, DN_CHUNK), np.float32)
    u, w = runtime.zeros(v.shape, np.float32), runtime.zeros((num_tokens, hv, dk), np.float32)
    kernels.delta_chunk_prep(qn, kn, dev["v"], dev["g"], dev["beta"], cum, attn, u, w, tiled)
    host_qn, host_kn = runtime.to_host(qn), runtime.to_host(kn)
    for got, expected in zip((cum, attn, u, w), ref.chunk_prep(host_qn, host_kn, v, g, beta, tiled)):
        np.testing.assert_allclose(runtime.to_host(got), expected, rtol=1e-4, atol=1e-4)
    sc = runtime.zeros((-(-num_tokens // DN_CHUNK), hv, dk, dv), np.float32)
    host_cum, host_u, host_w = runtime.to_host(cum), runtime.to_host(u), runtime.to_host(w)
    kernels.delta_chunk_state(kn, cum, w, u, dev["state"], sc, tiled)
    expected_stage = ref.chunk_state(host_kn, host_cum, host_u, host_w, state, tiled)
    for got, expected in zip((u, sc, dev["state"]), expected_stage):
        np.testing.assert_allclose(runtime.to_host(got), expected, rtol=1e-4, atol=1e-4)
    out = runtime.zeros(v.shape, np.float32)
    kernels.delta_chunk_out(qn, cum, attn, u, sc, out, tiled)
    np.testing.assert_allclose(runtime.to_host(out), ref.chunk_out(host_qn, host_cum, runtime.to_host(attn),
                                                                   runtime.to_host(u), runtime.to_host(sc), tiled),
                               rtol=1e-4, atol=1e-4)
    expected, expected_state = ref.delta_rule_recurrent(q, k, v, g, beta, state, tiled)
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
