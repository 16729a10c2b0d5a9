"""Speculative decoding: the n-gram drafter, the acceptance rule, and the engine with drafts.

The engine's sampling test runs a fake trigram model (logits from a table, no kernels) so that hundreds of
seeded requests cost a second; the greedy and rollback tests run the demo model (random weights: greedy
decoding of it soon repeats itself, so n-gram drafts are both accepted and rejected).
"""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from hybrid.batch import Batch, SeqChunk
from hybrid.engine import Engine
from hybrid.request import Finished, Request
from hybrid.sampling import Sampler, SamplingParams
from hybrid.speculative import SpecSettings
from hybrid.speculative.acceptance import verify
from hybrid.speculative.ngram import NgramDrafter
from hybrid.speculative.policy import StepTimes, best_k
from hybrid.speculative.slot import SlotSpeculation

CHI2_999 = {7: 24.32}  # chi-square quantile 0.999 by degrees of freedom
ALWAYS = SpecSettings(k=4, ngram=3, min_p=0.0)


def tick_clock():
    """A clock that advances 1 ms a reading: every step seems to take the same time whatever its drafts, so
    the draft policy drafts all it may (the tests see many drafts, accepted and rejected)."""
    ticks = itertools.count()
    return lambda: next(ticks) * 1e-3


