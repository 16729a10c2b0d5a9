"""Grammar-constrained sampling and logprobs in the engine, on the demo model (random weights).

One 4-slot engine for the module; the logprob checks run a 1-slot engine whose model records the logits
rows it returns, and recompute each logprob in float64 NumPy from them."""
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from hybrid.grammar import Constraint, GrammarError, Matcher, allowed
from hybrid.request import Failed, Finished, Request
from hybrid.sampling import Sampler, SamplingParams, token_logprob
from tests.json_schemas import random_schemas

jsonschema = pytest.importorskip("jsonschema")

MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def llm(demo_path):
    import hybrid

    return hybrid.LLM(demo_path, max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def engine(llm):
    from hybrid.engine import Engine

    engine = Engine(llm, num_slots=4).start()
    yield engine
    engine.stop()


def ask(engine, prompt, constraint, seed, **fields):
    params = SamplingParams(max_tokens=fields.pop("max_tokens", 600), temperature=1.0, seed=seed,
                            logit_bias=fields.pop("logit_bias", {}))
    return engine.submit(Request(engine.tokenizer.encode(prompt), params, constraint=constraint, **fields))


def test_bad_grammars_raise_with_the_library_message():
    with pytest.raises(GrammarError, match="foo"):
        Constraint.from_json_schema({"type": "foo"})
    with pytest.raises(GrammarError, match="unknown name"):
        Constraint.from_lark("start: foo")
    with pytest.raises(GrammarError, match="JSON schema"):
        Constraint.from_json_schema({"type": "object", "properties": {"a": {1, 2}}})  # a set: no JSON
    with pytest.raises(GrammarError, match="nested more than 32"):
        Constraint.from_json_schema(json.loads('{"not":' * 40 + "{}" + "}" * 40))
    with pytest.raises(GrammarError, match="the limit is 65536"):
        Constraint.from_json_schema({"enum": ["x" * 70_000]})
    assert Constraint.json_object().kind == Constraint.from_json_schema(True).kind == "JSON schema"


def test_a_special_token_the_vocabulary_lacks_fails_at_submit(engine):
    constraint = Constraint.from_lark("start: <|nope|>")  # names resolve against the vocabulary only
    with pytest.raises(GrammarError, match="unknown special token"):
        ask(engine, "Hi", constraint, seed=0)


def check_schemas(engine, schemas):
    """Every schema's output, 4 requests at a time, parses and validates; each ends with its grammar."""
    def run(i):
        return ask(engine, "A JSON document:", Constraint.from_json_schema(schemas[i]), seed=i).result()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(len(schemas))))
    for schema, result in zip(schemas, results):
        assert isinstance(result, Finished) and result.finish_reason == "stop", (schema, result)
        jsonschema.validate(json.loads(result.text), schema)
        assert result.token_ids[-1] not in engine.tokenizer.eos_ids  # the complete grammar ended it


def test_json_schema_output_validates(engine):
    check_schemas(engine, random_schemas(6, seed=1))


@pytest.mark.slow
def test_json_schema_output_validates_50(engine):
    check_schemas(engine, random_schemas(50, seed=2))


def closing_bias(tokenizer, bias=6.0):
    """A logit bias towards tokens holding a quote or a closing bracket: a random model's JSON ends sooner."""
    return {i: bias for i in range(tokenizer.vocab_size)
            if any(c in (tokenizer.decode([i]) or "") for c in '"}]')}


def test_json_object_output_parses(engine):
    bias = closing_bias(engine.tokenizer)
    handles = [ask(engine, "Some JSON:", Constraint.json_object(), seed=s, logit_bias=bias) for s in range(3)]
    for handle in handles:
        result = handle.result()
        assert isinstance(result, Finished) and result.finish_reason == "stop"
        assert isinstance(json.loads(result.text), dict)


def test_a_finished_grammar_ends_the_request(engine):
    result = ask(engine, "Yes or no?", Constraint.from_lark('start: "yes" | "no"'), seed=3).result()
    assert result.finish_reason == "stop" and result.text in ("yes", "no")


