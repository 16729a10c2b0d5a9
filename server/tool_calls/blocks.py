"""The parser of dialects that wrap reasoning in <think>...</think> and each call in an open / close tag
pair (Qwen / Hermes, GLM-4.5): only the text of one call differs, read by the dialect's `read_call`."""
from .base import THINK_CLOSE, THINK_OPEN, StreamParser, Trimmed, scan


class BlockParser(StreamParser):
    """`tools`: name -> parameters schema of the tools the request offers (empty: calls are not looked
    for); `thinking`: the prompt opened a <think> block, so the output starts inside it; `read_call(text,
    tools)`: the ToolCall that the text between the tags stands for, or None (then it stays text)."""

    def __init__(self, tools, thinking, read_call, call_open, call_close):
        super().__init__()
        self.tools, self.read_call = tools, read_call
        self.call_open, self.call_close = call_open, call_close
        self.state = "think" if thinking else "text"
        self.reasoning = Trimmed()
        self.strip_next = False  # after a closed block: the content's leading whitespace goes

    def _content(self, out, text):
        if self.strip_next:
            text = text.lstrip()
            self.strip_next = not text
        out.content += text

    def _state_text(self, out, final):
        markers = (THINK_OPEN, self.call_open) if self.tools else (THINK_OPEN,)
        before, marker, self.buffer = scan(self.buffer, markers, final)
        self._content(out, before)
        if marker == THINK_OPEN:
            self.state, self.reasoning = "think", Trimmed()
        elif marker is not None:
            self.state = "call"
        return marker is not None

    def _state_think(self, out, final):
        before, marker, self.buffer = scan(self.buffer, (THINK_CLOSE,), final)
        out.reasoning += self.reasoning.add(before)
        if marker is not None:
            self.state, self.strip_next = "text", True
        return marker is not None

    def _state_call(self, out, final):
        end = self.buffer.find(self.call_close)
        if end < 0 and not final:
            return False
        body, rest = (self.buffer, "") if end < 0 else (self.buffer[:end], self.buffer[end + len(self.call_close):])
        call = self.read_call(body, self.tools)
        if call is None:
            self._content(out, self.call_open + body + (self.call_close if end >= 0 else ""))
        else:
            out.calls.append(call)
            self.strip_next = True
        self.buffer, self.state = rest, "text"
        return True


