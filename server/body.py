"""Reading a request body: its size limit, JSON, nesting depth and text that is valid Unicode."""
import json

from .errors import ApiError, bad_request

MIB = 1 << 20
DEFAULT_MAX_BODY_BYTES = 8 * MIB  # a full-context chat in JSON many times over
MAX_DEPTH = 64  # far past any OpenAI body; deeper ones would reach Python's recursion limit downstream


def too_large(num_bytes, max_bytes):
    return ApiError(413, f"the request body has {'more than ' if num_bytes is None else ''}"
                         f"{max_bytes if num_bytes is None else num_bytes} bytes; the limit is {max_bytes} bytes",
                    code="request_too_large")


class BodyLimit:
    """Middleware: a body whose Content-Length is over `max_bytes` is refused before it is read."""

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes

    def process_request(self, req, resp):
        if req.content_length is not None and req.content_length > self.max_bytes:
            raise too_large(req.content_length, self.max_bytes)


def read_json(req, max_bytes):
    """The body of `req` as a JSON object; at most `max_bytes` are read (a chunked body has no length)."""
    raw = req.bounded_stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise too_large(None, max_bytes)
    try:
        body = json.loads(raw or b"null", parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"the body is nested too deeply; the limit is {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    for name, value in body.items():
        _check_value(name, value)
    return body


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _check_value(name, value):
    """Walks one top-level field without recursion: its depth, and that its strings encode as UTF-8."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"field '{name}' is nested more than {MAX_DEPTH} levels deep", name)
        if isinstance(item, str):
            _check_text(name, item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(name, key)
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    _check_text(name, name)


def _check_text(name, text):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise bad_request(f"field '{name}' holds a lone surrogate (\\u{ord(bad):04x}), which is not valid Unicode",
                          name) from None
