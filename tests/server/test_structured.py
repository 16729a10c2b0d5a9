"""response_format and logprobs through the real HTTP server (waitress, the app of `strata serve`, the demo
model, 4 slots) with the official `openai` client; the request fields and response shapes of
server/structured.py on their own."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybrid.sampling import TokenLogprob
from server import structured
from server.errors import ApiError
from tests.json_schemas import random_schemas

from .conftest import SERVED_API_KEY

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

API_KEY = SERVED_API_KEY
ASK = [{"role": "user", "content": "The order as JSON, please."}]




@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0)


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def streamed(client, **kwargs):
    """The text and the logprobs content entries of a streamed chat completion, and its finish reason."""
    text, entries, reason = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            reason = choice.finish_reason or reason
    return text, entries, reason


def check_schemas_over_http(client, schemas):
    def run(i):
        kwargs = dict(model="demo", messages=ASK, response_format=schema_format(schemas[i]), max_tokens=600,
                      temperature=1.0, seed=i)
        if i % 2:
            text, _, reason = streamed(client, **kwargs)
            return text, reason
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(run, range(len(schemas))))
    for schema, (text, reason) in zip(schemas, answers):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_schema_output_validates_over_http(client):
    check_schemas_over_http(client, random_schemas(4, seed=21))


@pytest.mark.slow
def test_json_schema_output_validates_over_http_50(client):
    check_schemas_over_http(client, random_schemas(50, seed=22))


def test_json_object_output_parses_over_http(client, served):
    tokenizer = served[1].tokenizer
    bias = {str(i): 6 for i in range(tokenizer.vocab_size) if any(c in tokenizer.decode([i]) for c in '"}]')}
    answer = client.chat.completions.create(model="demo", messages=ASK, response_format={"type": "json_object"},
                                            logit_bias=bias, max_tokens=600, temperature=1.0, seed=4)
    assert answer.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_a_malformed_schema_is_a_400_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=ASK, max_tokens=5,
                                       response_format=schema_format({"type": "object", "minProperties": "x"}))
    error = caught.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format"
    assert error["message"].startswith("invalid JSON schema")
    answer = client.chat.completions.create(model="demo", messages=ASK, max_tokens=3)  # the server goes on
    assert answer.choices[0].finish_reason == "length"


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model="demo", messages=ASK, max_tokens=12, temperature=1.0, seed=5, logprobs=True,
                  top_logprobs=3)
    choice = client.chat.completions.create(**kwargs).choices[0]
    entries = choice.logprobs.content
    assert len(entries) == 12
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == choice.message.content
    for e in entries:
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token or e.token.startswith("bytes:")
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0] + 1e-12
    text, streamed_entries, _ = streamed(client, **kwargs)
    assert text == choice.message.content
    assert [(e.token, e.logprob) for e in streamed_entries] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs(client):
    answer = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0,
                                       logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and logprob == pytest.approx(max(top.values()))  # greedy: the likeliest token
    chunks = [c.choices[0].logprobs for c in client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert sum((c.tokens for c in chunks), []) == logprobs.tokens
    assert sum((c.text_offset for c in chunks), []) == logprobs.text_offset


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_chat_fields(body, param):
    with pytest.raises(ApiError) as caught:
        structured.parse(body, chat=True)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_fields_become_request_arguments():
    chat = structured.parse({"response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 4}, True)
    assert chat.constraint is not None and (chat.logprobs, chat.top_logprobs) == (True, 4)
    assert structured.parse({"response_format": {"type": "text"}}, True).constraint is None
    assert structured.parse({"logprobs": 0}, chat=False).request_fields()["logprobs"] is True
    assert structured.parse({}, chat=False).logprobs is False
    with pytest.raises(ApiError):
        structured.parse({"logprobs": 21}, chat=False)


def test_response_shapes():
    pieces = {1: b"a", 2: b"\xe2\x82", 3: " b".encode()}
    entries = [TokenLogprob(1, -0.5, [(1, -0.5), (3, -1.5)]), TokenLogprob(2, -2.0, [])]
    chat = structured.chat_logprobs(entries, pieces.__getitem__)
    assert chat == {"refusal": None, "content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": " b", "logprob": -1.5, "bytes": [32, 98]}]},
        {"token": "bytes:\\xe2\\x82", "logprob": -2.0, "bytes": [226, 130], "top_logprobs": []}]}
    completion = structured.completion_logprobs(entries, pieces.__getitem__, text_offset=10)
    assert completion == {"tokens": ["a", "bytes:\\xe2\\x82"], "token_logprobs": [-0.5, -2.0],
                          "top_logprobs": [{"a": -0.5, " b": -1.5}, {}], "text_offset": [10, 11]}
    assert structured.chat_logprobs(None, pieces.__getitem__) is None
