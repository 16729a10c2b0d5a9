"""GpuBackend's Python side on the CPU: NumPy arrays for device arrays, NumPy references for the kernels.

Checks the backend's shapes, arguments, work tiles and the expert cache's slots against the plain
CPU engine, at 0, 50 and 100 % of the experts resident; the GPU tests run the same with real kernels.
"""
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


def score(model):
    kv = model.new_sequence(256)
    prefill = model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:-1]), "all")]))
    decode = model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(TOKENS[-1:]))]))
    return np.concatenate([prefill, decode])


@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_gpu_backend_wiring_matches_cpu(gguf_models, numpy_runtime, reference_kernels, target):
    weights = load_model(gguf_models("small" if target == "Q8_0" else "kquant", target)[0])
    c = weights.config
    ref = score(Model(weights, CpuBackend()))
    rng = np.random.default_rng(0)
    for fraction in (0.0, 0.5, 1.0):
        backend = GpuBackend(numpy_runtime, kv_tokens=256, resident=rng.random((c.num_layers, c.num_experts)) < fraction)
        backend.kernels = reference_kernels
        got = score(Model(weights, backend, host=CpuBackend()))
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-4 * np.abs(ref).max(), err_msg=f"{fraction:.0%}")
