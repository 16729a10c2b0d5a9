"""What a dialect's output parser gives back, and the streaming pieces the dialects share.

A parser is fed the generated text piece by piece (`push`) and once at the end (`finish`); each call
returns the new `Parsed` output: answer text, reasoning text and complete tool calls. Text that may
begin a marker is held back until the next piece decides it. Parsing a whole text is one `push` and
one `finish`, so a streamed answer and a whole one are the same.
"""
import json
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def new_call_id(prefix="call_"):
    return prefix + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # the text of a JSON object
    id: str = field(default_factory=new_call_id)


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list = field(default_factory=list)

    def add(self, other):
        self.content += other.content
        self.reasoning += other.reasoning
        self.calls += other.calls
        return self


def scan(buffer, markers, final):
    """(text before the first marker, that marker, the rest after it); with no marker in `buffer`:
    (the text that cannot begin one, None, the held-back tail that may), nothing held back when `final`."""
    found = [(i, m) for m in markers for i in [buffer.find(m)] if i >= 0]
    if found:
        i, marker = min(found, key=lambda f: (f[0], -len(f[1])))
        return buffer[:i], marker, buffer[i + len(marker):]
    held = 0 if final else _marker_prefix_length(buffer, markers)
    return buffer[:len(buffer) - held], None, buffer[len(buffer) - held:]


def _marker_prefix_length(buffer, markers):
    """The length of the longest tail of `buffer` that is a proper prefix of a marker."""
    longest = max(map(len, markers), default=0)
    for start in range(max(0, len(buffer) - longest + 1), len(buffer)):
        tail = buffer[start:]
        if any(m.startswith(tail) for m in markers):
            return len(tail)
    return 0


class Trimmed:
    """The text of one block without its leading and trailing whitespace, streamed: trailing whitespace is
    held back until more text follows it, and dropped at the block's end."""

    def __init__(self):
        self.started, self.held = False, ""

    def add(self, text):
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


def arguments_json(arguments):
    """The JSON text of a call's arguments (a dict, or the text of a JSON object); None when neither."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


class StreamParser:
    """The push / finish loop: a subclass has one method per state (`_state_<name>(out, final)`), each
    consuming what it can of `self.buffer` and returning True when the loop should run again."""

    state = "text"

    def __init__(self):
        self.buffer = ""

    def push(self, text):
        self.buffer += text
        return self._run(final=False)

    def finish(self):
        return self._run(final=True)

    def parse(self, text):
        """The whole output of a finished generation."""
        return self.push(text).add(self.finish())

    def _run(self, final):
        out = Parsed()
        while getattr(self, f"_state_{self.state}")(out, final):
            pass
        return out
