"""The hybrid MoE step (GpuBackend on the NumPy stand-in, reference kernels, the CPU backend as host) gives the
logits recorded before the engine's refactor (tests/recorded_logits.py), at 0, 50 and 100 % of experts resident,
with the decode relay (the default) and without it."""
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.backends.gpu import GpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.split_settings import SplitSettings
from tests.recorded_logits import check

TOKENS = [3, 17, 42, 5, 99, 23, 64, 7, 11, 250, 31, 8, 77, 120, 19, 2, 45]


def prompt_then_decode(model):
    """Logits [6, V]: a 5-token prompt's rows, then 4 one-token decode steps on one new sequence."""
    kv = model.new_sequence(64)
    out = [model.forward(Batch([SeqChunk(kv, 0, np.asarray(TOKENS[:5]), "all")]))]
    out += [model.forward(Batch([SeqChunk(kv, kv.length, np.asarray([t]))])) for t in TOKENS[5:9]]
    return np.concatenate(out)


@pytest.mark.parametrize("relay", [True, False], ids=["1", "0"])
@pytest.mark.parametrize("target", ["Q8_0", "Q4_K_M"])
def test_hybrid_step_gives_the_recorded_logits(gguf_models, numpy_runtime, reference_kernels, target, relay):
    weights = load_model(gguf_models("small" if target == "Q8_0" else "kquant", target)[0])
    c = weights.config
    rng = np.random.default_rng(5)
    for fraction in (0.0, 0.5, 1.0):
        resident = rng.random((c.num_layers, c.num_experts)) < fraction
        backend = GpuBackend(numpy_runtime, max_context=256, kv_sequences=2, resident=resident)
        backend.kernels = reference_kernels
        model = Model(weights, backend, host=CpuBackend(act_quant="float"), split=SplitSettings(decode_relay=relay))
        try:
            logits = prompt_then_decode(model)
        finally:
            model.close()
        check(f"hybrid-{target}-{fraction:.1f}-relay{int(relay)}", logits)
