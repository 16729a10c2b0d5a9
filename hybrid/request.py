"""What a caller hands the engine (`Request`) and what it reads back (`RequestHandle` events).

HTTP threads build a `Request`, `Engine.submit` returns a `RequestHandle`, and
the engine thread pushes `Delta`s then one `Finished` or `Failed` into the
handle's queue.
"""
import queue
import time
import uuid
from dataclasses import dataclass, field

from .errors import RequestError
from .sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def context_limit(requested, model_context, source):
    """The context to run at: `requested` (None: the model's), refused when the model holds less."""
    if requested is None:
        return model_context
    if not 1 <= requested <= model_context:
        raise ValueError(f"--max-context {requested}: {source} holds a context of 1 to {model_context} tokens "
                         f"(from its metadata)")
    return requested


@dataclass
class Request:
    prompt_ids: list
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by any thread (Engine.cancel), read by the engine thread
    constraint: object = None  # a hybrid.grammar.Constraint the output must follow; None: free text
    logprobs: bool = False  # return each generated token's log probability
    top_logprobs: int = 0  # ... and the log probabilities of this many likeliest tokens at its step

    def check(self):
        """self, or RequestError naming the first setting out of its range (the sampling ones too)."""
        self.params.validate()
        if not (isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs")
        return self


@dataclass
class Delta:
    """New output: the text it completes (stop strings held back) and the token ids, with their
    `TokenLogprob`s when the request asked for logprobs."""

    text: str
    token_ids: list
    logprobs: list = None


@dataclass
class Finished:
    finish_reason: str  # "stop", "length" or "cancelled"
    text: str
    token_ids: list
    prompt_n: int
    timings: dict
    logprobs: list = None  # TokenLogprob of every generated token but an ending end token, when asked

    @property
    def usage(self):
        return {"prompt_tokens": self.prompt_n, "completion_tokens": len(self.token_ids),
                "total_tokens": self.prompt_n + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": self.timings.get("cache_n", 0)}}


@dataclass
class Failed:
    message: str


class RequestHandle:
    """The caller's end of one request: iterate it for events, or wait for `result()`."""

    def __init__(self, request):
        self.request = request
        self.events = queue.Queue()

    @property
    def request_id(self):
        return self.request.request_id

    def next_event(self, timeout=None):
        """The next event, or None when `timeout` seconds pass without one."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if not isinstance(event, Delta):
                return

    def result(self):
        """Blocks until the request ends: its `Finished` or `Failed` event."""
        for event in self:
            if not isinstance(event, Delta):
                return event


def check_prompt(ids, max_context, vocab_size):
    """A prompt's token ids can be read: not empty, shorter than the context, inside the vocabulary."""
    if not ids:
        raise RequestError("the prompt is empty")
    if len(ids) >= max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {max_context}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def end_reason(token_id, num_generated, num_cached, params, eos_ids, max_context):
    """Why generation ends after sampling `token_id`: "stop" (an end token), "length", or None (go on).

    num_cached: positions whose K/V are computed (the new token's are not yet)."""
    if token_id in eos_ids and not params.ignore_eos:
        return "stop"
    if num_generated >= params.max_tokens or num_cached >= max_context:
        return "length"
    return None


def timings(prompt_n, prompt_s, predicted_n, predicted_s, cache_n=0):
    """llama.cpp's timing fields, so users can compare engines."""
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_s * 1e3,
        "predicted_per_second": predicted_n / predicted_s if predicted_s > 0 else 0.0,
    }


class StopFilter:
    """Cuts generated text at the first stop string, holding back a tail that may begin one.

    Each push searches only the text a new match could lie in (the held-back tail and the new piece), and
    the held-back tail is found from the positions where some stop string's first character stands, so a
    token costs about the length of the stop strings, not their squares."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.by_first_char = {}
        for s in self.stops:
            self.by_first_char.setdefault(s[0], []).append(s)
        self.longest = max(map(len, self.stops), default=0)
        self.pending = ""

    def push(self, piece):
        """-> (text safe to emit now, True when a stop string was reached)."""
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.pending = self.pending[: min(hits)], ""
            return text, True
        cut = self._held_back_start()
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def _held_back_start(self):
        """Where the longest tail of `pending` that begins some stop string starts (its length when none)."""
        pending = self.pending
        for i in range(max(0, len(pending) - self.longest + 1), len(pending)):
            starting_here = self.by_first_char.get(pending[i])
            if starting_here and any(s.startswith(pending[i:]) for s in starting_here):
                return i
        return len(pending)

    def flush(self):
        text, self.pending = self.pending, ""
        return text
