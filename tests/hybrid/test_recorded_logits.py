"""Every CPU runner gives the logits recorded before the engine's refactor (tests/recorded_logits.py):
op by op, the compiled decode layer at one thread, the fused decode layer at every thread; every format."""
import numba
import numpy as np
import pytest

from hybrid.backends import CpuBackend
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from tests.recorded_logits import check

CASES = [("small", "F32"), ("small", "F16"), ("small", "BF16"), ("small", "Q8_0"), ("small", "Q4_0"),
         ("kquant", "Q4_K"), ("kquant", "Q5_K"), ("kquant", "Q6_K"), ("kquant", "Q4_K_M")]
FUSED_BY_DEFAULT = {"F16", "Q8_0", "Q4_K_M"}  # formats whose fused layer other default tests compile
COMPILED_SLOW = {"Q4_K"}  # Q4_K_M's compiled layer runs its kernels (tests/hybrid/test_compiled_decode.py)
PROMPTS = ([5, 17, 300, 42, 7, 99, 12, 64], [8, 250, 11, 3, 77])


def prefill_then_decode(model, steps=3):
    """Logits [1 + steps, S, V]: each prompt's last row, then `steps` decode steps of both sequences at once,
    each fed its own greedy token."""
    seqs = [model.new_sequence(64) for _ in PROMPTS]
    last = np.stack([model.forward(Batch([SeqChunk(kv, 0, np.array(p, np.int64))]))[-1]
                     for kv, p in zip(seqs, PROMPTS)])
    out = [last]
    for _ in range(steps):
        chunks = [SeqChunk(kv, kv.length, np.array([int(np.argmax(row))], np.int64)) for kv, row in zip(seqs, last)]
        last = model.forward(Batch(chunks))  # [S, V]
        out.append(last)
    return np.stack(out)


def runner_params():
    for size, target in CASES:
        yield pytest.param(size, target, "op_by_op", id=f"op_by_op-{target}")
        yield pytest.param(size, target, "compiled", id=f"compiled-{target}",
                           marks=[pytest.mark.slow] if target in COMPILED_SLOW else [])
        yield pytest.param(size, target, "fused", id=f"fused-{target}",
                           marks=[] if target in FUSED_BY_DEFAULT else [pytest.mark.slow])


@pytest.mark.parametrize("size,target,runner", list(runner_params()))
def test_runner_gives_the_recorded_logits(gguf_models, size, target, runner):
    path, _ = gguf_models(size, target)
    before = numba.get_num_threads()
    numba.set_num_threads(1 if runner == "compiled" else numba.config.NUMBA_NUM_THREADS)
    try:
        model = Model(load_model(path), CpuBackend(fused_decode=runner == "fused"),
                      compiled_decode=runner != "op_by_op")
        logits = prefill_then_decode(model)
        assert model.runner.last_path == {"op_by_op": "plain"}.get(runner, runner)
    finally:
        numba.set_num_threads(before)
    check(f"{runner}-{target}", logits)
