"""Longer prompt chunks while nobody decodes (the solo_chunk_tokens setting: scheduler solo_step_tokens,
GpuBackend.solo_chunk_tokens, LLM._prefill): a prompt read alone takes the backend's solo chunks; a slot that decodes
brings back the decode share's budget; the GPU backend offers them only where asked, every expert is resident and VRAM
holds their activations."""
import numpy as np
import pytest

from gpu_kernels.numpy_runtime import NumpyRuntime
from hybrid.backends.gpu import GpuBackend
from hybrid.formats import load_model
from tests.hybrid.test_scheduler import FakeClock, make_scheduler, request, run_step


def test_a_prompt_read_alone_takes_solo_chunks_until_a_slot_decodes():
    clock = FakeClock()
    sched = make_scheduler(2, clock, max_step_tokens=64, solo_step_tokens=256)
    first, second = request(300), request(500)
    sched.add(first)
    assert [len(c.token_ids) for c in run_step(sched, clock)[0].chunks] == [256]
    step, _ = run_step(sched, clock)
    assert [len(c.token_ids) for c in step.chunks] == [44]
    sched.add(second)
    read = 0
    while read < 500:  # the first decodes: the share rule and its 64-token budget again
        step, _ = run_step(sched, clock)
        assert step.num_decode >= 1 and step.num_prompt <= 64 - 1
        read += step.num_prompt


def test_without_solo_tokens_a_step_reads_its_budget():
    clock = FakeClock()
    sched = make_scheduler(1, clock, max_step_tokens=64, solo_step_tokens=None)
    sched.add(request(300))
    step, _ = run_step(sched, clock)
    assert step.num_prompt == 64


@pytest.fixture
def weights(gguf_models):
    return load_model(gguf_models("small", "Q8_0")[0])


@pytest.mark.parametrize("solo,share,kv_resident,memory_mib,expect", [
    (2048, 1.0, None, 65536, 2048),
    (None, 1.0, None, 65536, None),  # not asked for (the default)
    (256, 1.0, None, 65536, None),  # no more than chunk_tokens
    (2048, 0.5, None, 65536, None),  # experts on the host: the chunk's host part decides its pace
    (2048, 1.0, 128, 65536, None),  # a resident KV window is sized for chunk_tokens
    (2048, 1.0, None, None, None),  # no room past the budget for the longer chunk's activations
])
def test_gpu_backend_offers_solo_chunks_where_every_expert_is_resident(weights, solo, share, kv_resident, memory_mib,
                                                                       expect):
    from hybrid.model import Model

    c = weights.config
    resident = np.random.default_rng(0).random((c.num_layers, c.num_experts)) < share
    if memory_mib is None:  # what the budget takes at 512-token chunks, and a little
        probe = GpuBackend(NumpyRuntime(), max_context=256, resident=resident)
        Model(weights, probe)
        b = probe.budget
        memory = b.dense + b.kv + b.scratch + b.reserve + b.expert_cache + (1 << 20)
    else:
        memory = memory_mib << 20
    backend = GpuBackend(NumpyRuntime(memory_bytes=memory), max_context=256, resident=resident,
                         kv_resident=kv_resident, solo_chunk_tokens=solo)
    Model(weights, backend)
    assert backend.solo_chunk_tokens == expect


def test_llm_reads_a_prompt_in_the_backends_solo_chunks(gguf_models, monkeypatch):
    """LLM.generate's prompt read (no engine) takes solo_chunk_tokens a chunk; score, which wants every position's
    logits, keeps PREFILL_CHUNK."""
    from hybrid import LLM, llm as llm_module

    monkeypatch.setattr(llm_module, "PREFILL_CHUNK", 8)

    llm = LLM(gguf_models("small", "Q8_0")[0], max_context=128)
    llm.model.backend.solo_chunk_tokens = 16
    sizes, forward = [], llm.model.forward
    llm.model.forward = lambda batch: sizes.append(len(batch.chunks[0].token_ids)) or forward(batch)
    llm.generate(list(range(3, 43)), max_tokens=1, temperature=0)
    assert sizes == [16, 16, 8]
    sizes.clear()
    llm.score(list(range(3, 43)))
    assert sizes == [8] * 5
    llm.close()
