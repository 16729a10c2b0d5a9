"""gpt-oss's harmony format: messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>
BODY<|end|>`, the next one after `<|start|>assistant`. The analysis channel is reasoning, final (and
commentary without a recipient) is the answer, a commentary message to `functions.NAME` is a call (its
body a JSON object, ended by <|call|>, an end-of-generation token, so the text just stops)."""
import re

from .base import StreamParser, ToolCall, Trimmed, arguments_json, scan
from .grammar import json_rule, text

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN, CALL, RETURN)
_HEADER_STARTS = (START, CHANNEL, "to=", "assistant")
_BODY_ENDS = (END, CALL, RETURN, START)
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class HarmonyParser(StreamParser):
    state = "header"

    def __init__(self, tools, thinking=False):
        super().__init__()
        self.tools = tools
        self.kind, self.name, self.body, self.reasoning = None, None, "", Trimmed()

    def _state_header(self, out, final):
        start = self.buffer.lstrip()
        if start and not any(s.startswith(start[:len(s)]) for s in _HEADER_STARTS):
            self.state = "raw"  # no harmony message: the text is the answer
            return True
        end = self.buffer.find(MESSAGE)
        if end < 0:
            if final:
                out.content += self.buffer
                self.buffer = ""
            return False
        header, self.buffer = self.buffer[:end], self.buffer[end + len(MESSAGE):]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        self.name = recipient.group(1) if recipient else None
        if self.name in self.tools:
            self.kind, self.body = "call", ""
        elif channel and channel.group(1) == "analysis":
            self.kind, self.reasoning = "reasoning", Trimmed()
        else:
            self.kind = "content"
        self.state = "body"
        return True

    def _state_body(self, out, final):
        before, marker, self.buffer = scan(self.buffer, _BODY_ENDS, final)
        if self.kind == "call":
            self.body += before
        elif self.kind == "reasoning":
            out.reasoning += self.reasoning.add(before)
        else:
            out.content += before
        if marker is None and not final:
            return False
        if self.kind == "call":
            arguments = arguments_json(self.body)
            if arguments is None:
                out.content += self.body
            else:
                out.calls.append(ToolCall(self.name, arguments))
        self.state = "header"
        return marker is not None

    def _state_raw(self, out, final):
        out.content += self.buffer
        self.buffer = ""
        return False


def parser(tools, thinking):
    return HarmonyParser(tools, thinking)


def grammar(tools, parallel, marker, thinking):
    """Lark text forcing one call of `tools` (name -> parameters schema): a commentary message to it;
    harmony ends a call's message with <|call|>, which ends generation, so one call is all it holds."""
    rules = []
    for i, (name, schema) in enumerate(tools.items()):
        head = f"{marker(CHANNEL)} {text('commentary to=functions.' + name + ' ')} {marker(CONSTRAIN)} {text('json')}"
        rules.append(f"call_{i}: {head} {marker(MESSAGE)} args_{i}")
        rules.append(f"args_{i}: {json_rule(schema)}")
    names = " | ".join(f"call_{i}" for i in range(len(tools)))
    return "\n".join([f"start: {names}", *rules]) + "\n"
