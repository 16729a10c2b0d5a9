"""Each tool-call dialect's parser on outputs written by hand after the dialect's documentation, broken ones
too; streamed piece by piece it gives what it gives on the whole text; its forced-call grammar accepts what
the parser reads back."""
import json

import pytest

from server.tool_calls import DIALECTS, Markers, dialect_for
from server.tool_calls.base import Parsed

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}


def parse(dialect, text, thinking=False, tools=TOOLS):
    return DIALECTS[dialect].parser(tools, thinking).parse(text)


def streamed(dialect, text, size, thinking=False):
    parser, out = DIALECTS[dialect].parser(TOOLS, thinking), Parsed()
    for i in range(0, len(text), size):
        out.add(parser.push(text[i:i + size]))
    return out.add(parser.finish())


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


HERMES = [  # (output, content, reasoning, calls)
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Rome"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     '</tool_call>', "Let me check.\n", "The user wants weather.",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', "", "",
     [("get_weather", {"city": "Oslo"})]),  # arguments as a JSON string
    ("<think>\nHmm.\n</think>\n\nIt is sunny.", "It is sunny.", "Hmm.", []),
    # broken: stays text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', "", []),
    ('<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>', "", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', "", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Pa', "", []),  # cut by max_tokens
    ("I would write <tool_call but do not.", "I would write <tool_call but do not.", "", []),
]

GLM = [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", "", "", [("get_weather", {"city": "Beijing", "days": 3})]),
    ("<think>Look it up.</think>\nChecking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42"
     "</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>", "Checking.", "Look it up.",
     [("get_weather", {"city": "42"}), ("get_time", {})]),  # a string parameter stays a string
    # broken: stays text
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing\n</tool_call>",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing\n</tool_call>", "", []),
    ("<tool_call>get weather\n</tool_call>", "<tool_call>get weather\n</tool_call>", "", []),
    ("<tool_call>get_weather\nstray text<arg_key>city</arg_key><arg_value>X</arg_value></tool_call>",
     "<tool_call>get_weather\nstray text<arg_key>city</arg_key><arg_value>X</arg_value></tool_call>", "", []),
]

HARMONY = [
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}', "", "Need the weather.",
     [("get_weather", {"city": "Tokyo"})]),
    ('<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!',
     "Hello there!", "Simple.", []),
    ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}', "", "",
     [("get_time", {})]),  # the recipient in the role part
    # broken: stays text
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ', '{"city": ', "", []),
    ('<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}', "{}", "", []),
    ("Plain text without any channel.", "Plain text without any channel.", "", []),
]


@pytest.mark.parametrize("dialect,cases", [("hermes", HERMES), ("glm45", GLM), ("harmony", HARMONY)])
def test_parser_reads_hand_written_outputs(dialect, cases):
    for text, content, reasoning, expected in cases:
        whole = parse(dialect, text)
        assert (whole.content, whole.reasoning, calls(whole)) == (content, reasoning, expected), text
        for size in (1, 3, 7):
            piecewise = streamed(dialect, text, size)
            assert (piecewise.content, piecewise.reasoning, calls(piecewise)) == (content, reasoning, expected)


def test_a_prompt_that_opens_thinking_starts_the_output_inside_it():
    out = parse("hermes", "Let me think.\n</think>\n\nDone.", thinking=True)
    assert (out.reasoning, out.content) == ("Let me think.", "Done.")
    assert DIALECTS["hermes"].thinking("<|im_start|>assistant\n<think>\n")
    assert not DIALECTS["hermes"].thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_without_tools_calls_stay_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert parse("hermes", text, tools={}).content == text


def test_dialect_from_template():
    assert dialect_for("{{ '<tool_call>' }}{{ tools }}").name == "hermes"
    assert dialect_for("<tool_call>{{ name }}<arg_key>").name == "glm45"
    assert dialect_for("<|start|>assistant<|channel|>final").name == "harmony"
    assert dialect_for(None).name == "plain"


CANONICAL = {  # a call as each dialect's template renders it
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days"
             "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
               '"days": 2}',
}


