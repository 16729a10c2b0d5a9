"""Qwen3-Next served by the engine: several slots in one batch (each chunk on its own recurrent state), slots
reused by new requests (the state starts over), and the conversation cache restoring a returning conversation
through the engine, each as the same prompts give alone."""
import numpy as np
import pytest

import hybrid
from hybrid.conversation_cache import ConversationCache
from hybrid.engine import Engine
from hybrid.request import Finished, Request
from hybrid.sampling import SamplingParams
from tests.hybrid.qwen3next_models import make_hf_model, save_hf_dir, write_qwen3next_gguf

pytestmark = pytest.mark.slow

RNG = np.random.default_rng(8)
PROMPTS = [[int(t) for t in RNG.integers(3, 250, n)] for n in (90, 20, 140, 5)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory, demo_tokenizer):
    from tests.conftest import save_tokenizer_files

    directory = tmp_path_factory.mktemp("qwen3next-engine")
    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(directory / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    path = str(directory / "qwen3next-F32.gguf")
    write_qwen3next_gguf(hf_dir, path, "F32", demo_tokenizer)
    return hybrid.LLM(path, device="cpu", max_context=512)


def alone(llm, ids, max_tokens=8):
    return llm.generate(ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True).token_ids


def run(engine, prompts, max_tokens=8):
    futures = [engine.submit(Request(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                               ignore_eos=True))) for ids in prompts]
    results = [f.result() for f in futures]
    assert all(isinstance(r, Finished) for r in results)
    return [r.token_ids for r in results]


def test_slots_batched_and_reused_give_each_prompt_alone(llm):
    engine = Engine(llm, num_slots=2, max_step_tokens=64).start()  # prompts read in chunks beside decode steps
    try:
        assert run(engine, PROMPTS) == [alone(llm, ids) for ids in PROMPTS]
    finally:
        engine.stop()


def test_a_returning_conversation_is_restored_through_the_engine(llm):
    cache = ConversationCache(1 << 30, "model", checkpoint_tokens=64)
    engine = Engine(llm, num_slots=1, conversation_cache=cache).start()
    try:
        first = PROMPTS[2]
        reply = run(engine, [first])[0]
        returning = first + reply + PROMPTS[3]
        assert run(engine, [returning]) == [alone(llm, returning)]
        assert cache.stats.hits == 1 and cache.stats.restored_tokens == len(first) + len(reply) - 1
    finally:
        engine.stop()


def test_speculation_on_recurrent_sequences_gives_plain_greedy(llm):
    """N-gram drafts on Qwen3-Next: a rejected draft rolls the state back to the verification chunk's start (its
    snapshot), the engine reads the kept tokens again; the tokens are plain greedy decoding's."""
    from hybrid.speculative.settings import SpecSettings

    starts = [[3, 17, 42, 5] * 3, [99, 23, 64] * 3]
    plain = Engine(llm, num_slots=2).start()
    try:
        first = run(plain, starts, max_tokens=12)
        prompts = [s + out + s for s, out in zip(starts, first)]  # drafts: the earlier continuation, in part kept
        expected = run(plain, prompts, max_tokens=16)
    finally:
        plain.stop()
    drafting = Engine(llm, num_slots=2, speculation=SpecSettings(k=4, ngram=3, min_p=0.0)).start()
    try:
        assert drafting.speculation is not None
        assert run(drafting, prompts, max_tokens=16) == expected
        assert drafting.stats.draft_n > 0
    finally:
        drafting.stop()
