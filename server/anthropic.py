"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, on the same engine, slots
and key as the OpenAI routes: the body becomes a chat body (anthropic_request), the output the same
parser reads becomes content blocks (thinking, text, tool_use)."""
import json
import logging
import uuid

from hybrid.request import Delta, Failed

from .anthropic_request import openai_body
from .body import read_json
from .chat import prepare_chat
from .errors import anthropic_error
from .protocol import parse
from .resources import POLL_S, EngineResource, _disconnected

log = logging.getLogger(__name__)

class Messages(EngineResource):
    def on_post(self, req, resp):
        body = read_json(req, self.max_body_bytes)
        self._check_model(body)
        chat_body = openai_body(body)
        parsed = parse(chat_body, self.engine.model.config.vocab_size)
        chat = prepare_chat(self.engine, self.dialect, chat_body)
        request = parsed.request(chat.prompt_ids, self.engine.max_context)
        request.constraint = chat.constraint
        handle = self._submit(request)
        reply = Reply(self.model_id, chat.output, len(chat.prompt_ids), self.engine.tokenizer, parsed.params.stop)
        if parsed.stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = self._events(handle, reply, _disconnected(req))
        else:
            resp.media = reply.message(self._wait(handle, _disconnected(req)))

    def _events(self, handle, reply, disconnected):
        done = False
        try:
            yield _event(reply.start())
            while not disconnected():
                event = handle.next_event(timeout=POLL_S)
                if isinstance(event, Delta):
                    for item in reply.push(reply.output.read(event.text)):
                        yield _event(item)
                elif isinstance(event, Failed):
                    done = True
                    yield _event(anthropic_error(500, f"the request failed: {event.message}"))
                    return
                elif event is not None:
                    done = True
                    for item in reply.finish(event):
                        yield _event(item)
                    return
        finally:
            if not done:
                log.info("client of request %s went away: cancelling it", handle.request_id)
                self.engine.cancel(handle.request_id)


class CountTokens(EngineResource):
    """POST /v1/messages/count_tokens: the prompt's size, as /v1/messages would read it."""

    def on_post(self, req, resp):
        body = read_json(req, self.max_body_bytes)
        chat_body = openai_body({"max_tokens": 1, **body})
        resp.media = {"input_tokens": len(prepare_chat(self.engine, self.dialect, chat_body).prompt_ids)}


def _event(body):
    return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n".encode()


class Reply:
    """One response's bodies: the whole `message`, or the stream's events (`start`, `push`, `finish`)."""

    def __init__(self, model_id, output, num_prompt, tokenizer, stops):
        self.model_id, self.output, self.num_prompt = model_id, output, num_prompt
        self.tokenizer, self.stops = tokenizer, stops
        self.id = f"msg_{uuid.uuid4().hex}"
        self.index, self.open = -1, None  # the content block being streamed: its index and type

    def _stop(self, finished):
        """(stop_reason, stop_sequence)."""
        if self.output.num_calls and finished.finish_reason == "stop":
            return "tool_use", None
        if finished.finish_reason == "length":
            return "max_tokens", None
        ids = finished.token_ids
        if self.stops and ids and ids[-1] not in self.tokenizer.eos_ids:
            text = self.tokenizer.decode(ids)
            found = [(text.find(s), s) for s in self.stops if s in text]
            return "stop_sequence", min(found)[1] if found else self.stops[0]
        return "end_turn", None

    def _usage(self, finished=None):
        return {"input_tokens": self.num_prompt, "output_tokens": len(finished.token_ids) if finished else 0}

    def message(self, finished):
        parsed = self.output.read(finished.text, final=True)
        content = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content.strip() or not parsed.calls:
            content.append({"type": "text", "text": parsed.content})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                    for c in parsed.calls]
        stop_reason, stop_sequence = self._stop(finished)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": self._usage(finished)}

    def start(self):
        return {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": self._usage()}}

    def _block(self, kind, start):
        """Events that close the open block unless it is of `kind`, and open one of `kind` (`start` body)."""
        if self.open == kind and kind != "tool_use":
            return []
        events = self._close()
        self.index, self.open = self.index + 1, kind
        return events + [{"type": "content_block_start", "index": self.index, "content_block": start}]

    def _close(self):
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta):
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def push(self, parsed):
        events = []
        if parsed.reasoning:
            events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content and (parsed.content.strip() or self.open == "text"):
            events += self._block("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in parsed.calls:
            events += self._block("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def finish(self, finished):
        events = self.push(self.output.read_end())
        if self.index < 0:  # no block yet: an empty text block, as a whole message has
            events += self._block("text", {"type": "text", "text": ""})
        stop_reason, stop_sequence = self._stop(finished)
        return events + self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": {"output_tokens": len(finished.token_ids)}},
            {"type": "message_stop"}]