@pytest.mark.parametrize("dialect", sorted(CANONICAL))
def test_forced_grammar_accepts_the_template_form_and_refuses_others(dialect, demo_tokenizer):
    from hybrid.grammar import Constraint, GrammarVocab

    vocab = GrammarVocab.of(demo_tokenizer, demo_tokenizer.vocab_size)
    grammar = DIALECTS[dialect].grammar({"get_weather": WEATHER}, False, Markers({}), False)
    constraint = Constraint.from_lark(grammar)

    def accepts(text):
        matcher = vocab.matcher(constraint)
        ids = demo_tokenizer.encode(text, add_special=False)
        return all(matcher.consume(t) for t in ids) and matcher.ll.is_accepting()

    assert accepts(CANONICAL[dialect])
    assert calls(parse(dialect, CANONICAL[dialect])) == [("get_weather", {"city": "Paris", "days": 2})]
    assert not accepts(CANONICAL[dialect].replace("Paris", "Paris", 1).replace("2", '"two"'))
    assert not accepts(CANONICAL[dialect].replace("get_weather", "get_time"))


THOUGHT_AND_CALL = ('<think>\nWeather needed.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Paris"}}\n</tool_call>')


def test_openai_message_and_deltas():
    from server.chat_output import ChatOutput

    message = ChatOutput(DIALECTS["hermes"].parser(TOOLS, False)).message(THOUGHT_AND_CALL)
    assert message["content"] is None and message["reasoning_content"] == "Weather needed."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = ChatOutput(DIALECTS["hermes"].parser(TOOLS, False))
    deltas = [d for piece in THOUGHT_AND_CALL for d in output.push(piece)] + output.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather needed."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"


def test_only_the_first_call_without_parallel_calls():
    from server.chat_output import ChatOutput

    two = THOUGHT_AND_CALL + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert len(ChatOutput(DIALECTS["hermes"].parser(TOOLS, False)).message(two)["tool_calls"]) == 2
    (call,) = ChatOutput(DIALECTS["hermes"].parser(TOOLS, False), parallel=False).message(two)["tool_calls"]
    assert call["function"]["name"] == "get_weather"


def test_anthropic_events_of_thinking_and_a_call(demo_tokenizer):
    from hybrid.request import Finished
    from server.anthropic import Reply
    from server.chat_output import ChatOutput

    reply = Reply("demo", ChatOutput(DIALECTS["hermes"].parser(TOOLS, False)), 5, demo_tokenizer, [])
    events = [reply.start()]
    for piece in THOUGHT_AND_CALL:
        events += reply.push(reply.output.read(piece))
    events += reply.finish(Finished("stop", THOUGHT_AND_CALL, [1, 2, 3], 5, {}))
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type")) for e in events]
    kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # consecutive deltas as one
    assert kinds == [("message_start", None), ("content_block_start", "thinking"),
                     ("content_block_delta", "thinking_delta"), ("content_block_stop", None),
                     ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"output_tokens": 3}


def test_the_anthropic_client_reads_those_events(demo_tokenizer):
    anthropic = pytest.importorskip("anthropic")
    httpx = pytest.importorskip("httpx2")  # the anthropic client's HTTP library

    from hybrid.request import Finished
    from server.anthropic import Reply, _event
    from server.chat_output import ChatOutput

    reply = Reply("demo", ChatOutput(DIALECTS["hermes"].parser(TOOLS, False)), 5, demo_tokenizer, [])
    events = [reply.start()] + reply.push(reply.output.read(THOUGHT_AND_CALL))
    events += reply.finish(Finished("stop", THOUGHT_AND_CALL, [1, 2, 3], 5, {}))
    stream = b"".join(map(_event, events))

    def answer(request):
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    client = anthropic.Anthropic(api_key="k", base_url="http://strata.test", max_retries=0,
                                 http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    with client.messages.stream(model="demo", max_tokens=9, messages=[{"role": "user", "content": "?"}]) as s:
        message = s.get_final_message()
    thinking, use = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Weather needed.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert message.stop_reason == "tool_use" and message.usage.output_tokens == 3
