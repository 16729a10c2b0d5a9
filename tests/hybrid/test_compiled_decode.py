"""The compiled decode layer (hybrid/backends/cpu_decode.py) and the layer as one parallel region
(cpu_decode_fused.py) against the op-by-op path they replace: the same logits, bit for bit, for every
weight format, one and two sequences, one thread and all threads."""
from dataclasses import dataclass, replace

import numpy as np
import pytest

import hybrid
from hybrid.backends import CpuBackend
from hybrid.backends.cpu_decode import DecodeStep
from hybrid.batch import Batch, SeqChunk
from hybrid.formats import load_model
from hybrid.model import Model
from hybrid.backends.cpu_layer import CompiledRunner
from hybrid.runners import PlainRunner

CASES = [("small", "F32"), ("small", "F16"), ("small", "BF16"), ("small", "Q8_0"), ("small", "Q4_0"),
         ("kquant", "Q4_K"), ("kquant", "Q5_K"), ("kquant", "Q6_K"), ("kquant", "Q4_K_M")]
PROMPTS = ([5, 17, 300, 42, 7, 99], [8, 250, 11, 3])


@pytest.fixture
def numba_threads(request):
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1 if request.param == 1 else numba.config.NUMBA_NUM_THREADS)
    yield
    numba.set_num_threads(before)


# At all threads a step runs each format's fused layer, whose cold compile takes ~40 s a format on a 2-core CI
# machine. The default suite keeps the formats whose fused layer other default tests compile anyway (F16 and Q4_K_M
# in test_fused_layer_is_bit_identical; Q8_0 in the GPU wiring tests' CPU reference; Q4_K_M, whose Q6_K tensors
# take the Q6_K code, in test_act_quant's int8 decode); the other five run with `slow`. One thread covers every
# format by default but Q4_K, whose kernels Q4_K_M's compiled layer runs on its Q4_K tensors (q, k, gate and up; a
# compiled layer per format costs ~15 s cold).
FUSED_BY_DEFAULT = {"F16", "Q8_0", "Q4_K_M"}
COMPILED_SLOW = {"Q4_K"}


def threaded_case(size, target, threads):
    slow = target not in FUSED_BY_DEFAULT if threads == "all" else target in COMPILED_SLOW
    return pytest.param(size, target, threads, id=f"threads-{threads}-{size}-{target}",
                        marks=[pytest.mark.slow] if slow else [])


THREADED_CASES = [threaded_case(s, t, n) for n in (1, "all") for s, t in CASES]


def decode(model, compiled, prompts, steps, capacity=64):
    """Logits [steps, S, V] of `steps` decode steps of one batch over the prompts' sequences (each
    prefilled on its own first), feeding each sequence its own greedy token."""
    model.compiled_decode = compiled
    seqs = [model.new_sequence(capacity) for _ in prompts]
    last = [model.forward(Batch([SeqChunk(kv, 0, np.array(p, np.int64))]))[-1] for kv, p in zip(seqs, prompts)]
    out = []
    for _ in range(steps):
        chunks = [SeqChunk(kv, kv.length, np.array([int(np.argmax(row))], np.int64)) for kv, row in zip(seqs, last)]
        last = model.forward(Batch(chunks))  # [S, V]
        out.append(last)
    return np.stack(out)


@pytest.mark.parametrize("size,target,numba_threads", THREADED_CASES, indirect=["numba_threads"])
def test_compiled_decode_is_bit_identical(gguf_models, size, target, numba_threads):
    path, _ = gguf_models(size, target)
    model = hybrid.LLM(path, device="cpu").model
    for prompts in (PROMPTS[:1], PROMPTS):
        op_by_op = decode(model, False, prompts, 3)
        assert isinstance(model.runner, PlainRunner)
        compiled = decode(model, True, prompts, 3)
        assert len(model.runner.plans) == model.config.num_layers
        assert model.runner.last_path == ("compiled" if numba_threads_count() == 1 else "fused")
        np.testing.assert_array_equal(compiled, op_by_op)


