"""Slots, the request queue and continuous batching with chunked prompt reads.

Plain Python: no kernels, no model. Every step carries one token for each
decoding slot plus the step's prompt tokens: chunks of the reading slots'
prompts, the one admitted first first, so requests that arrive together and
fit one step's budget are read together and start decoding together.

The decode share rule: while decoding slots wait on a prompt read, prompt
chunks may add at most `decode_step * (1 / decode_share - 1)` seconds per
step on average, where `decode_step` is the measured time of a whole step
that only decodes (schedule, forward, sampling: all the decoding slots wait
for). Each decoding slot gets one token per step, so over a few steps it
keeps at least `decode_share` of the rate it has when nobody reads a prompt.
Every step earns that allowance as credit; a step with a chunk spends the
time the chunk added (measured); a debt is paid back by the next steps even
when no prompt waits, and nothing is saved while none waits.

Chunk size: a chunk costs a fixed part (every expert its tokens touch is
read once per step, however few tokens use it) plus a part per token, so
small chunks read slowly: on a CPU MoE a 16-token chunk can cost 5x per
token what a 512-token one does. The sizer fits `cost(n) = a + b * n` to
the chunks it measured and takes the smallest chunk that reads at least
`CHUNK_EFFICIENCY` of the speed of a full-budget one (larger when the credit
pays for more); it waits, decoding only, until the credit pays for that
chunk. So the read gets the whole time the share leaves, spent in chunks
large enough to use it well. With no slot decoding, a chunk takes the whole
step budget, or `solo_step_tokens` where the backend reads longer chunks well
(a GPU holding every expert: fewer, fuller expert tiles); a slot that starts
decoding brings back the share rule and its budget at the next step.
"""
import enum
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from .request import end_reason
from .speculative.policy import StepTimes

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
    admitted: int = 0  # admission order: the prompt admitted first is read first
    prompt_finished: float = 0.0
    drafts: list = field(default_factory=list)  # draft tokens scored in this step's decode chunk

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
    logits: str  # "last" when a token is sampled after this chunk, "all" for a decode chunk with drafts, else "none"
    hidden: object = None  # after the forward pass: the chunk's hidden rows [n, H], where its drafter reads them


@dataclass
class Step:
    chunks: list  # decode chunks first, then the prompt chunks (oldest admission first)
    cancelled: list  # requests dropped this step (from the queue or from a slot)
    num_decode: int = 0  # decoding slots (each scores one token, and its drafts)
    num_draft: int = 0  # draft tokens in the decode chunks
    num_accepted: int = 0  # drafts the sampler kept (set after the step)
    num_prompt: int = 0
    prompt_waiting: bool = False  # a slot is reading a prompt (whether or not this step carries a chunk)


def _ema(old, new, alpha=0.3):
    return new if old is None else (1 - alpha) * old + alpha * new


CHUNK_EFFICIENCY = 0.9  # a chunk reads at least this fraction of the speed of a full-budget chunk
# Weight of the newest decode-only step in `decode_s`. Chunks are charged against `decode_s` and run when
# the credit it earns suffices, so a fast-moving average would charge the chunks that follow a slow
# decode step too little (a bias of up to 2x with 30 % step-time noise); 0.1 keeps it a few percent.
DECODE_ALPHA = 0.1


class ChunkCost:
    """Seconds a prompt chunk of n tokens adds to a decoding step: `a + b * n`, fitted over recent chunks.

    Exponentially weighted least squares, so the fit follows a cost that drifts (attention grows with
    the chunk's position). While the sizes seen are too alike to tell `a` from `b`, `line()` is None
    and the cost is taken as proportional to n (the pessimistic choice for chunks larger than those seen).
    """

    def __init__(self, decay=0.9, min_spread=0.2):
        self.decay, self.min_spread = decay, min_spread
        self.weight = self.sum_n = self.sum_nn = self.sum_s = self.sum_ns = 0.0

    @property
    def known(self):
        return self.weight > 0

    @property
    def mean_n(self):
        return self.sum_n / self.weight

    def add(self, n, extra_s):
        d = self.decay
        self.weight, self.sum_n, self.sum_nn = d * self.weight + 1, d * self.sum_n + n, d * self.sum_nn + n * n
        self.sum_s, self.sum_ns = d * self.sum_s + extra_s, d * self.sum_ns + n * extra_s

    def line(self):
        """(a >= 0, b > 0), or None while the sizes seen spread too little (or the cost falls with n)."""
        w, mean_n = self.weight, self.mean_n
        var_n = self.sum_nn / w - mean_n**2
        if var_n < (self.min_spread * mean_n) ** 2:
            return None
        b = (self.sum_ns / w - mean_n * self.sum_s / w) / var_n
        if b <= 0:
            return None
        a = self.sum_s / w - b * mean_n
        return (a, b) if a >= 0 else (0.0, max(self.sum_s / self.sum_n, 1e-9))  # no fixed part seen

    def predict(self, n):
        line = self.line()
        if line is None:
            return max(self.sum_s / self.sum_n, 0.0) * n
        return line[0] + line[1] * n

    def affordable(self, credit_s, limit):
        """The most tokens (<= limit) whose predicted cost fits in `credit_s`."""
        line = self.line()
        a, b = line if line is not None else (0.0, self.sum_s / self.sum_n)
        if b <= 0:
            return limit if credit_s >= a else 0
        return max(0, min(limit, int((credit_s - a) / b)))


