"""The scheduler alone: slot states, queue, chunked prompt reads under the decode share (no kernels)."""
import math

import pytest

from hybrid.request import Request
from hybrid.sampling import SamplingParams
from hybrid.scheduler import QueueFull, Scheduler, SlotState


class FakeKV:
    def truncate(self, length):
        pass


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_scheduler(num_slots=2, clock=None, **kwargs):
    return Scheduler(num_slots, FakeKV, max_context=4096, eos_ids={0}, clock=clock or FakeClock(), **kwargs)


def request(num_prompt, max_tokens=1000):
    return Request(list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, clock, cost=lambda d, c: 0.01, token=7):
    """Schedule, 'run' the step on the fake clock, append a token where logits were asked."""
    step = sched.schedule()
    elapsed = cost(step.num_decode, step.num_prompt)
    clock.now += elapsed
    sched.record(step, elapsed)
    finished = []
    for chunk in step.chunks:
        sched.advance(chunk)
        if chunk.logits == "last":
            reason = sched.append_token(chunk.slot, token)
            if reason:
                finished.append((chunk.slot, reason))
                sched.finish(chunk.slot, reason)
                sched.release(chunk.slot)
    return step, finished


def test_slot_goes_idle_prefill_decode_done_idle():
    clock = FakeClock()
    sched = make_scheduler(1, clock)
    slot = sched.slots[0]
    assert slot.state is SlotState.IDLE
    sched.add(request(10, max_tokens=3))
    step = sched.schedule()
    assert slot.state is SlotState.PREFILL
    assert [(len(c.token_ids), c.start, c.logits) for c in step.chunks] == [(10, 0, "last")]
    sched.advance(step.chunks[0])
    assert slot.state is SlotState.DECODE and slot.num_cached == 10
    assert sched.append_token(slot, 5) is None
    for expected in (None, "length"):
        step = sched.schedule()
        assert [(c.token_ids, c.start) for c in step.chunks] == [([slot.output_ids[-1]], slot.num_cached)]
        sched.advance(step.chunks[0])
        assert sched.append_token(slot, 5) == expected
    sched.finish(slot, "length")
    assert slot.state is SlotState.DONE
    sched.release(slot)
    assert slot.state is SlotState.IDLE and not sched.has_work()


def test_eos_stops_unless_ignored():
    sched = make_scheduler(1)
    sched.add(request(3))
    run_step(sched, FakeClock())
    slot = sched.slots[0]
    assert sched.append_token(slot, 0) == "stop"
    slot.request.params.ignore_eos = True
    assert sched.append_token(slot, 0) is None


def test_queue_limit():
    sched = make_scheduler(1, max_queue=2)
    sched.add(request(3))
    sched.add(request(3))
    with pytest.raises(QueueFull):
        sched.add(request(3))


def test_cancel_frees_slot_and_queue_entry():
    clock = FakeClock()
    sched = make_scheduler(1, clock)
    running, waiting = request(3), request(3)
    sched.add(running)
    sched.add(waiting)
    run_step(sched, clock)
    running.cancelled = waiting.cancelled = True
    step = sched.schedule()
    assert step.cancelled == [waiting, running] and step.chunks == []
    assert sched.slots[0].state is SlotState.IDLE and not sched.has_work()


def test_one_prompt_chunk_per_step_first_admitted_first():
    clock = FakeClock()
    sched = make_scheduler(3, clock, max_step_tokens=64)
    first, second = request(100), request(10)
    sched.add(first)
    sched.add(second)
    step, _ = run_step(sched, clock)
    assert [(c.slot.request, len(c.token_ids)) for c in step.chunks] == [(first, 64)]
    step, _ = run_step(sched, clock)
    assert [(c.slot.request, len(c.token_ids)) for c in step.chunks] == [(first, 36)]
    step, _ = run_step(sched, clock)
    assert [c.slot.request for c in step.chunks] == [first, second]  # decode first, then the prompt chunk


def moe_like_cost(num_decode, num_prompt):
    """Step seconds: weight reads saturate with more tokens, compute grows with them."""
    tokens = num_decode + num_prompt
    return 0.02 + 0.03 * (1 - math.exp(-tokens / 24)) + 0.0004 * tokens


def overhead_cost(num_decode, num_prompt):
    """Step seconds when a chunk has a large fixed cost (one more sequence in the step)."""
    return 0.002 + 0.0002 * num_decode + (0.003 + 0.0001 * num_prompt if num_prompt else 0.0)


@pytest.mark.parametrize("cost", [moe_like_cost, overhead_cost])
@pytest.mark.parametrize("share", [0.5, 0.8])
def test_decode_share_keeps_decoding_rate(share, cost):
    clock = FakeClock()
    sched = make_scheduler(4, clock, decode_share=share)
    for _ in range(3):
        sched.add(request(8))
    for _ in range(20):  # the three read their prompts and decode alone
        run_step(sched, clock, cost)
    t0, n0 = clock.now, len(sched.slots[0].output_ids)
    for _ in range(20):
        run_step(sched, clock, cost)
    alone_rate = (len(sched.slots[0].output_ids) - n0) / (clock.now - t0)
    sched.add(request(100_000))
    for _ in range(10):  # the chunk size settles
        run_step(sched, clock, cost)
    t0, n0, read0 = clock.now, len(sched.slots[0].output_ids), sched.slots[3].num_cached
    for _ in range(200):
        run_step(sched, clock, cost)
    rate = (len(sched.slots[0].output_ids) - n0) / (clock.now - t0)
    assert rate >= 0.95 * share * alone_rate
    assert rate <= 1.05 * alone_rate
    assert sched.slots[3].num_cached - read0 >= 200  # the prompt moves