# F16 (a float format's instances) and Q4_K_M (mixed formats, gate and up paired) run in the default suite;
# each case compiles a fused layer (~1-2 min on a cold 2-core CI machine), so the other two are `slow`
FUSED_CASES = [pytest.param("small", "Q8_0", marks=pytest.mark.slow, id="small-Q8_0"),
               pytest.param("small", "F16", id="small-F16"),
               pytest.param("kquant", "Q4_K_M", id="kquant-Q4_K_M"),
               pytest.param("kquant", "Q5_K", marks=pytest.mark.slow, id="kquant-Q5_K")]


@pytest.mark.parametrize("size,target", FUSED_CASES)
def test_fused_layer_is_bit_identical(gguf_models, size, target):
    """At any thread count, forced on: the same logits as the op-by-op path, also for a sequence long
    enough that its attention splits the keys (300 positions)."""
    path, _ = gguf_models(size, target)
    model = hybrid.LLM(path, device="cpu").model
    long_prompt = list(np.resize(PROMPTS[0] + PROMPTS[1], 300))
    for prompts in (PROMPTS, [long_prompt, PROMPTS[1]]):
        model.backend.fused_decode = False
        op_by_op = decode(model, False, prompts, 2, capacity=320)
        model.backend.fused_decode = True
        fused = decode(model, True, prompts, 2, capacity=320)
        assert model.runner.last_path == "fused"
        np.testing.assert_array_equal(fused, op_by_op)


def numba_threads_count():
    import numba

    return numba.get_num_threads()


def test_fused_decode_setting_picks_the_fused_layer(gguf_models):
    """CpuBackend(fused_decode=False) keeps the per-op regions at any thread count; None (the default) fuses from
    two threads."""
    import numba

    path, _ = gguf_models("small", "Q8_0")
    model = Model(load_model(path), CpuBackend(fused_decode=False))
    decode(model, True, PROMPTS[:1], 1)
    assert model.runner.last_path == "compiled"
    model.backend.fused_decode = None
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)  # one thread: the layer keeps its per-op regions
        decode(model, True, PROMPTS[:1], 1)
        assert model.runner.last_path == "compiled"
    finally:
        numba.set_num_threads(before)


def test_fused_work_arrays_kept_per_batch_size(gguf_models):
    """The fused layer's work arrays are made once per batch size and reused by every layer and step; the
    FUSED_WORK_KEPT most recently used sizes stay."""
    from hybrid.backends.cpu_layer import FUSED_WORK_KEPT

    path, _ = gguf_models("small", "Q8_0")
    model = Model(load_model(path), CpuBackend(fused_decode=True))
    prompts = [[5 + i, 17, 300 - i] for i in range(FUSED_WORK_KEPT + 1)]
    decode(model, True, prompts[:1], 2)
    kept = model.backend._scratch().fused_work
    (first,) = kept.values()
    assert first[2][1] == 1  # row_starts [0, T] of one token
    decode(model, True, prompts[:1], 1)
    assert next(iter(kept.values())) is first  # the same arrays again
    for n in range(2, FUSED_WORK_KEPT + 2):
        decode(model, True, prompts[:n], 1)
    assert len(kept) == FUSED_WORK_KEPT
    assert sorted(key[1] for key in kept) == list(range(2, FUSED_WORK_KEPT + 2))  # batch size 1 dropped


