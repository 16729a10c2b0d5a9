"""Slots, the request queue and continuous batching with chunked prompt reads.

Plain Python: no kernels, no model. Every step carries one token for each
decoding slot plus at most one prompt chunk (of the prompt admitted first).

The decode share rule: while decoding slots wait on a prompt read, prompt
chunks may add at most `decode_step * (1 / decode_share - 1)` seconds per
step on average, where `decode_step` is the measured time of a step that only
decodes. Each decoding slot gets one token per step, so over a few steps it
keeps at least `decode_share` of the rate it has when nobody reads a prompt.
Every step earns that allowance as credit; a step with a chunk spends the
time the chunk added (measured). A chunk is as large as the credit pays for
at the measured cost per prompt token, and at least `min_chunk` tokens (or
the rest of the prompt): when the credit does not cover that, the step only
decodes and the credit grows. So chunks stay large enough to amortize their
fixed cost, and the prompt always moves. With no slot decoding, a chunk
takes the whole step budget.
"""
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from .request import end_reason

log = logging.getLogger(__name__)

DEFAULT_DECODE_SHARE = 0.8
DEFAULT_STEP_TOKENS = 512


class SlotState(enum.Enum):
    IDLE = "idle"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class QueueFull(Exception):
    """The queue holds its limit of waiting requests."""


@dataclass
class Slot:
    index: int
    kv: object  # SequenceKV, reused by every request of this slot
    state: SlotState = SlotState.IDLE
    request: object = None
    num_cached: int = 0  # tokens whose K/V are in `kv`
    cache_n: int = 0  # prompt tokens restored from the conversation cache
    output_ids: list = field(default_factory=list)
    finish_reason: str = None
    prompt_started: float = 0.0
    prompt_finished: float = 0.0

    @property
    def num_prompt_left(self):
        return len(self.request.prompt_ids) - self.num_cached

    def start(self, request):
        self.kv.truncate(0)
        self.state, self.request, self.num_cached, self.cache_n = SlotState.PREFILL, request, 0, 0
        self.output_ids, self.finish_reason = [], None


@dataclass
class ScheduledChunk:
    slot: Slot
    token_ids: list
    start: int
    logits: str  # "last" when a token is sampled after this chunk, else "none"


@dataclass
class Step:
    chunks: list  # decode chunks first, then at most one prompt chunk
    cancelled: list  # requests dropped this step (from the queue or from a slot)
    num_decode: int = 0
    num_prompt: int = 0
    prompt_waiting: bool = False  # a slot is reading a prompt (whether or not this step carries a chunk)


def _ema(old, new, alpha=0.3):
    return new if old is None else (1 - alpha) * old + alpha * new


class ChunkSizer:
    """The prompt chunk size of each step under the decode share rule (see the module docstring)."""

    def __init__(self, decode_share, max_step_tokens, min_chunk=16):
        if not 0 < decode_share <= 1:
            raise ValueError(f"decode share must be in (0, 1], got {decode_share}")
        self.decode_share, self.max_step_tokens, self.min_chunk = decode_share, max_step_tokens, min_chunk
        self.decode_s = None  # seconds of a step that only decodes
        self.prompt_token_s = None  # extra seconds per prompt token of a step that also decodes
        self.credit_s = 0.0  # prompt-read time earned by the steps since the last chunk, less what it spent

    def size(self, num_decode, num_left):
        """Prompt tokens for this step; 0 means decode only and let the credit grow."""
        if num_decode == 0:
            return min(num_left, self.max_step_tokens)
        limit = min(num_left, self.max_step_tokens - num_decode)
        if self.decode_s is None or self.prompt_token_s is None:
            return min(limit, self.min_chunk)  # a first chunk to measure its cost
        n = min(int(self.credit_s / self.prompt_token_s), limit)
        return n if n >= min(self.min_chunk, limit) else 0

    def record(self, num_decode, num_prompt, prompt_waiting, elapsed_s):
        if not num_decode or not prompt_waiting:
            self.credit_s = 0.0
        if not num_decode:
            return
        if not num_prompt:
            self.decode_s = _ema(self.decode_s, elapsed_s)
        elif self.decode_s is not None:
            extra_s = max(elapsed_s - self.decode_s, 0.0)
            self.prompt_token_s = _ema(self.prompt_token_s, max(extra_s, 1e-6) / num_prompt)
            self.credit_s -= extra_s
        if prompt_waiting and self.decode_s is not None:
            self.credit_s += self.decode_s * (1 / self.decode_share - 1)


