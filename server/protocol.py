"""OpenAI request bodies -> engine `Request`s, and engine results -> OpenAI response bodies."""
import time
import uuid
from dataclasses import dataclass

from hybrid.request import Request
from hybrid.sampling import SamplingParams

from .errors import bad_request as _bad

_NUMBER = (int, float)


@dataclass
class ParsedRequest:
    request: Request
    stream: bool
    include_usage: bool


def field(body, name, types, default=None):
    """body[name] checked against `types` (bool is never taken for a number)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        kinds = " or ".join(t.__name__ for t in _as_tuple(types))
        raise _bad(f"field '{name}' must be {kinds}, got {type(value).__name__}", name)
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def sampling_params(body, num_prompt, max_context):
    max_tokens = field(body, "max_completion_tokens", int, None)
    max_tokens = field(body, "max_tokens", int, max_tokens)
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise _bad("field 'stop' must be a string or a list of strings", "stop")
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max(1, max_context - num_prompt),
        temperature=float(field(body, "temperature", _NUMBER, defaults.temperature)),
        top_k=field(body, "top_k", int, defaults.top_k),
        top_p=float(field(body, "top_p", _NUMBER, defaults.top_p)),
        min_p=float(field(body, "min_p", _NUMBER, defaults.min_p)),
        seed=field(body, "seed", int, None), stop=stop, ignore_eos=field(body, "ignore_eos", bool, False))
    try:
        return params.validate()
    except ValueError as exc:
        raise _bad(str(exc)) from None


def chat_prompt(body, tokenizer):
    messages = field(body, "messages", list)
    if not messages:
        raise _bad("field 'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is read
            if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}].content parts must be text parts", "messages")
            m["content"] = "".join(p["text"] for p in content)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def completion_prompt(body, tokenizer):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _bad("field 'prompt' must be a string, a list of token ids, or a list of one of those", "prompt")


def parse(body, prompt_ids, max_context):
    """The engine request of a validated body whose prompt is `prompt_ids`."""
    if field(body, "n", int, 1) != 1:
        raise _bad("only n = 1 is supported", "n")
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    params = sampling_params(body, len(prompt_ids), max_context)
    return ParsedRequest(Request(prompt_ids, params), stream, bool(field(options, "include_usage", bool, False)))


class Responder:
    """Builds the response bodies of one request: `chat` (chat.completion) or text_completion."""

    def __init__(self, chat, model):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, choices, chunk=False, **extra):
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _choice(self, text, finish_reason, delta=False):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if delta else "message"
        content = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish_reason}

    def complete(self, finished):
        return self._body([self._choice(finished.text, finished.finish_reason)],
                          usage=finished.usage, timings=finished.timings)

    def first_chunk(self):
        delta = {"role": "assistant", "content": ""} if self.chat else ""
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None} if self.chat \
            else self._choice("", None)
        return self._body([choice], chunk=True)

    def delta_chunk(self, text):
        return self._body([self._choice(text, None, delta=True)], chunk=True)

    def final_chunk(self, finished):
        choice = self._choice("", finished.finish_reason, delta=True)
        if self.chat:
            choice["delta"] = {}
        return self._body([choice], chunk=True, timings=finished.timings)

    def usage_chunk(self, finished):
        return self._body([], chunk=True, usage=finished.usage)