def test_prefill_and_other_kv_dtypes_keep_the_op_by_op_path(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    model = hybrid.LLM(path, device="cpu").model
    kv = model.new_sequence(64)
    model.forward(Batch([SeqChunk(kv, 0, np.array(PROMPTS[0], np.int64))]))
    assert model.runner.last_path == "plain" and not model.runner.plans  # a prompt chunk
    f16 = hybrid.LLM(path, device="cpu", kv="f16").model
    kv = f16.new_sequence(64)
    f16.forward(Batch([SeqChunk(kv, 0, np.array(PROMPTS[0], np.int64))]))
    f16.forward(Batch([SeqChunk(kv, kv.length, np.array([3], np.int64))]))
    assert f16.runner.last_path == "plain" and not f16.runner.plans  # f16 KV rows are encoded by the op-by-op path


def test_decode_step_refuses_a_position_past_the_reserved_kv(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    model = hybrid.LLM(path, device="cpu").model
    kv = model.new_sequence(64)
    kv.reserve(16)
    with pytest.raises(ValueError, match=f"positions {kv.capacity}..{kv.capacity} past the {kv.capacity} reserved"):
        DecodeStep(Batch([SeqChunk(kv, kv.capacity, np.array([3], np.int64))]))


def test_sequences_of_another_kv_pool(gguf_models):
    """A sequence in a pool of its own (the server's KV budget makes one): its K/V go there."""
    from hybrid.kv_cache import KVPool

    path, _ = gguf_models("small", "Q8_0")
    model = hybrid.LLM(path, device="cpu").model
    c = model.config
    logits = {}
    for compiled in (False, True):
        model.compiled_decode = compiled
        kv = model.backend.new_kv(KVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=2, max_blocks=2), 64)
        model.forward(Batch([SeqChunk(kv, 0, np.array(PROMPTS[0], np.int64))]))
        logits[compiled] = model.forward(Batch([SeqChunk(kv, kv.length, np.array([3], np.int64))]))
        assert model.runner.last_path == ("plain" if not compiled else "compiled" if numba_threads_count() == 1
                                          else "fused")
    np.testing.assert_array_equal(logits[True], logits[False])


def test_compiled_decode_off_runs_the_layers_op_by_op(gguf_models):
    path, _ = gguf_models("small", "Q8_0")
    model = Model(load_model(path), CpuBackend(), compiled_decode=False)
    assert not model.compiled_decode and isinstance(model.runner, PlainRunner)
    kv = model.new_sequence(64)
    model.forward(Batch([SeqChunk(kv, 0, np.array(PROMPTS[0], np.int64))]))
    model.forward(Batch([SeqChunk(kv, kv.length, np.array([3], np.int64))]))
    assert model.runner.last_path == "plain"


def test_warm_up_compiles_the_decode_layers_and_leaves_no_trace(gguf_models):
    import gc

    path, _ = gguf_models("small", "Q8_0")
    llm = hybrid.LLM(path, device="cpu")
    free = llm.model.kv_pool.blocks_free
    assert llm.warm_up() > 0
    assert len(llm.model.runner.plans) == llm.config.num_layers
    gc.collect()
    assert llm.model.kv_pool.blocks_free == free  # the scratch sequence gave its blocks back


@dataclass(frozen=True)
class TwinAttention:
    """A part variant only the plain runner has an implementation of (full attention under another name)."""

    qk_norm: bool = True


@dataclass(frozen=True)
class TwinFFN:
    """A feed-forward part only the plain runner has (the model's MoE under another name)."""


def test_a_part_without_a_compiled_implementation_runs_op_by_op(gguf_models, monkeypatch):
    """A new part type with a plain implementation only: the compiled runner runs its block op by op and the other
    block compiled, with the logits of the part it stands for; with no block compiled, the plain runner is chosen."""
    from hybrid import blocks
    from hybrid.arch.recipe import FullAttention

    monkeypatch.setitem(blocks.PART_STEPS, TwinAttention,
                        lambda part: blocks.full_attention_steps(FullAttention(qk_norm=part.qk_norm)))
    path, _ = gguf_models("small", "Q8_0")
    model = Model(load_model(path), CpuBackend())
    ref = decode(model, False, PROMPTS, 2)
    recipe = model.spec.recipe
    model.spec = replace(model.spec, recipe=replace(recipe, mixer=replace(recipe.mixer, part=TwinAttention())))
    got = decode(model, True, PROMPTS, 2)
    assert isinstance(model.runner, CompiledRunner)
    assert all(plan.blocks[0] is None and plan.blocks[1] is not None for plan in model.runner.plans.values())
    np.testing.assert_array_equal(got, ref)
    monkeypatch.setitem(blocks.PART_STEPS, TwinFFN, lambda part: blocks.moe_steps(recipe.ffn.part))
    model.spec = replace(model.spec, recipe=replace(model.spec.recipe, ffn=replace(recipe.ffn, part=TwinFFN())))
    got = decode(model, True, PROMPTS, 2)
    assert isinstance(model.runner, PlainRunner)
    np.testing.assert_array_equal(got, ref)
