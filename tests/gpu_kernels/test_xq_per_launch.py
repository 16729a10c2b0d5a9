"""Kernels(xq_per_launch): x rounded to int16 once a launch (matmul.cu quantize_xq into global memory, the `_qx`
kernels reading it there) gives what the `_1q` / `_nq` kernels give rounding it in every block: the same rounding, the
same products in the same order. Decode shapes of the 30B-A3B layer: dense one token and 2 to 16 tokens, the experts'
one-row kernels (gate, gate + up in one launch, down over the SwiGLU) at 8 and 32 pairs with a non-resident pair."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hybrid.formats.synthetic import encode

FORMATS = ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4", "IQ3_S"]  # IQ4_XS, MXFP4: x in nibble order


def _pair(runtime, qtype):
    from gpu_kernels.kernels import XQ_KERNELS, Kernels

    per_block = Kernels(runtime, act_quant="int16")
    per_launch = Kernels(runtime, act_quant="int16")
    per_launch.xq_per_launch = frozenset(XQ_KERNELS)
    return per_block, per_launch


def _x(rng, rows, cols):
    """Random rows [rows, cols] whose 32-value blocks differ in scale (the rounding's scales matter)."""
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 10, (rows, cols // 32)).repeat(32, axis=1)
            ).astype(np.float32)


def _close(got, want, what):
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), what


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", FORMATS)
def test_dense_matmuls(runtime, qtype):
    q = Q[qtype]
    rng = np.random.default_rng(int(q))
    per_block, per_launch = _pair(runtime, q)
    for rows, cols in ((4608, 2048), (131, 2048), (2048, 4096)):
        raw = runtime.to_device(encode("w", rng.standard_normal((rows, cols)).astype(np.float32), q, rng).raw)
        for num_tokens in (1, 2, 4, 5, 16):
            x = runtime.to_device(_x(rng, num_tokens, cols))
            outs = [runtime.zeros((num_tokens, rows), np.float32) for _ in range(2)]
            per_block.matmul(raw, q, x, outs[0])
            per_launch.matmul(raw, q, x, outs[1])
            _close(runtime.to_host(outs[1]), runtime.to_host(outs[0]), (rows, cols, num_tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("num_pairs", [8, 32])
def test_expert_matmuls(runtime, qtype, num_pairs):
    q = Q[qtype]
    rng = np.random.default_rng(int(q) + num_pairs)
    per_block, per_launch = _pair(runtime, q)
    slots, hidden, ff = 16, 2048, 768
    gate, up = (runtime.to_device(encode("w", rng.standard_normal((slots, ff, hidden)).astype(np.float32) * 0.02, q,
                                         rng).raw) for _ in range(2))  # [S, R, B]
    down = runtime.to_device(encode("w", rng.standard_normal((slots, hidden, ff)).astype(np.float32) * 0.02, q,
                                    rng).raw)
    count = np.ones(num_pairs, np.int32)
    count[num_pairs // 2] = 0  # a pair whose expert is not resident
    tiles = [runtime.to_device(t.astype(np.int32)) for t in (rng.integers(0, slots, num_pairs),
                                                              np.arange(num_pairs), count)]
    xs = runtime.to_device(_x(rng, num_pairs, hidden))
    g, u = (runtime.to_device(_x(rng, num_pairs, ff)) for _ in range(2))
    results = []
    for kn in (per_block, per_launch):
        one, g2, u2 = (runtime.zeros((num_pairs, ff), np.float32) for _ in range(3))
        d = runtime.zeros((num_pairs, hidden), np.float32)
        kn.moe_matmul(gate, q, xs, one, *tiles, tile_tokens=1)
        kn.moe_matmul2(gate, up, q, xs, g2, u2, *tiles)
        kn.moe_matmul_glu(down, q, g, u, d, *tiles)
        results.append([runtime.to_host(a) for a in (one, g2, u2, d)])
    for name, want, got in zip(("moe_matmul", "moe_matmul2 gate", "moe_matmul2 up", "moe_matmul_glu"), *results):
        _close(got, want, (name, num_pairs))


@pytest.mark.gpu
@pytest.mark.parametrize("second", ["Q6_K", "IQ4_XS"])  # Q6_K: Q4_K's rounding read again; IQ4_XS: its own (nibbles)
def test_one_rounding_for_several_projections(runtime, second):
    """matmul(same_x=True) after a matmul of the same x (q + k, then v: GpuBackend.project_qkv) reads that matmul's
    rounding where the layouts agree and rounds again where they do not: the same outputs as rounding for each, at
    one token and four."""
    from gpu_kernels.kernels import xq_layout

    first, q2 = Q.Q4_K, Q[second]
    rng = np.random.default_rng(7 + int(q2))
    _, kernels = _pair(runtime, first)
    raws = [runtime.to_device(encode("w", rng.standard_normal((rows, 2048)).astype(np.float32), q, rng).raw)
            for rows, q in ((4608, first), (512, q2))]
    assert (xq_layout(first) == xq_layout(q2)) == (second == "Q6_K")
    for num_tokens in (1, 4):
        x = runtime.to_device(_x(rng, num_tokens, 2048))
        want = runtime.zeros((num_tokens, 512), np.float32)
        kernels.matmul(raws[1], q2, x, want)
        out = runtime.zeros((num_tokens, 4608), np.float32)
        kernels.matmul(raws[0], first, x, out)
        got = runtime.zeros((num_tokens, 512), np.float32)
        kernels.matmul(raws[1], q2, x, got, same_x=True)
        _close(runtime.to_host(got), runtime.to_host(want), (second, num_tokens))
