"""Structured output and logprobs: OpenAI request fields -> engine arguments, engine logprobs -> OpenAI shapes.

Request side: `response_format` (`text`, `json_object`, `json_schema`) becomes a `Constraint`; chat's
`logprobs` / `top_logprobs` and completions' integer `logprobs` become the Request's logprobs settings.
Response side: a list of `TokenLogprob`s becomes a chat `logprobs` object (`content` entries with `token`,
`logprob`, `bytes`, `top_logprobs`) or a completions one (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`); `token_bytes(id) -> bytes` (the engine's `grammar.token_bytes`) gives each token's bytes.
"""
from dataclasses import dataclass

from hybrid.grammar import Constraint, GrammarError
from hybrid.request import MAX_TOP_LOGPROBS

from .errors import bad_request


@dataclass
class Structured:
    """The request fields the engine's `Request` takes as they are."""

    constraint: Constraint = None
    logprobs: bool = False
    top_logprobs: int = 0

    def request_fields(self):
        return {"constraint": self.constraint, "logprobs": self.logprobs, "top_logprobs": self.top_logprobs}


def parse(body, chat):
    """The structured-output and logprobs settings of a chat (`chat`) or completions body, checked."""
    logprobs, top = chat_logprob_fields(body) if chat else completion_logprob_fields(body)
    return Structured(response_format(body.get("response_format")), logprobs, top)


def response_format(value):
    """OpenAI's `response_format` -> a Constraint, or None for free text."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad_request("field 'response_format' must be an object whose 'type' is 'text', 'json_object' or "
                          "'json_schema'", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("field 'response_format.json_schema' must be an object", "response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return Constraint.json_object()
    if not isinstance(schema, (dict, bool)):
        raise bad_request("field 'response_format.json_schema.schema' must be a JSON schema (an object)",
                          "response_format")
    try:
        return Constraint.from_json_schema(schema)
    except GrammarError as exc:
        raise bad_request(str(exc), "response_format") from None


def chat_logprob_fields(body):
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0 to 20, only with logprobs)."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"field 'logprobs' must be a boolean, got {type(logprobs).__name__}", "logprobs")
    top = _count(body.get("top_logprobs"), "top_logprobs")
    if top and not logprobs:
        raise bad_request("field 'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return bool(logprobs), top


def completion_logprob_fields(body):
    """Completions' `logprobs`: an integer 0 to 20 (the likeliest tokens listed); absent or null: none."""
    value = body.get("logprobs")
    if value is None:
        return False, 0
    return True, _count(value, "logprobs")


def _count(value, name):
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_request(f"field '{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return value


def token_text(data):
    """A token's bytes as OpenAI shows the token: its text, or `bytes:\\xNN...` when not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _entry(token_id, logprob, token_bytes):
    data = token_bytes(token_id)
    return {"token": token_text(data), "logprob": logprob, "bytes": list(data)}


def chat_logprobs(entries, token_bytes):
    """A chat choice's (or stream delta's) `logprobs` object from TokenLogprobs; None when not asked."""
    if entries is None:
        return None
    content = [{**_entry(e.token_id, e.logprob, token_bytes),
                "top_logprobs": [_entry(i, lp, token_bytes) for i, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries, token_bytes, text_offset=0):
    """A completions choice's `logprobs` object; `text_offset`: where the first token starts (a stream's later
    chunks go on from the tokens sent before). Offsets add up the token strings, so a token that is not whole
    UTF-8 counts its `bytes:` form."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(token_text(token_bytes(e.token_id)))
        text_offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(token_bytes(i)): lp for i, lp in e.top} for e in entries],
            "text_offset": offsets}