def test_ngram_drafts_what_followed_the_latest_match():
    d = NgramDrafter(3)
    d.extend([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    assert d.draft(3) == [7, 1, 2]  # "5 6" last followed by 7, then "5 6 7" by 1 ...
    d.extend([7])
    assert d.draft(2) == [1, 2]
    assert NgramDrafter(3).draft(4) == []


def test_ngram_drafts_repeat_a_loop_past_the_text_end():
    d = NgramDrafter(2)
    d.extend([3, 4, 3, 4, 3])
    assert d.draft(5) == [4, 3, 4, 3, 4]


def test_ngram_confidence_stops_the_draft():
    d = NgramDrafter(1)
    d.extend([1, 2, 1, 3, 1, 4, 1])  # 1 was followed by 2, 3, 4: the latest (4) has a third of the votes
    assert d.draft(3, min_p=0.5) == []
    assert d.draft(1, min_p=0.3) == [4]


def test_policy_drafts_where_tokens_per_second_gain():
    cheap, proportional = StepTimes(), StepTimes()
    for t in range(1, 6):
        cheap.add(t, 0.010 + 0.001 * t)
        proportional.add(t, 0.010 * t)
    assert best_k(0.3, 4, 1, None) == 4  # nothing measured: draft, to measure
    assert best_k(0.9, 4, 1, cheap) == 4 and best_k(0.05, 4, 1, cheap) == 0
    assert best_k(0.99, 4, 1, proportional) == 0  # an extra token costs a whole step: drafts never pay
    assert best_k(0.2, 4, 1, cheap) == 1 and best_k(0.2, 4, 4, cheap) == 0  # 4 slots: a slot's gain is less of the step


def test_slot_acceptance_estimate_turns_drafting_off_and_on_again():
    times = StepTimes()
    for t in range(1, 6):
        times.add(t, 0.010 + 0.002 * t)
    spec = SlotSpeculation(SpecSettings(k=4, min_p=0.0), [1, 2, 3, 1, 2])
    assert spec.draft(8) == [3, 1, 2, 3] and spec.draft(8, 1, times) == [3, 1, 2]  # p = 2/3: three pay here
    for _ in range(7):
        spec.record(4, 0)
    assert spec.p < 0.1 and spec.draft(8, 1, times) == []
    assert spec.draft_n == 28 and spec.draft_n_accepted == 0
    steps = 1
    while not spec.draft(8, 1, times):  # drafting nothing, the estimate drifts back to the prior
        steps += 1
    assert 3 < steps < 100


def test_greedy_verify_keeps_the_argmax_prefix():
    rows = np.zeros((4, 6), np.float32)
    rows[0, 2] = rows[1, 3] = rows[2, 5] = rows[3, 1] = 1.0
    sampler = Sampler(SamplingParams(temperature=0))
    assert verify(sampler, rows, [2, 3, 4])[0] == [2, 3, 5]
    assert verify(sampler, rows, [2, 3, 5])[0] == [2, 3, 5, 1]


def test_acceptance_rule_keeps_the_distribution():
    """One position, a draft of any probability: the emitted token is distributed as p (with top-k / top-p)."""
    rng = np.random.default_rng(0)
    row = rng.normal(0, 1.5, 8).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=0.0, seed=0)
    candidates, probs = Sampler(params).distribution(row)
    p = np.zeros(8)
    p[candidates] = probs
    num = 4000
    for draft in (int(np.argmax(p)), int(candidates[-1]), int(np.argmin(row))):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": draft}))
        counts = np.bincount([verify(sampler, np.stack([row, row]), [draft])[0][0] for _ in range(num)], minlength=8)
        assert counts[p == 0].sum() == 0
        expected = num * p[p > 0]
        assert ((counts[p > 0] - expected) ** 2 / expected).sum() < CHI2_999[7]


class TokenSequence:
    """A fake model's cache entry: the tokens it has read (rolled back as the KV is)."""

    supports_rollback = True
    recurrent = None

    def __init__(self):
        self.tokens = []
        self.chunk_start = 0

    def truncate(self, length):
        del self.tokens[length:]

    def rollback(self, length):
        self.truncate(length)
        return len(self.tokens)


class RecurrentSequence(TokenSequence):
    """Rolls back as a recurrent state does (hybrid/recurrent_state.py): only to the start of the last chunk of
    several tokens, the engine reads the rest again."""

    recurrent = "state"

    def rollback(self, length):
        if length < len(self.tokens):
            del self.tokens[self.chunk_start:]
        return len(self.tokens)


class TrigramModel:
    """Next-token logits from the last two tokens read (a random table over the first `used` ids): the engine
    path of real models without kernels. Asserts that every chunk starts where the sequence ends."""

    backend = None  # read by /metrics: no device, no expert cache

    def __init__(self, vocab_size, used=8, seed=0, sequence=TokenSequence):
        rng = np.random.default_rng(seed)
        self.used, self.sequence = used, sequence
        self.config = SimpleNamespace(vocab_size=vocab_size, num_layers=1, num_experts=1, num_experts_per_tok=1)
        self.table = np.full((used, used, vocab_size), -np.inf, np.float32)  # [prev, last, V]
        self.table[:, :, :used] = rng.normal(0, 1.2, (used, used, used))

    def new_sequence(self, max_tokens):
        return self.sequence()

    def forward(self, batch):
        rows = []
        for chunk in batch.chunks:
            seq = chunk.kv.tokens
            assert chunk.start == len(seq), "a chunk must start where its sequence ends"
            if len(chunk.token_ids) > 1:
                chunk.kv.chunk_start = chunk.start
            seq.extend(int(t) for t in chunk.token_ids)
            wanted = range(chunk.start, len(seq)) if chunk.logits == "all" else \
                [len(seq) - 1] if chunk.logits == "last" else []
            rows += [self.table[seq[j - 1], seq[j]] for j in wanted]
        return np.asarray(rows, np.float32).reshape(len(rows), self.config.vocab_size)

    def exact(self, prompt, positions):
        """Marginal distributions [positions, used] of the next `positions` tokens at temperature 1."""
        p = np.exp(self.table[:, :, :self.used])
        p /= p.sum(-1, keepdims=True)  # [prev, last, next]
        pairs = np.zeros((self.used, self.used))
        pairs[prompt[-2], prompt[-1]] = 1.0  # probability of (prev, last)
        out = []
        for _ in range(positions):
            pairs = np.einsum("ab,abc->bc", pairs, p)
            out.append(pairs.sum(0))
        return np.asarray(out)


@pytest.mark.parametrize("sequence", [TokenSequence, RecurrentSequence])
def test_sampling_with_drafts_keeps_each_positions_distribution(demo_tokenizer, sequence):
    """800 seeded requests, 4 slots: the first 4 tokens' marginals match the model's exact ones (chi-square at
    p = 0.001), while drafts were both accepted and rejected (the prompt holds every token, so each has a
    draft; the first token is sampled after the prompt, the others after drafts). A recurrent-like sequence
    rolls back to its chunk's start and reads the kept tokens again."""
    model = TrigramModel(demo_tokenizer.vocab_size, sequence=sequence)
    llm = SimpleNamespace(model=model, tokenizer=demo_tokenizer, max_context=64)
    prompt, num, positions = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 5, 6, 3, 1, 2], 800, 4
    engine = Engine(llm, num_slots=4, max_queue=num, speculation=ALWAYS, clock=tick_clock()).start()
    try:
        params = dict(max_tokens=positions, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
        handles = [engine.submit(Request(prompt, SamplingParams(**params, seed=s))) for s in range(num)]
        outputs = np.asarray([h.result().token_ids for h in handles])  # [num, positions]
    finally:
        engine.stop()
    assert 0 < engine.stats.draft_n_accepted < engine.stats.draft_n
    for i, p in enumerate(model.exact(prompt, positions)):
        counts = np.bincount(outputs[:, i], minlength=model.used)
        assert ((counts - num * p) ** 2 / (num * p)).sum() < CHI2_999[model.used - 1], f"position {i}"


def test_draft_counters_in_timings_and_metrics(demo_tokenizer):
    from prometheus_client import generate_latest

    from server.metrics import registry_for

    llm = SimpleNamespace(model=TrigramModel(demo_tokenizer.vocab_size), tokenizer=demo_tokenizer, max_context=64)
    engine = Engine(llm, num_slots=2, speculation=ALWAYS, clock=tick_clock()).start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        results = [engine.submit(Request([1, 2, 3, 1, 2, 3, 1], params)).result() for _ in range(2)]
    finally:
        engine.stop()
    stats = engine.stats
    assert stats.draft_n == sum(r.timings["draft_n"] for r in results) > 0
    assert stats.draft_n_accepted == sum(r.timings["draft_n_accepted"] for r in results)
    metrics = generate_latest(registry_for(engine)).decode()
    assert f"strata_draft_n_total {float(stats.draft_n)}" in metrics
    assert f"strata_draft_n_accepted_total {float(stats.draft_n_accepted)}" in metrics


GREEDY_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "Hello there, hello there, hello",
                  "abc abc abc abc", "x = 1\ny = 2\nx = 1\n"]


