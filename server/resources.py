"""The HTTP resources. They never touch the model: they submit to the engine and read a per-request queue."""
import hmac
import io
import json
import logging

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hybrid.errors import RequestError
from hybrid.request import Delta, Failed
from hybrid.scheduler import QueueFull
from hybrid.tokenizer import PromptTooLong

from .body import read_json
from .errors import ApiError, bad_request
from .chat import prepare_chat
from .protocol import Responder, completion_prompt, field, parse

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a waiting response checks whether its client is still there
RETRY_AFTER_S = 2
OPEN_PATHS = ("/health", "/metrics")  # answer without the API key, as llama.cpp's do


def _disconnected(req):
    return req.env.get("waitress.client_disconnected", lambda: False)


class EngineResource:
    """What the generating resources share: submitting to the engine and waiting for the result."""

    def __init__(self, engine, model_id, max_body_bytes, dialect):
        self.engine, self.model_id, self.max_body_bytes, self.dialect = engine, model_id, max_body_bytes, dialect

    def _check_model(self, body):
        model = field(body, "model", str)
        if model is not None and model != self.model_id:
            raise ApiError(404, f"model '{model}' does not exist; this server has '{self.model_id}'", "model",
                           "model_not_found")

    def _submit(self, request):
        try:
            return self.engine.submit(request)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RequestError as exc:
            raise bad_request(str(exc)) from None

    def _wait(self, handle, disconnected):
        while True:
            event = handle.next_event(timeout=POLL_S)
            if event is None or isinstance(event, Delta):
                if disconnected():
                    self.engine.cancel(handle.request_id)
                    raise ApiError(499, "the client disconnected")
                continue
            if isinstance(event, Failed):
                raise ApiError(500, f"the request failed: {event.message}")
            return event


class Completions(EngineResource):
    """POST /v1/chat/completions (`chat`) and /v1/completions."""

    def __init__(self, engine, model_id, chat, max_body_bytes, dialect):
        super().__init__(engine, model_id, max_body_bytes, dialect)
        self.chat = chat

    def on_post(self, req, resp):
        body = read_json(req, self.max_body_bytes)
        self._check_model(body)
        parsed = parse(body, self.engine.model.config.vocab_size, self.chat)  # before the prompt: cheap checks
        output = None
        if self.chat:
            chat = prepare_chat(self.engine, self.dialect, body)
            request = parsed.request(chat.prompt_ids, self.engine.max_context)
            output = chat.output
            if chat.constraint is not None:  # a forced tool call wins over response_format
                request.constraint = chat.constraint
        else:
            request = parsed.request(self._prompt(body), self.engine.max_context)
        handle = self._submit(request)
        responder = Responder(self.chat, self.model_id, self.engine.grammar.token_bytes)
        if parsed.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = self._sse(handle, responder, parsed.include_usage, _disconnected(req), output)
        else:
            resp.media = responder.complete(self._wait(handle, _disconnected(req)), output)

    def _prompt(self, body):
        """A completion prompt's token ids; one past the context is refused, before tokenizing when its size
        proves it."""
        tokenizer, limit = self.engine.tokenizer, self.engine.max_context
        try:
            prompt = completion_prompt(body)
            if isinstance(prompt, str):
                return tokenizer.encode(prompt, token_limit=limit)
            if len(prompt) >= limit:
                raise PromptTooLong(len(prompt), limit, exact=True)
            return prompt
        except PromptTooLong as exc:
            raise ApiError(400, f"{exc}: shorten the prompt", "prompt", "context_length_exceeded") from None

    def _sse(self, handle, responder, include_usage, disconnected, output):
        """The event stream; `output` (a chat's ChatOutput) turns text into chat deltas."""
        done, logprobs = False, None  # logprobs: those of tokens whose text no chunk carried yet
        try:
            yield _sse(responder.first_chunk())
            while not disconnected():
                event = handle.next_event(timeout=POLL_S)
                if isinstance(event, Delta):
                    if event.logprobs is not None:
                        logprobs = (logprobs or []) + event.logprobs
                    if output is not None:
                        for delta in output.push(event.text):
                            yield _sse(responder.chat_delta_chunk(delta, logprobs))
                            logprobs = None
                    elif event.text:
                        yield _sse(responder.delta_chunk(event.text, logprobs))
                        logprobs = None
                elif isinstance(event, Failed):
                    done = True
                    yield _sse({"error": {"message": f"the request failed: {event.message}",
                                          "type": "server_error", "param": None, "code": None}})
                    return
                elif event is not None:
                    done = True
                    reason = event.finish_reason
                    if output is not None:
                        for delta in output.finish():
                            yield _sse(responder.chat_delta_chunk(delta, logprobs))
                            logprobs = None
                        reason = output.finish_reason(reason)
                    yield _sse(responder.final_chunk(event, reason, logprobs))
                    if include_usage:
                        yield _sse(responder.usage_chunk(event))
                    yield b"data: [DONE]\n\n"
                    return
        finally:
            if not done:
                log.info("client of request %s went away: cancelling it", handle.request_id)
                self.engine.cancel(handle.request_id)


def _sse(body):
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Models:
    def __init__(self, model_id, description):
        self.model_id, self.description = model_id, description

    def on_get(self, req, resp):
        resp.media = {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                                  "owned_by": "strata", "description": self.description}]}


class Health:
    def on_get(self, req, resp):
        resp.media = {"status": "ok"}


class Slots:
    def __init__(self, engine):
        self.engine = engine

    def on_get(self, req, resp):
        resp.media = self.engine.snapshot()


class ExpertProfileResource:
    """GET /expert-profile: the expert usage seen since start-up, as a profile file (`?format=npz`, the
    default: what `strata profile` writes, for `strata plan` and `strata profile merge`) or as JSON
    (`?format=json`: tokens and per-layer routing counts, without the co-activation)."""

    def __init__(self, engine):
        self.engine = engine

    def on_get(self, req, resp):
        from placement.profile import model_id

        fmt = req.get_param("format") or "npz"
        if fmt not in ("npz", "json"):
            raise bad_request(f"format must be npz or json, got {fmt!r}", "format")
        profile = self.engine.usage.to_profile(model_id(self.engine.model.weights), source="serve")
        if fmt == "json":
            resp.media = {**profile.header(), "prefill": profile.prefill.tolist(), "decode": profile.decode.tolist()}
            return
        buffer = io.BytesIO()
        profile.save(buffer)
        resp.content_type = "application/octet-stream"
        resp.set_header("Content-Disposition", 'attachment; filename="expert-profile.npz"')
        resp.data = buffer.getvalue()


class Metrics:
    def __init__(self, registry):
        self.registry = registry

    def on_get(self, req, resp):
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = generate_latest(self.registry)


class ApiKey:
    """Middleware: when a key is set, every route but /health and /metrics needs `Authorization: Bearer <key>`
    or `x-api-key: <key>` (Anthropic's header)."""

    def __init__(self, api_key):
        self.api_key = api_key

    def process_request(self, req, resp):
        if not self.api_key or req.path in OPEN_PATHS:
            return
        auth = req.get_header("Authorization") or ""
        key = req.get_header("x-api-key") or ""
        if not (hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode())
                or hmac.compare_digest(key.encode(), self.api_key.encode())):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
                           code="invalid_api_key")