class ChunkSizer:
    """The prompt chunk size of each step under the decode share rule (see the module docstring)."""

    def __init__(self, decode_share, max_step_tokens, min_chunk=16, solo_step_tokens=None):
        if not 0 < decode_share <= 1:
            raise ValueError(f"decode share must be in (0, 1], got {decode_share}")
        self.decode_share, self.max_step_tokens, self.min_chunk = decode_share, max_step_tokens, min_chunk
        self.solo_step_tokens = max(max_step_tokens, solo_step_tokens or 0)  # prompt tokens a step while none decodes
        self.decode_s = None  # seconds of a step that only decodes
        self.cost = ChunkCost()  # extra seconds of a step that also reads a chunk
        self.credit_s = 0.0  # prompt-read time earned by the steps so far, less what chunks spent

    def size(self, num_decode, num_left):
        """Prompt tokens for this step; 0 means decode only and let the credit grow."""
        if num_decode == 0:
            return min(num_left, self.solo_step_tokens)
        full = self.max_step_tokens - num_decode
        if self.decode_s is None:
            return 0  # first a step that only decodes: the time chunks are weighed against
        if not self.cost.known:
            return min(num_left, full, self.min_chunk)  # a first chunk to measure its cost
        n = min(num_left, max(self.target(full), self.cost.affordable(self.credit_s, full)))
        return n if self.cost.predict(n) <= self.credit_s else 0

    def target(self, full):
        """The smallest chunk reading at >= CHUNK_EFFICIENCY of a `full` chunk's speed n / cost(n)."""
        line = self.cost.line()
        if line is None:  # try twice the sizes seen: the cost of a larger chunk tells the fixed part apart
            return min(full, max(self.min_chunk, 2 * math.ceil(self.cost.mean_n)))
        a, b = line
        n = CHUNK_EFFICIENCY * full * a / (a + (1 - CHUNK_EFFICIENCY) * b * full)
        return min(full, max(self.min_chunk, math.ceil(n)))

    def record(self, num_decode, num_prompt, prompt_waiting, elapsed_s):
        if not num_decode:
            self.credit_s = 0.0  # nobody decodes: no share to keep
            return
        if not num_prompt:
            self.decode_s = _ema(self.decode_s, elapsed_s, DECODE_ALPHA)
        elif self.decode_s is not None:
            extra_s = elapsed_s - self.decode_s
            self.cost.add(num_prompt, extra_s)
            self.credit_s -= extra_s
        if self.decode_s is not None:
            self.credit_s += self.decode_s * (1 / self.decode_share - 1)
        if not prompt_waiting:
            self.credit_s = min(self.credit_s, 0.0)  # pay back a debt, save nothing