def _serve(llm, prompts, num_slots, speculation, **params):
    engine = Engine(llm, num_slots=num_slots, speculation=speculation, clock=tick_clock()).start()
    try:
        handles = [engine.submit(Request(list(p), SamplingParams(**params))) for p in prompts]
        return [h.result() for h in handles], engine.stats
    finally:
        engine.stop()


def serve_ids(model, tokenizer, prompts, num_slots, speculation, max_tokens=24):
    """Greedy output token ids of `prompts` served by an engine over `model`, and the engine's stats."""
    llm = SimpleNamespace(model=model, tokenizer=tokenizer, max_context=256)
    results, stats = _serve(llm, prompts, num_slots, speculation, max_tokens=max_tokens, temperature=0)
    return [r.token_ids for r in results], stats


@pytest.fixture(scope="module")
def greedy_reference(demo_llm):
    prompts = [demo_llm.tokenizer.encode(t) for t in GREEDY_PROMPTS]
    return prompts, [demo_llm.generate(p, max_tokens=24, temperature=0).token_ids for p in prompts]


@pytest.mark.parametrize("num_slots", [1, 4])
def test_greedy_with_drafts_equals_plain_greedy(demo_llm, greedy_reference, num_slots):
    prompts, reference = greedy_reference
    results, stats = _serve(demo_llm, prompts, num_slots, ALWAYS, max_tokens=24, temperature=0)
    assert [r.token_ids for r in results] == reference
    assert stats.draft_n_accepted > 0 and stats.draft_n > stats.draft_n_accepted
    assert sum(r.timings["draft_n"] for r in results) == stats.draft_n
    assert all(isinstance(r, Finished) and r.finish_reason == "length" for r in results)


def test_logprobs_and_stops_with_drafts(demo_llm, greedy_reference):
    """Each emitted token's logprob is the one plain decoding reports; a stop string cuts the same text."""
    prompts, _ = greedy_reference
    params = dict(max_tokens=24, temperature=0, stop=["there"])
    plain, _ = _serve(demo_llm, prompts, 2, None, **params)
    drafted, _ = _serve(demo_llm, prompts, 2, ALWAYS, **params)
    assert [r.text for r in drafted] == [r.text for r in plain]
    plain, _ = _serve(demo_llm, prompts[:2], 2, None, max_tokens=16, temperature=0)
    reqs = [Request(list(p), SamplingParams(max_tokens=16, temperature=0), logprobs=True, top_logprobs=2)
            for p in prompts[:2]]
    engine = Engine(demo_llm, num_slots=2, speculation=ALWAYS, clock=tick_clock()).start()
    try:
        results = [engine.submit(r).result() for r in reqs]
    finally:
        engine.stop()
    for got, want in zip(results, plain):
        assert got.token_ids == want.token_ids and [lp.token_id for lp in got.logprobs] == want.token_ids
        assert all(np.isfinite(lp.logprob) and len(lp.top) == 2 for lp in got.logprobs)


