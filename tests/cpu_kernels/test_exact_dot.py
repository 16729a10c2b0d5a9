"""The hi + lo int16 decode dots (cpu_kernels/exact_dot.py) against NumPy on random weights and activations: as
accurate as float32 x, far more than the int16 dots."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpu_kernels import exact_dot, q4_0, q4_k, q5_k, q6_k, q8_0

FORMATS = {T.Q4_K: q4_k, T.Q8_0: q8_0, T.Q6_K: q6_k, T.Q5_K: q5_k, T.Q4_0: q4_0}
SLOW = {T.Q6_K, T.Q5_K, T.Q4_0}


def rel_err(ours, ref):
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("qtype", [pytest.param(q, marks=[pytest.mark.slow] if q in SLOW else [], id=q.name)
                                   for q in FORMATS])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_hi_lo_dot_matches_numpy(qtype, num_tokens):
    rng = np.random.default_rng(int(qtype) + num_tokens)
    rows, cols = 72, 512  # rows: 4-row streams and a tail; cols: two super-blocks
    raw = FORMATS[qtype].random_blocks(rng, (rows, cols), 0.05)
    x = (rng.standard_normal((num_tokens, cols)) * np.exp(rng.standard_normal((num_tokens, cols)))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    ref = x.astype(np.float64) @ dequantize(raw, qtype).astype(np.float64).T  # [T, R]
    dot = exact_dot.split_dot(qtype)
    for serial in (True, False):
        out = np.empty((num_tokens, rows), np.float32)
        dot.matmul(raw, x, out, serial)
        assert rel_err(out, ref) <= 2e-6
    if num_tokens == 1:  # the int16 dot's rounding is what this one avoids
        int16 = np.empty((1, rows), np.float32)
        FORMATS[qtype].matmul(raw, x, int16, act_quant="int16")
        assert rel_err(int16, ref) > 10 * rel_err(out, ref)


def test_formats_without_it():
    assert exact_dot.split_dot(T.F32) is None and exact_dot.split_dot(T.IQ4_XS) is None
