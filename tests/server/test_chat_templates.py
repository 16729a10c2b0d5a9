"""Tool conversations render as transformers renders them (a Qwen3-style template written for the tests); the
streamed output shows the special-token markers a dialect parser reads; gpt-oss's <|end|> ends a message,
not the answer."""
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models
from tokenizers import Tokenizer as BackendTokenizer

from hybrid.tokenizer import IncrementalDecoder, Tokenizer
from server.chat_request import chat_request
from server.tool_calls import DIALECTS

TEMPLATE = (Path(__file__).parent.parent / "data" / "qwen3_style_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Rome and the time?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Two tools at once.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
    {"role": "assistant", "content": "Sunny; it is noon.", "reasoning_content": "Both answered."},
]


@pytest.fixture(scope="module")
def qwen3_style(demo_tokenizer):
    return Tokenizer(demo_tokenizer.backend, source="qwen3-style", pre=demo_tokenizer.pre, bos_id=None,
                     eos_id=demo_tokenizer.eos_id, chat_template=TEMPLATE)


def transformers_text(tokenizer, messages, **kwargs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=tokenizer.token_text(tokenizer.eos_id))
    messages = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    return hf.apply_chat_template(messages, tools=TOOLS, chat_template=tokenizer.chat_template, tokenize=False,
                                  add_generation_prompt=True, **kwargs)


def ours(tokenizer, body):
    chat = chat_request(body, tokenizer.template_variables)
    rendered = tokenizer.render_chat(chat.messages, tools=chat.tools, **chat.template_kwargs)
    return "".join(piece for piece, _ in tokenizer._escaper.split(rendered)), rendered


@pytest.mark.parametrize("num_messages", [2, 3, 5, 6])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_tool_conversation_renders_as_transformers(qwen3_style, num_messages, kwargs):
    messages = CONVERSATION[:num_messages]
    expected = transformers_text(qwen3_style, messages, **kwargs)
    text, _ = ours(qwen3_style, {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs})
    assert text == expected
    assert qwen3_style.encode_rendered(ours(qwen3_style, {"messages": messages, "tools": TOOLS,
                                                          "chat_template_kwargs": kwargs})[1]) == \
        qwen3_style.encode(expected)


def test_the_template_renders_what_the_parser_reads(qwen3_style):
    text, _ = ours(qwen3_style, {"messages": CONVERSATION[:3], "tools": TOOLS})
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = DIALECTS["hermes"].parser({"get_weather": {}, "get_time": {}}, False).parse(turn)
    assert (parsed.reasoning, parsed.content) == ("Two tools at once.", "Checking.\n")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Rome"}),
                                                                        ("get_time", {})]


def marker_tokenizer(specials):
    """A tiny byte-level tokenizer whose `specials` are special tokens."""
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.decoder = decoders.Fuse()  # pieces joined without spaces
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return Tokenizer(backend, source="markers", pre=None, bos_id=None, eos_id=None)


def test_streamed_output_shows_the_markers_a_parser_reads():
    tokenizer = marker_tokenizer(["<tool_call>", "<arg_key>", "<|im_start|>"])
    ids = [tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<tool_call>", "x", "<arg_key>")]

    def streamed():
        decoder = IncrementalDecoder(tokenizer)
        return "".join(decoder.push(i) for i in ids)

    assert streamed() == "x"
    tokenizer.show_special(DIALECTS["glm45"].markers)
    assert streamed() == "<tool_call>x<arg_key>"


def test_harmony_end_closes_a_message_not_the_answer():
    harmony = marker_tokenizer(["<|end|>", "<|return|>", "<|call|>", "<|channel|>"])
    ends = {harmony.token_text(i) for i in harmony.eos_ids}
    assert ends == {"<|return|>", "<|call|>"}
    assert {marker_tokenizer(["<|end|>"]).token_text(i) for i in marker_tokenizer(["<|end|>"]).eos_ids} == {"<|end|>"}