def test_rollback_leaves_the_kv_as_if_the_drafts_were_never_seen(demo_llm):
    """A verification chunk crossing a block boundary, rolled back to its first two tokens: its block past them
    goes back to the pool, and the sequence then equals, bit for bit (KV and next logits), one that was loaded
    with the kept positions only and never held the rejected ones."""
    model, rng = demo_llm.model, np.random.default_rng(3)
    a = model.new_sequence(128)
    model.forward(Batch([SeqChunk(a, 0, rng.integers(3, 900, 62), "none")]))
    model.forward(Batch([SeqChunk(a, 62, np.array([5, 6, 7, 8]), "all")]))
    kept = a.export(64)
    free = model.kv_pool.blocks_free
    a.rollback(64)
    assert a.length == 64 and a.capacity == 64 and model.kv_pool.blocks_free == free + 1
    fresh = model.new_sequence(128)
    fresh.load(*kept)
    logits = [model.forward(Batch([SeqChunk(kv, 64, np.array([9, 10, 11]), "all")])) for kv in (a, fresh)]
    assert np.array_equal(logits[0], logits[1])
    for x, y in zip(a.export(67), fresh.export(67)):
        assert np.array_equal(x, y)



def test_a_verification_step_gives_one_token_steps_logits_bit_for_bit(demo_llm):
    """1 + k one-token chunks of one sequence in one step (the compiled decode layers, the output head) give the
    logits of k + 1 one-token steps exactly: a few tokens run the one-token dots (cpu_kernels.tiles)."""
    model, rng = demo_llm.model, np.random.default_rng(5)
    kv = model.new_sequence(128)
    model.forward(Batch([SeqChunk(kv, 0, rng.integers(3, 900, 40), "none")]))
    tokens = rng.integers(3, 900, 5)
    one = np.concatenate([model.forward(Batch([SeqChunk(kv, 40 + i, tokens[i:i + 1])])) for i in range(5)])
    kv.rollback(40)
    many = model.forward(Batch([SeqChunk(kv, 40 + i, tokens[i:i + 1]) for i in range(5)]))
    assert np.array_equal(one, many)

@pytest.mark.slow
def test_greedy_with_drafts_on_a_recurrent_model_equals_plain_greedy(tmp_path, demo_tokenizer):
    """A tiny Qwen3-Next (Gated DeltaNet layers: a rollback keeps only the verification chunk's start, the
    engine reads the kept tokens again), 2 slots. Its sequences say supports_rollback = False until the
    qwen3next family turns it on; here a wrapper does. (Partial acceptance on such a sequence: the sampling
    test's RecurrentSequence.)"""
    import hybrid
    from tests.conftest import save_tokenizer_files
    from tests.hybrid.qwen3next_models import make_hf_model, save_hf_dir, write_qwen3next_gguf

    hf_dir = save_hf_dir(make_hf_model(demo_tokenizer.vocab_size), str(tmp_path / "hf"), save_tokenizer_files,
                         demo_tokenizer)
    path = str(tmp_path / "tiny-qwen3next.gguf")
    write_qwen3next_gguf(hf_dir, path, "F32", demo_tokenizer)
    llm = hybrid.LLM(path, max_context=256, kv_sequences=2)
    new_sequence = llm.model.new_sequence

    def rolling_back(max_tokens=None):
        kv = new_sequence(max_tokens)
        kv.supports_rollback = True
        return kv

    model = SimpleNamespace(config=llm.model.config, new_sequence=rolling_back, forward=llm.model.forward)
    starts = [[3, 17, 42, 5, 3, 17, 42, 5, 3, 17], [99, 23, 64, 99, 23, 64, 99]]
    first, _ = serve_ids(llm.model, llm.tokenizer, starts, 2, None, max_tokens=12)
    prompts = [s + out + s for s, out in zip(starts, first)]  # drafts: the earlier continuation, in part kept
    plain, _ = serve_ids(llm.model, llm.tokenizer, prompts, 2, None)
    drafted, stats = serve_ids(model, llm.tokenizer, prompts, 2, ALWAYS)
    assert drafted == plain and stats.draft_n > stats.draft_n_accepted  # rejected drafts: kept tokens read again
