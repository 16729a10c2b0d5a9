"""Qwen / Hermes tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one per call."""
import json

from .base import THINK_CLOSE, ToolCall, arguments_json
from .blocks import BlockParser
from .grammar import calls_grammar, json_rule, text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKERS = (OPEN, CLOSE, "<think>", THINK_CLOSE)


def read_call(body, tools):
    """The call that the JSON between the tags stands for; None when it is no JSON object naming an offered
    tool with an object of arguments."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    arguments = arguments_json(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else ToolCall(value["name"], arguments)


def parser(tools, thinking):
    return BlockParser(tools, thinking, read_call, OPEN, CLOSE)


def grammar(tools, parallel, marker, thinking):
    """Lark text forcing calls of `tools` (name -> parameters schema), as the template writes them."""
    rules = []
    for i, (name, schema) in enumerate(tools.items()):
        head = marker(OPEN) + " " + text('\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        rules.append((f"call_{i}", f'{head} args_{i} {text("}" + chr(10))} {marker(CLOSE)}'))
        rules.append((f"args_{i}", json_rule(schema)))
    prefix = f"{marker(THINK_CLOSE)} {text(chr(10) * 2)} " if thinking else ""
    return calls_grammar(rules, parallel, prefix)
