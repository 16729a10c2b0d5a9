"""One chat request's generated text as OpenAI's message (`message`) or stream deltas (`push`, `finish`):
answer text, `reasoning_content` and `tool_calls`, read by the model's dialect parser."""


class ChatOutput:
    """`parser`: a fresh dialect parser (server/tool_calls); `parallel`: more than one call may be kept."""

    def __init__(self, parser, parallel=True):
        self.parser, self.parallel = parser, parallel
        self.num_calls = 0

    def _calls(self, parsed):
        """The parsed calls this response keeps (only the first of all, unless parallel)."""
        calls = parsed.calls if self.parallel else parsed.calls[:max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return calls

    def read(self, text, final=False):
        """The `Parsed` output of newly generated text (`final`: of the whole text), with the calls kept."""
        parsed = self.parser.parse(text) if final else self.parser.push(text)
        parsed.calls = self._calls(parsed)
        return parsed

    def read_end(self):
        """The `Parsed` output held back until the end, with the calls kept."""
        parsed = self.parser.finish()
        parsed.calls = self._calls(parsed)
        return parsed

    def message(self, text):
        """The `message` of a whole response."""
        parsed = self.read(text, final=True)
        calls = parsed.calls
        message = {"role": "assistant", "content": parsed.content if parsed.content.strip() or not calls else None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message

    def push(self, text):
        """The deltas of newly generated text."""
        return self._deltas(self.read(text))

    def finish(self):
        """The deltas of the text held back until the end."""
        return self._deltas(self.read_end())

    def _deltas(self, parsed):
        deltas = []
        if parsed.reasoning:
            deltas.append({"reasoning_content": parsed.reasoning})
        if parsed.content:
            deltas.append({"content": parsed.content})
        for index, call in enumerate(parsed.calls, self.num_calls - len(parsed.calls)):
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas

    def finish_reason(self, reason):
        """OpenAI's finish reason: "tool_calls" when the answer made calls."""
        return "tool_calls" if self.num_calls and reason == "stop" else reason
