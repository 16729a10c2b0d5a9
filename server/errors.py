"""Error bodies: OpenAI's {"error": {"message", "type", "param", "code"}}, and Anthropic's on its routes."""
import json

import falcon

ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class ApiError(falcon.HTTPError):
    def __init__(self, status, message, param=None, code=None, headers=None):
        super().__init__(status, title=falcon.code_to_http_status(status), description=message, headers=headers)
        self.param, self.code = param, code


def bad_request(message, param=None):
    return ApiError(400, message, param=param)


def serialize_error(req, resp, exc):
    """Falcon error serializer: every HTTP error (ours and Falcon's own) as OpenAI error JSON, or as
    Anthropic's on its Messages routes."""
    resp.content_type = falcon.MEDIA_JSON
    message = exc.description or exc.title
    if req.path.startswith(ANTHROPIC_PREFIX):
        resp.data = json.dumps(anthropic_error(exc.status_code, message)).encode()
        return
    resp.data = error_body(exc.status_code, message, getattr(exc, "param", None), getattr(exc, "code", None))


def error_body(status, message, param=None, code=None):
    """The JSON bytes of an error. ASCII-escaped: a lone surrogate echoed from a request still encodes."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


def anthropic_error(status, message):
    """Anthropic's error JSON."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
