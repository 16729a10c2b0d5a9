"""Tools, reasoning fields and the Anthropic Messages API against a real HTTP server (the waitress server and
app of `strata serve`, on the demo model with its Qwen3-style template), driven by the official `openai` and
`anthropic` clients. One server, 4 slots (tests/server/conftest.py served), shared with test_structured.py."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import SERVED_API_KEY

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

API_KEY = SERVED_API_KEY
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "unit": {"type": "string", "enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]




@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0], api_key=API_KEY, max_retries=0)


def forced(choice, seed):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": choice}}
    return dict(model="demo", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                max_tokens=120, temperature=1.0, seed=seed)


def check_call(name, arguments, choice):
    assert choice in ("required", name)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


CHOICES = ["get_weather", "required", "get_weather", "required"]


@pytest.mark.slow  # the first 4-slot constrained batch compiles; a 1-slot streamed call runs by default
def test_forced_call_validates_in_four_slots(client):
    def ask(i):
        return client.chat.completions.create(**forced(CHOICES[i], seed=i))

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for choice, answer in zip(CHOICES, answers):
        assert answer.choices[0].finish_reason == "tool_calls"
        (call,) = answer.choices[0].message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        check_call(call.function.name, call.function.arguments, choice)


def streamed_call(client, i):
    """The calls and finish reasons of a streamed forced call (`CHOICES[i]`)."""
    calls, reasons = {}, []
    for chunk in client.chat.completions.create(**forced(CHOICES[i], seed=10 + i), stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = delta.function.name or call["name"]
            call["arguments"] += delta.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    return calls, reasons


@pytest.mark.parametrize("slots", [pytest.param(4, marks=pytest.mark.slow), 1])
def test_forced_call_streams(client, slots):
    with ThreadPoolExecutor(slots) as pool:
        for choice, (calls, reasons) in zip(CHOICES, pool.map(lambda i: streamed_call(client, i), range(slots))):
            assert reasons[-1] == "tool_calls" and list(calls) == [0]
            assert calls[0]["id"].startswith("call_")
            check_call(calls[0]["name"], calls[0]["arguments"], choice)


ROUND_TRIP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Rome for two days?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny", "high": 24}'},
    {"role": "assistant", "content": "Sunny, 24 degrees."},
    {"role": "user", "content": "And in Oslo?"},
]


def transformers_text(tokenizer, messages, **kwargs):
    """What transformers' apply_chat_template renders, with call arguments as objects (as its docs pass them)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=tokenizer.token_text(tokenizer.eos_id))
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return hf.apply_chat_template(messages, tools=TOOLS, chat_template=tokenizer.chat_template, tokenize=False,
                                  add_generation_prompt=True, **kwargs)


def test_round_trip_renders_as_transformers(client, served):
    from server.chat_request import chat_request

    tokenizer = served[1].tokenizer
    expected = transformers_text(tokenizer, ROUND_TRIP)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}' in expected
    chat = chat_request({"messages": ROUND_TRIP, "tools": TOOLS}, tokenizer.template_variables)
    rendered = tokenizer.render_chat(chat.messages, tools=chat.tools)
    assert "".join(piece for piece, _ in tokenizer._escaper.split(rendered)) == expected
    answer = client.chat.completions.create(model="demo", messages=ROUND_TRIP, tools=TOOLS, max_tokens=1)
    assert answer.usage.prompt_tokens == len(tokenizer.encode(expected))


def test_chat_template_kwargs_reach_the_template(client, served):
    tokenizer = served[1].tokenizer
    plain = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1)
    no_think = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    added = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special=False))
    assert no_think.usage.prompt_tokens == plain.usage.prompt_tokens + added
    unused = client.chat.completions.create(model="demo", messages=ASK, max_tokens=1, tools=TOOLS, tool_choice="none")
    assert unused.usage.prompt_tokens == plain.usage.prompt_tokens  # tool_choice none: the template gets no tools


def test_free_chat_streams_as_it_answers_whole(client):
    body = dict(model="demo", messages=ASK, tools=TOOLS, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**body).choices[0]
    chunks = list(client.chat.completions.create(**body, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == (whole.message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


@pytest.mark.parametrize("change,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names the tool 'nope'"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "answers no tool call"),
    ({"tools": TOOLS * 65}, "at most 128 tools"),
    ({"tools": [{"type": "function", "function": {"name": "deep", "parameters": json.loads(
        '{"a":' * 40 + "{}" + "}" * 40)}}]}, "nested more than 32 levels"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits"),
    ({"tool_choice": "required", "tools": None}, "needs at least one tool"),
    ({"chat_template_kwargs": {"messages": []}}, "may not set 'messages'"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"logprobs": True, "top_logprobs": 21}, "20"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool 'f': its parameters cannot be enforced: invalid JSON schema: Invalid type"),
])
def test_bad_tool_input_is_a_400_in_openai_shape(client, change, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo", messages=ASK, tools=TOOLS, max_tokens=1, extra_body=change)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]


def test_tools_on_a_template_without_them_are_refused():
    from server.chat_request import chat_request
    from server.errors import ApiError

    with pytest.raises(ApiError) as caught:
        chat_request({"messages": ASK, "tools": TOOLS}, frozenset({"messages", "add_generation_prompt"}))
    assert caught.value.status_code == 400 and "has no tool support" in caught.value.description


GREEDY = {"temperature": 0}  # this anthropic client takes no temperature argument
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather of a city", "input_schema": WEATHER}]


def test_anthropic_text_message(claude):
    message = claude.messages.create(model="demo", max_tokens=6, system="Be brief.", extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    assert message.usage.input_tokens > 0 and 1 <= message.usage.output_tokens <= 6
    with claude.messages.stream(model="demo", max_tokens=6, system="Be brief.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text and streamed.stop_reason == message.stop_reason


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_anthropic_forced_tool_use(claude, stream):
    body = dict(model="demo", max_tokens=120, tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                messages=[{"role": "user", "content": "Weather in Oslo?"}])
    if stream:
        with claude.messages.stream(**body) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**body)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)


def test_anthropic_tool_result_round_trip_and_stop_sequence(claude):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Oslo", "days": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}]}]
    first = claude.messages.create(model="demo", max_tokens=12, tools=ANTHROPIC_TOOLS, messages=history,
                                   extra_body=GREEDY)
    text = first.content[0].text
    if len(text.strip()) < 4:
        pytest.skip("the random model answered too little to cut")
    stop = text.strip()[2:4]
    cut = claude.messages.create(model="demo", max_tokens=12, tools=ANTHROPIC_TOOLS, messages=history,
                                 extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.find(stop)]


def test_anthropic_key_header_and_errors(served, claude):
    assert claude.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=served[0], api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="demo", max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}])
    assert caught.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "messages[0] (role tool) has tool_call_id 'toolu_x', which answers no tool call of an earlier assistant "
        "message")}}
