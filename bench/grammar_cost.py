"""Decode speed with and without a JSON schema, at 1 and 4 slots: what grammar-constrained sampling costs.

The engine is stepped by hand on a model (the demo model by default) with every slot kept busy: a request
that ends is replaced at once. Only steps in which every slot decodes (no prompt chunk) are timed. Each run
times `--steps` such steps; the table gives medians over `--runs` runs of the median step time, and tok/s
= slots / step time. The grammar's cost is (constrained step - free step) / free step. Alongside, per constrained
step: the time llguidance takes to fill the step's masks (in the engine's mask thread, overlapping the
forward pass) and the grammar's time in the engine thread (waiting for the masks, unpacking and applying
them, advancing the matchers), and the time to apply one mask to a logits row of a real-size (151,643)
vocabulary. On a machine with more runnable threads than cores, step times carry the scheduler's delays
(each parallel region of the forward pass waits for all its threads): the component times are the steadier
measure there.

    python -m bench.grammar_cost [--model PATH.gguf] [--runs 5] [--steps 60]
"""
import argparse
import statistics
import time

import numpy as np

from bench.grammar_libs import SCHEMA

MAX_CONTEXT = 2048
PROMPT = "Write the delivery note as JSON:"


class Timed:
    """Replaces `owner.name` (a function) by a wrapper that adds each call's wall time to `per_step`."""

    def __init__(self, owner, name, per_step):
        self.owner, self.name, self.call, self.per_step = owner, name, getattr(owner, name), per_step
        setattr(owner, name, self)

    def __get__(self, obj, objtype=None):
        return self if obj is None else lambda *args: self(obj, *args)

    def __call__(self, *args):
        t0 = time.perf_counter()
        result = self.call(*args)
        self.per_step[-1] += time.perf_counter() - t0
        return result

    def undo(self):
        setattr(self.owner, self.name, self.call)


class GrammarTimes:
    """Per constrained step: llguidance's mask fill (mask thread) and the grammar's engine-thread time."""

    def __init__(self, engine):
        from hybrid import engine as engine_module
        from hybrid.grammar import Matcher

        self.fill, self.inline = [0.0], [0.0]
        self.timers = [Timed(engine.grammar, "fill_masks", self.fill),
                       Timed(engine_module._StepMasks, "allowed", self.inline),
                       Timed(Matcher, "consume", self.inline)]

    def next_step(self):
        if self.fill[-1]:
            self.fill.append(0.0)
            self.inline.append(0.0)

    def discard(self):
        """Forget the step just run (not every slot decoded)."""
        self.fill[-1] = self.inline[-1] = 0.0

    def undo(self):
        for timer in self.timers:
            timer.undo()


def one_run(engine, num_slots, constrained, num_steps, seed, grammar_times=None):
    """Median decode-step seconds over `num_steps` steps in which all `num_slots` slots decode."""
    from hybrid.grammar import Constraint
    from hybrid.request import Request
    from hybrid.sampling import SamplingParams

    ids = engine.tokenizer.encode(PROMPT)
    constraint = Constraint.from_json_schema(SCHEMA) if constrained else None
    slots, times = engine.scheduler.slots, []
    for n in range(10**6):
        busy = sum(s.state.value != "idle" for s in slots) + len(engine.scheduler.queue)
        for i in range(num_slots - busy):  # keep every slot busy
            params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed * 10**6 + n * num_slots + i)
            engine.submit(Request(ids, params, constraint=constraint))
        all_decode = all(s.state.value == "decode" for s in slots)
        t0 = time.perf_counter()
        engine.step()
        if grammar_times is not None:
            grammar_times.next_step() if all_decode else grammar_times.discard()
        if all_decode:
            times.append(time.perf_counter() - t0)
            if len(times) == num_steps:
                break
    for s in slots:
        if s.request is not None:
            engine.cancel(s.request.request_id)
    while engine.scheduler.has_work():
        engine.step()
    return statistics.median(times)


def apply_cost(vocab_size=151_643, repeats=200):
    """Seconds to turn a bitmask into bool [V] and mask a float32 logits row of V entries."""
    from hybrid.grammar import allowed
    from hybrid.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(0)
    row = rng.normal(size=vocab_size).astype(np.float32)
    mask = rng.integers(-(2**31), 2**31, size=(vocab_size + 31) // 32, dtype=np.int64).astype(np.int32)
    sampler = Sampler(SamplingParams())
    t0 = time.perf_counter()
    for _ in range(repeats):
        sampler.adjusted(row, allowed(mask, vocab_size))
    return (time.perf_counter() - t0) / repeats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: the demo model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    import hybrid
    from hybrid.demo import demo_model_path
    from hybrid.engine import Engine

    llm = hybrid.LLM(args.model or demo_model_path(), max_context=MAX_CONTEXT)
    print(f"model {args.model or 'demo'}, vocab {llm.model.config.vocab_size}")
    print("| slots | free tok/s | JSON schema tok/s | step cost | mask fill (mask thread) | grammar in the engine "
          "thread | engine-thread share of a free step |")
    print("|---|---|---|---|---|---|---|")
    for num_slots in (1, 4):
        engine = Engine(llm, num_slots=num_slots)  # stepped by hand
        one_run(engine, num_slots, True, 5, seed=99)  # warm-up: kernels and the grammar's first states
        one_run(engine, num_slots, False, 5, seed=99)
        free, json_, fill, inline = [], [], [], []
        for run in range(args.runs):
            free.append(one_run(engine, num_slots, False, args.steps, seed=run))
            times = GrammarTimes(engine)
            json_.append(one_run(engine, num_slots, True, args.steps, seed=run, grammar_times=times))
            times.undo()
            fill.append(statistics.median(times.fill[:-1]))
            inline.append(statistics.median(times.inline[:-1]))
        f, j = statistics.median(free), statistics.median(json_)
        g = statistics.median(inline)
        engine.stop()
        print(f"| {num_slots} | {num_slots / f:.1f} | {num_slots / j:.1f} | {(j - f) / f * 100:+.1f} % "
              f"| {statistics.median(fill) * 1e6:.0f} us | {g * 1e6:.0f} us | {g / f * 100:.1f} % |")
    print(f"applying one mask to a 151,643-entry logits row: {apply_cost() * 1e6:.0f} us")


if __name__ == "__main__":
    main()
