"""gpt-oss's chat format through its template: messages reach it as transformers hands them (null fields dropped:
OpenAI clients send `content: null` beside tool calls; the reasoning under `thinking`, which gpt-oss's template
reads), and `reasoning_effort` reaches it; rendered exactly as transformers' apply_chat_template renders them."""
from pathlib import Path

import pytest

from hybrid.tokenizer import Tokenizer
from tests.server.test_chat_templates import CONVERSATION, TOOLS, ours, transformers_text

TEMPLATE = (Path(__file__).parent.parent / "data" / "harmony_style_template.jinja").read_text()
# the tool-calling assistant turn as OpenAI clients send it: content null, the reasoning beside the calls
HARMONY_CONVERSATION = [dict(m, content=None) if m.get("tool_calls") else m for m in CONVERSATION]


@pytest.fixture(scope="module")
def harmony_style(demo_tokenizer):
    return Tokenizer(demo_tokenizer.backend, source="harmony-style", pre=demo_tokenizer.pre, bos_id=None,
                     eos_id=demo_tokenizer.eos_id, chat_template=TEMPLATE)


@pytest.mark.parametrize("num_messages", [2, 3, 6])
@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_harmony_conversation_renders_as_transformers(harmony_style, num_messages, effort):
    messages = HARMONY_CONVERSATION[:num_messages]
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    expected = transformers_text(harmony_style, messages, **kwargs)
    text, _ = ours(harmony_style, {"messages": messages, "tools": TOOLS, **kwargs})
    assert text == expected
    assert f"Reasoning: {effort or 'medium'}" in text
    if num_messages >= 3:
        assert "<|channel|>analysis<|message|>Two tools at once.<|end|>" in text
