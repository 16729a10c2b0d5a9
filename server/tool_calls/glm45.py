"""GLM-4.5 tool calls: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`.

A value is written as it is when it is a string, else as JSON; reading it back, the tool's schema says
which (a string parameter keeps "42" a string)."""
import json
import re

from .base import THINK_CLOSE, THINK_OPEN, ToolCall
from .blocks import BlockParser
from .grammar import calls_grammar, json_rule, text

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
MARKERS = (OPEN, CLOSE, KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE, THINK_OPEN, THINK_CLOSE)
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def read_call(body, tools):
    """The call of the text between the tags; None unless it is an offered tool's name and whole pairs."""
    name, opened, rest = body.partition(KEY_OPEN)
    name = name.strip()
    if name not in tools or any(c.isspace() for c in name):
        return None
    properties = tools[name].get("properties") or {}
    arguments, rest, at = {}, opened + rest, 0
    while at < len(rest):
        pair = _PAIR.match(rest, at)
        if pair is None:
            return None
        key = pair.group(1).strip()
        arguments[key] = _value(pair.group(2), properties.get(key))
        at = pair.end()
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _value(raw, schema):
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parser(tools, thinking):
    return BlockParser(tools, thinking, read_call, OPEN, CLOSE)


def grammar(tools, parallel, marker, thinking):
    """Lark text forcing calls of `tools` (name -> parameters schema): the required parameters in order,
    then each optional one or not."""
    rules = []
    for i, (name, schema) in enumerate(tools.items()):
        properties, required = schema.get("properties") or {}, set(schema.get("required") or ())
        pairs = []
        for j, (key, sub) in enumerate(properties.items()):
            rules.append((f"value_{i}_{j}", _value_rule(sub, schema)))
            pair = (f"{marker(KEY_OPEN)} {text(key)} {marker(KEY_CLOSE)} {text(chr(10))} {marker(VALUE_OPEN)} "
                    f"value_{i}_{j} {marker(VALUE_CLOSE)} {text(chr(10))}")
            pairs.append(pair if key in required else f"({pair})?")
        rules.append((f"call_{i}", f"{marker(OPEN)} {text(name + chr(10))} {' '.join(pairs)} {marker(CLOSE)}"))
    prefix = f"{marker(THINK_CLOSE)} " if thinking else ""
    return calls_grammar(rules, parallel, prefix, separator=None)


def _value_rule(sub, schema):
    """A string parameter's raw text (no '<', which would begin a marker), else its JSON."""
    if isinstance(sub, dict) and sub.get("type") == "string" and set(sub) <= {"type", "description", "title"}:
        return r"/[^<]*/"
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return json_rule({**(sub if isinstance(sub, dict) else {}), **defs})