class Scheduler:
    def __init__(self, num_slots, new_sequence, max_context, eos_ids=(), max_queue=64,
                 decode_share=DEFAULT_DECODE_SHARE, max_step_tokens=DEFAULT_STEP_TOKENS, clock=time.perf_counter,
                 restore_prefix=None):
        """restore_prefix(prompt_ids, kv) -> tokens restored: fills a new slot's KV from parked conversations."""
        if num_slots < 1:
            raise ValueError(f"the number of slots must be >= 1, got {num_slots}")
        if max_step_tokens <= num_slots:
            raise ValueError(f"the step budget ({max_step_tokens} tokens) must exceed the slots ({num_slots})")
        self.slots = [Slot(i, new_sequence()) for i in range(num_slots)]
        self.queue = deque()
        self.max_queue, self.max_context = max_queue, max_context
        self.eos_ids = frozenset(eos_ids)
        self.sizer = ChunkSizer(decode_share, max_step_tokens)
        self.clock = clock
        self.restore_prefix = restore_prefix

    def add(self, request):
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"{len(self.queue)} requests are waiting (the limit is {self.max_queue})")
        self.queue.append(request)

    def has_work(self):
        return bool(self.queue) or any(s.state is not SlotState.IDLE for s in self.slots)

    def schedule(self):
        cancelled = self._drop_cancelled()
        self._admit()
        chunks = [ScheduledChunk(s, [s.output_ids[-1]], s.num_cached, "last")
                  for s in self.slots if s.state is SlotState.DECODE]
        step = Step(chunks, cancelled, num_decode=len(chunks))
        reading = [s for s in self.slots if s.state is SlotState.PREFILL]
        if reading:
            slot = min(reading, key=lambda s: s.prompt_started)
            n = self.sizer.size(step.num_decode, slot.num_prompt_left)
            step.prompt_waiting, step.num_prompt = True, n
            if n:
                ids = slot.request.prompt_ids[slot.num_cached : slot.num_cached + n]
                last = n == slot.num_prompt_left
                chunks.append(ScheduledChunk(slot, ids, slot.num_cached, "last" if last else "none"))
        return step

    def _drop_cancelled(self):
        dropped = [r for r in self.queue if r.cancelled]
        self.queue = deque(r for r in self.queue if not r.cancelled)
        for slot in self.slots:
            if slot.state in (SlotState.PREFILL, SlotState.DECODE) and slot.request.cancelled:
                dropped.append(slot.request)
                self.finish(slot, "cancelled")
                self.release(slot)
        return dropped

    def _admit(self):
        for slot in self.slots:
            if slot.state is SlotState.IDLE and self.queue:
                slot.start(self.queue.popleft())
                slot.prompt_started = self.clock()
                if self.restore_prefix is not None:
                    slot.num_cached = slot.cache_n = self.restore_prefix(slot.request.prompt_ids, slot.kv)

    def record(self, step, elapsed_s):
        """Feed the measured time of `step` to the chunk sizer."""
        self.sizer.record(step.num_decode, step.num_prompt, step.prompt_waiting, elapsed_s)

    def advance(self, chunk):
        """After the forward pass of `chunk`: its tokens are cached; a finished prompt turns to DECODE."""
        slot = chunk.slot
        slot.num_cached += len(chunk.token_ids)
        if slot.state is SlotState.PREFILL and slot.num_prompt_left == 0:
            slot.state, slot.prompt_finished = SlotState.DECODE, self.clock()

    def append_token(self, slot, token_id):
        """Append a sampled token; returns the finish reason when it ends the request, else None."""
        slot.output_ids.append(token_id)
        return end_reason(token_id, len(slot.output_ids), slot.num_cached, slot.request.params, self.eos_ids,
                          self.max_context)

    def finish(self, slot, reason):
        slot.state, slot.finish_reason = SlotState.DONE, reason

    def release(self, slot):
        slot.state, slot.request = SlotState.IDLE, None