class Scheduler:
    def __init__(self, num_slots, new_sequence, max_context, eos_ids=(), max_queue=64,
                 decode_share=DEFAULT_DECODE_SHARE, max_step_tokens=DEFAULT_STEP_TOKENS, clock=time.perf_counter,
                 restore_prefix=None, park=None, draft=None, solo_step_tokens=None):
        """restore_prefix(prompt_ids, kv) -> tokens restored: fills a new slot's KV from parked conversations.
        solo_step_tokens: prompt tokens a step may read while no slot decodes (None: max_step_tokens; see the module
        docstring).

        park(token_ids, kv, finish_reason): keeps the KV of an ending request's computed positions (token_ids).
        draft(slot, limit, num_slots, step_times) -> at most `limit` draft tokens to score after the slot's last
        token (speculation), for a step of num_slots decoding slots; step_times: the decode steps' times by size.
        """
        if num_slots < 1:
            raise ValueError(f"the number of slots must be >= 1, got {num_slots}")
        if max_step_tokens <= num_slots:
            raise ValueError(f"the step budget ({max_step_tokens} tokens) must exceed the slots ({num_slots})")
        self.slots = [Slot(i, new_sequence()) for i in range(num_slots)]
        self.queue = deque()
        self.max_queue, self.max_context = max_queue, max_context
        self.eos_ids = frozenset(eos_ids)
        self.sizer = ChunkSizer(decode_share, max_step_tokens, solo_step_tokens=solo_step_tokens)
        self.clock = clock
        self.restore_prefix, self.park, self.draft = restore_prefix, park, draft
        self.step_times = StepTimes()
        self._admissions = 0

    def add(self, request):
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"{len(self.queue)} requests are waiting (the limit is {self.max_queue})")
        self.queue.append(request)

    def has_work(self):
        return bool(self.queue) or any(s.state is not SlotState.IDLE for s in self.slots)

    def schedule(self):
        cancelled = self._drop_cancelled()
        self._admit()
        decoding = [s for s in self.slots if s.state is SlotState.DECODE]
        chunks = [self._decode_chunk(s, len(decoding)) for s in decoding]
        step = Step(chunks, cancelled, num_decode=len(chunks), num_draft=sum(len(c.slot.drafts) for c in chunks))
        reading = sorted((s for s in self.slots if s.state is SlotState.PREFILL), key=lambda s: s.admitted)
        if reading:
            n = self.sizer.size(step.num_decode + step.num_draft, sum(s.num_prompt_left for s in reading))
            step.prompt_waiting, step.num_prompt = True, n
            for slot in reading:
                take = min(n, slot.num_prompt_left)
                if take == 0:
                    break
                ids = slot.request.prompt_ids[slot.num_cached : slot.num_cached + take]
                last = take == slot.num_prompt_left
                chunks.append(ScheduledChunk(slot, ids, slot.num_cached, "last" if last else "none"))
                n -= take
        return step

    def _decode_chunk(self, slot, num_slots):
        """The slot's output tokens not yet cached (its last one; more after a rollback that kept less than asked,
        a recurrent state's), then, when that is one token, the drafts that fit its max_tokens and the context."""
        unread = slot.output_ids[slot.num_cached - len(slot.request.prompt_ids):]
        slot.drafts = []
        if self.draft is not None and len(unread) == 1:
            limit = min(slot.request.params.max_tokens - len(slot.output_ids), self.max_context - slot.num_cached) - 1
            slot.drafts = list(self.draft(slot, limit, num_slots, self.step_times)) if limit > 0 else []
        return ScheduledChunk(slot, unread + slot.drafts, slot.num_cached, "all" if slot.drafts else "last")

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
                self._admissions += 1
                slot.admitted = self._admissions
                if self.restore_prefix is not None:
                    slot.num_cached = slot.cache_n = self.restore_prefix(slot.request.prompt_ids, slot.kv)

    def record(self, step, elapsed_s):
        """Feed the measured time of `step` to the chunk sizer (and of a decode-only step to the step times)."""
        self.sizer.record(step.num_decode, step.num_prompt, step.prompt_waiting, elapsed_s)
        if step.num_decode and not step.num_prompt:
            self.step_times.add(step.num_decode + step.num_draft, elapsed_s)

    def advance(self, chunk):
        """After the forward pass of `chunk`: its tokens are cached; a finished prompt turns to DECODE."""
        slot = chunk.slot
        slot.num_cached += len(chunk.token_ids)
        if slot.state is SlotState.PREFILL and slot.num_prompt_left == 0:
            slot.state, slot.prompt_finished = SlotState.DECODE, self.clock()

    def rollback(self, slot, num_cached):
        """After a verification step: keep the slot's first num_cached positions (the rejected drafts' go); a
        recurrent state may keep fewer (the next decode chunk reads the rest again). Returns the number kept."""
        slot.num_cached = slot.kv.rollback(num_cached)
        return slot.num_cached

    def append_token(self, slot, token_id, position=None):
        """Append a sampled token; returns the finish reason when it ends the request, else None. position: where
        the token goes (default: the slot's cached positions), as plain decoding has it."""
        slot.output_ids.append(token_id)
        return end_reason(token_id, len(slot.output_ids), slot.num_cached if position is None else position,
                          slot.request.params, self.eos_ids, self.max_context)

    def finish(self, slot, reason):
        slot.state, slot.finish_reason = SlotState.DONE, reason

    def release(self, slot, keep_kv=True):
        """Free the slot, first parking the KV it computed unless `keep_kv` is False (the KV may be invalid).

        A cancelled or failed request parks too: its prompt prefix read so far is not read again on a retry.
        """
        if keep_kv and self.park is not None and slot.num_cached:
            computed = (list(slot.request.prompt_ids) + slot.output_ids)[: slot.num_cached]
            self.park(computed, slot.kv, slot.finish_reason)
        slot.state, slot.request = SlotState.IDLE, None
