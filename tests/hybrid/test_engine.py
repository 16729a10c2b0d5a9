"""The engine on the demo model: failures stay with their request, cancelling frees the slot."""
import time
from types import SimpleNamespace

import pytest

from hybrid.engine import Engine
from hybrid.request import Delta, Failed, Finished, Request
from hybrid.sampling import SamplingParams

POISON = 7  # a prompt holding this token id makes the fake model fail


class PoisonedModel:
    def __init__(self, model):
        self.model, self.config = model, model.config

    def new_sequence(self, max_tokens):
        return self.model.new_sequence(max_tokens)

    def forward(self, batch):
        if POISON in batch.token_ids:
            raise RuntimeError("poisoned token")
        return self.model.forward(batch)


@pytest.fixture
def llm(demo_llm):
    return demo_llm


def greedy_request(ids, max_tokens=6):
    return Request(list(ids), SamplingParams(max_tokens=max_tokens, temperature=0))


def test_a_failing_request_does_not_take_the_engine_down(llm):
    fake = SimpleNamespace(model=PoisonedModel(llm.model), tokenizer=llm.tokenizer, max_context=llm.max_context)
    engine = Engine(fake, num_slots=2).start()
    try:
        good_ids = llm.tokenizer.encode("Hello there")
        bad, good = engine.submit(greedy_request([POISON, 8, 9])), engine.submit(greedy_request(good_ids))
        assert isinstance(bad.result(), Failed)
        result = good.result()
        assert isinstance(result, Finished)
        assert result.token_ids == llm.generate(good_ids, max_tokens=6, temperature=0).token_ids
        assert engine.stats.requests == {"error": 1, "length": 1}
    finally:
        engine.stop()


class LimitedKVModel(PoisonedModel):
    """The model's sequences share a KV pool of `blocks` blocks."""

    def __init__(self, model, blocks):
        from hybrid.kv_cache import KVPool

        super().__init__(model)
        c = model.config
        self.pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=blocks, max_blocks=blocks)

    def new_sequence(self, max_tokens):
        return self.model.backend.new_kv(self.pool, max_tokens)


def test_a_full_kv_budget_fails_only_the_request_that_needs_more(llm):
    """Two slots share 3 blocks of 64 tokens: a 150-token prompt takes them all, so a request that comes
    while it runs gets an error that names the KV budget; the first finishes as it would alone."""
    fake = SimpleNamespace(model=LimitedKVModel(llm.model, 3), tokenizer=llm.tokenizer, max_context=llm.max_context)
    engine = Engine(fake, num_slots=2).start()
    try:
        long_ids = list(range(20, 170))
        first = engine.submit(greedy_request(long_ids, max_tokens=30))
        assert isinstance(first.next_event(timeout=60), Delta)
        second = engine.submit(greedy_request([5, 6, 8]))
        failed = second.result()
        assert isinstance(failed, Failed) and "KV cache full" in failed.message and "0 of 3 free" in failed.message
        result = first.result()
        assert isinstance(result, Finished)
        assert result.token_ids == llm.generate(long_ids, max_tokens=30, temperature=0).token_ids
    finally:
        engine.stop()


def test_cancel_frees_the_slot(llm):
    engine = Engine(llm, num_slots=1).start()
    try:
        handle = engine.submit(greedy_request(llm.tokenizer.encode("Hi"), max_tokens=200))
        assert isinstance(handle.next_event(timeout=30), Delta)
        engine.cancel(handle.request_id)
        events = list(handle)
        assert isinstance(events[-1], Finished) and events[-1].finish_reason == "cancelled"
        deadline = time.time() + 5
        while engine.snapshot()["slots"][0]["state"] != "idle":
            assert time.time() < deadline
            time.sleep(0.01)
        assert engine.stats.requests == {"cancelled": 1}
    finally:
        engine.stop()


class SteppedClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SlowModel(PoisonedModel):
    """The forward pass takes `seconds` on `clock`."""

    def __init__(self, model, clock, seconds):
        super().__init__(model)
        self.clock, self.seconds = clock, seconds

    def forward(self, batch):
        self.clock.now += self.seconds
        return self.model.forward(batch)


def test_the_decode_share_is_fed_the_time_of_the_whole_step(llm):
    """Decoding slots wait for sampling and bookkeeping too, not only the forward pass."""
    clock = SteppedClock()
    fake = SimpleNamespace(model=SlowModel(llm.model, clock, 0.2), tokenizer=llm.tokenizer,
                           max_context=llm.max_context)
    engine = Engine(fake, num_slots=1, clock=clock)  # stepped by hand, no loop thread
    postprocess = engine._postprocess

    def slow_postprocess(*args):
        clock.now += 0.1
        postprocess(*args)

    engine._postprocess = slow_postprocess
    engine.submit(greedy_request(llm.tokenizer.encode("Hi"), max_tokens=3))
    engine.step()  # the prompt, nobody decoding
    assert engine.scheduler.sizer.decode_s is None
    engine.step()  # a decode-only step
    assert engine.scheduler.sizer.decode_s == pytest.approx(0.3)


def test_the_gap_between_back_to_back_steps_counts_as_step_time(llm):
    """Time between two steps (lock hand-overs, streaming threads) delays the decoding slots too."""
    clock = SteppedClock()
    fake = SimpleNamespace(model=SlowModel(llm.model, clock, 0.2), tokenizer=llm.tokenizer,
                           max_context=llm.max_context)
    engine = Engine(fake, num_slots=1, clock=clock)  # stepped by hand: steps run back to back
    engine.submit(greedy_request(llm.tokenizer.encode("Hi"), max_tokens=4))
    engine.step()  # the prompt
    clock.now += 0.05
    engine.step()  # a decode-only step: 0.05 s gap + 0.2 s forward
    assert engine.scheduler.sizer.decode_s == pytest.approx(0.25)


class ThreadCountModel(PoisonedModel):
    """Records Numba's thread count in the thread that runs each forward pass."""

    def __init__(self, model):
        super().__init__(model)
        self.counts = []

    def forward(self, batch):
        import numba

        self.counts.append(numba.get_num_threads())
        return self.model.forward(batch)


def test_the_engine_thread_runs_kernels_with_the_chosen_thread_count(llm):
    """Numba's thread count is per thread: without care the engine's thread would use every core."""
    import numba

    from cpu_kernels import target

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 Numba threads to tell the chosen count from the default")
    before = numba.get_num_threads()
    fake = SimpleNamespace(model=ThreadCountModel(llm.model), tokenizer=llm.tokenizer, max_context=llm.max_context)
    try:
        target.set_threads(1)
        engine = Engine(fake, num_slots=1).start()
        try:
            assert isinstance(engine.submit(greedy_request([8, 9, 10], max_tokens=2)).result(), Finished)
        finally:
            engine.stop()
        assert fake.model.counts and set(fake.model.counts) == {1}
    finally:
        target._chosen_threads = None
        numba.set_num_threads(before)


def test_a_dropped_engine_gives_its_slots_kv_back_at_once(llm):
    """No reference cycle holds a stopped engine (its scheduler's callbacks are weak): dropping it frees its slots'
    KV blocks without waiting for the cyclic garbage collector, so the next user of the model finds them free."""
    import gc

    from hybrid.speculative import SpecSettings

    pool = llm.model.kv_pool
    before = pool.blocks_free
    engine = Engine(llm, num_slots=2, speculation=SpecSettings()).start()
    try:
        handle = engine.submit(greedy_request(llm.tokenizer.encode("Hello there"), max_tokens=4))
        assert isinstance(list(handle)[-1], Finished)
    finally:
        engine.stop()
    assert pool.blocks_free < before
    gc.disable()
    try:
        del engine, handle
        assert pool.blocks_free == before
    finally:
        gc.enable()
