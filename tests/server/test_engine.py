"""The engine on the demo model: failures stay with their request, cancelling frees the slot."""
import time
from types import SimpleNamespace

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
