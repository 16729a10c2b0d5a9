"""OpenAI request bodies -> engine `Request`s, and engine results -> OpenAI response bodies."""
import math
import time
import uuid
from dataclasses import dataclass, replace

from hybrid.request import Request
from hybrid.sampling import LOGIT_BIAS_RANGE, MAX_SEED, SamplingParams

from . import structured
from .errors import bad_request as _bad

_NUMBER = (int, float)
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_LOGIT_BIAS = 1024
MAX_INT32 = 2**31 - 1


@dataclass
class ParsedRequest:
    """A body's settings, checked before its prompt is tokenized; `request(ids)` joins them to the prompt."""

    params: SamplingParams
    stream: bool
    include_usage: bool
    structured: structured.Structured  # response_format and logprobs settings

    def request(self, prompt_ids, max_context):
        """The engine request; without max_tokens in the body, generation may run to the end of the context."""
        max_tokens = self.params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_context - len(prompt_ids))
        return Request(prompt_ids, replace(self.params, max_tokens=max_tokens), **self.structured.request_fields())


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


def integer(body, name, default, low, high):
    """body[name], an integer in [low, high]."""
    value = field(body, name, int, default)
    if value is not None and not low <= value <= high:
        raise _bad(f"field '{name}' must be an integer from {low} to {high}, got {_short(value)}", name)
    return value


def number(body, name, default, rule, in_range):
    """body[name] as a finite float for which `in_range` holds (`rule` says what that is)."""
    value = field(body, name, _NUMBER, None)
    if value is None:
        return default
    converted = _finite(value)
    if converted is None or not in_range(converted):
        raise _bad(f"field '{name}' must be {rule}, got {_short(value)}", name)
    return converted


def _finite(value):
    """`value` as a finite float, or None when it is no number or no finite one."""
    if isinstance(value, bool) or not isinstance(value, _NUMBER):
        return None
    try:
        converted = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return converted if math.isfinite(converted) else None


def _short(value):
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def stop_strings(body):
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise _bad("field 'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise _bad(f"field 'stop' may hold at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                   "characters each", "stop")
    return stop


def logit_bias(body, vocab_size):
    """OpenAI's `logit_bias` ({"token id": bias}) as {int: float}."""
    bias = field(body, "logit_bias", dict, {})
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(f"field 'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", "logit_bias")
    parsed = {}
    for key, given in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < vocab_size:
            raise _bad(f"field 'logit_bias' has key {_short(key)}: keys must be token ids below {vocab_size}",
                       "logit_bias")
        value = _finite(given)
        if value is None or abs(value) > LOGIT_BIAS_RANGE:
            raise _bad(f"field 'logit_bias' has {_short(given)} for token {token}: biases must be numbers from "
                       f"-{LOGIT_BIAS_RANGE:g} to {LOGIT_BIAS_RANGE:g}", "logit_bias")
        parsed[token] = value
    return parsed


def sampling_params(body, vocab_size):
    """The body's sampling settings, each checked (Engine.submit validates the whole); max_tokens is None when
    the body sets none."""
    max_tokens = integer(body, "max_completion_tokens", None, 1, MAX_INT32)
    max_tokens = integer(body, "max_tokens", max_tokens, 1, MAX_INT32)
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", defaults.temperature, "a finite number >= 0", lambda t: t >= 0),
        top_k=integer(body, "top_k", defaults.top_k, 0, MAX_INT32),
        top_p=number(body, "top_p", defaults.top_p, "a number in (0, 1]", lambda p: 0 < p <= 1),
        min_p=number(body, "min_p", defaults.min_p, "a number in [0, 1]", lambda p: 0 <= p <= 1),
        seed=integer(body, "seed", None, 0, MAX_SEED), stop=stop_strings(body),
        ignore_eos=field(body, "ignore_eos", bool, False), logit_bias=logit_bias(body, vocab_size))


def chat_messages(body):
    """The `messages` of a chat body, checked: content parts joined into one string."""
    messages = field(body, "messages", list)
    if not messages:
        raise _bad("field 'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise _bad(f"field 'messages' may hold at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is read
            if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}].content parts must be text parts", "messages")
            m = {**m, "content": "".join(p["text"] for p in content)}
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        checked.append(m)
    return checked


def completion_prompt(body):
    """The `prompt` of a completion body: a string or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise _bad("field 'prompt' must be a string, a list of token ids, or a list of one of those", "prompt")


def parse(body, vocab_size, chat=True):
    """The settings of a chat (`chat`) or completions body (all but its prompt), checked."""
    if integer(body, "n", 1, 1, MAX_INT32) != 1:
        raise _bad("only n = 1 is supported", "n")
    stream = field(body, "stream", bool, False)
    options = field(body, "stream_options", dict, {})
    params = sampling_params(body, vocab_size)
    return ParsedRequest(params, stream, bool(field(options, "include_usage", bool, False)),
                         structured.parse(body, chat))


class Responder:
    """Builds the response bodies of one request: `chat` (chat.completion) or text_completion."""

    def __init__(self, chat, model, token_bytes=None):
        """token_bytes(token id) -> bytes: for the logprobs objects (the engine's `grammar.token_bytes`)."""
        self.chat, self.model, self.token_bytes = chat, model, token_bytes
        self.text_offset = 0  # where the next token's text starts in a completion's logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, choices, chunk=False, **extra):
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _logprobs(self, entries):
        """The OpenAI logprobs object of TokenLogprobs (None: not asked)."""
        if entries is None:
            return None
        if self.chat:
            return structured.chat_logprobs(entries, self.token_bytes)
        body = structured.completion_logprobs(entries, self.token_bytes, self.text_offset)
        if body["tokens"]:
            self.text_offset = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    def _choice(self, text, finish_reason, delta=False, logprobs=None):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        key = "delta" if delta else "message"
        content = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: content, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def complete(self, finished, output=None):
        """The whole response; `output` (a chat's ChatOutput) reads the message out of the text."""
        if output is None:
            choice = self._choice(finished.text, finished.finish_reason, logprobs=finished.logprobs)
        else:
            choice = {"index": 0, "message": output.message(finished.text),
                      "logprobs": self._logprobs(finished.logprobs),
                      "finish_reason": output.finish_reason(finished.finish_reason)}
        return self._body([choice], usage=finished.usage, timings=finished.timings)

    def first_chunk(self):
        delta = {"role": "assistant", "content": ""} if self.chat else ""
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None} if self.chat \
            else self._choice("", None)
        return self._body([choice], chunk=True)

    def delta_chunk(self, text, logprobs=None):
        """A chunk of streamed text; `logprobs`: the TokenLogprobs of its tokens, when asked."""
        return self._body([self._choice(text, None, delta=True, logprobs=logprobs)], chunk=True)

    def chat_delta_chunk(self, delta, logprobs=None):
        """A chunk of one chat delta ({"content": ...}, {"reasoning_content": ...} or {"tool_calls": [...]})."""
        return self._body([{"index": 0, "delta": delta, "logprobs": self._logprobs(logprobs),
                            "finish_reason": None}], chunk=True)

    def final_chunk(self, finished, finish_reason=None, logprobs=None):
        """The chunk with the finish reason; `logprobs`: those of tokens whose text no chunk carried yet."""
        choice = self._choice("", finish_reason or finished.finish_reason, delta=True, logprobs=logprobs)
        if self.chat:
            choice["delta"] = {}
        return self._body([choice], chunk=True, timings=finished.timings)

    def usage_chunk(self, finished):
        return self._body([], chunk=True, usage=finished.usage)