class Refusing(Matcher):
    """A matcher whose grammar refuses every token."""

    error = "refused for the test"

    def consume(self, token_id):
        return False


def test_a_failing_grammar_fails_only_its_request(engine, monkeypatch):
    bad_constraint, schema = Constraint.json_object(), random_schemas(1, seed=5)[0]
    make = engine.grammar.matcher
    monkeypatch.setattr(engine.grammar, "matcher",
                        lambda c: Refusing(make(c).ll) if c is bad_constraint else make(c))
    bad = ask(engine, "JSON:", bad_constraint, seed=1)
    good = ask(engine, "JSON:", Constraint.from_json_schema(schema), seed=2)
    free = ask(engine, "Text:", None, seed=3, max_tokens=20)
    failed = bad.result()
    assert isinstance(failed, Failed) and "refused for the test" in failed.message
    jsonschema.validate(json.loads(good.result().text), schema)
    assert free.result().finish_reason == "length"


class RecordingModel:
    """The demo model, keeping every logits row it returns."""

    def __init__(self, model):
        self.model, self.config, self.rows = model, model.config, []

    def new_sequence(self, max_tokens):
        return self.model.new_sequence(max_tokens)

    def forward(self, batch):
        logits = self.model.forward(batch)
        self.rows.extend(np.array(row) for row in logits)
        return logits


@pytest.fixture(scope="module")
def recording(llm):
    from hybrid.engine import Engine

    model = RecordingModel(llm.model)
    engine = Engine(SimpleNamespace(model=model, tokenizer=llm.tokenizer, max_context=MAX_CONTEXT)).start()
    yield engine, model
    engine.stop()


def log_softmax(row):
    row = row.astype(np.float64)
    top = row.max()
    return row - (top + np.log(np.exp(row - top).sum()))


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "schema"])
def test_logprobs_are_the_log_softmax_of_the_logits_sampled_from(recording, constrained):
    engine, model = recording
    schema = random_schemas(1, seed=7)[0]
    constraint = Constraint.from_json_schema(schema) if constrained else None
    bias = {5: 3.0, 17: -2.0, 90: 1.5}
    model.rows.clear()
    handle = ask(engine, "Numbers:", constraint, seed=11, max_tokens=40, logit_bias=bias, logprobs=True,
                 top_logprobs=5)
    events = list(handle)
    result = events[-1]
    assert isinstance(result, Finished)
    streamed = [e for event in events[:-1] for e in event.logprobs]
    assert streamed == result.logprobs
    assert len(model.rows) == len(result.token_ids) > 1
    replay = engine.grammar.matcher(constraint) if constrained else None
    for row, entry, token in zip(model.rows, result.logprobs, result.token_ids):
        row = row.astype(np.float64)
        row[list(bias)] += list(bias.values())
        if replay is not None:
            row[~allowed(engine.grammar.fill_masks([replay])[0], row.size)] = -np.inf
            assert replay.consume(token)
        expected = log_softmax(row)
        assert entry.token_id == token and entry.logprob == pytest.approx(expected[token], abs=1e-9)
        top = np.argsort(-expected, kind="stable")[:5]
        top = [int(i) for i in top if np.isfinite(expected[i])]
        assert [i for i, _ in entry.top] == top
        np.testing.assert_allclose([lp for _, lp in entry.top], expected[top], atol=1e-9)
    assert len(result.logprobs) == len(result.token_ids) - (result.token_ids[-1] in engine.tokenizer.eos_ids)


def test_masked_sampling_draws_only_allowed_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=300).astype(np.float32)  # [V]
    mask = rng.random(300) < 0.1
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    draws = {sampler(logits, mask) for _ in range(300)}
    assert draws <= set(np.flatnonzero(mask).tolist()) and len(draws) > 5
    entry = token_logprob(sampler.adjusted(logits, mask), next(iter(draws)), num_top=50)
    assert len(entry.top) == min(50, int(mask.sum())) and all(np.isfinite(lp) for _, lp in entry.top)
    assert sum(np.exp(lp) for _, lp in entry.top) <= 1 + 1e-9
