"""The engine: one loop thread owns the model and every slot; other threads only submit and read.

`Engine.step()` = schedule -> model.forward(Batch) -> sample per slot -> postprocess.
"""
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cpu_kernels.target import use_chosen_threads

from .batch import Batch, SeqChunk
from .errors import RequestError
from .expert_usage import ExpertUsage
from .grammar import GrammarError, GrammarVocab, allowed
from .model import solo_chunk_tokens
from .request import Delta, Failed, Finished, RequestHandle, StopFilter, check_prompt, timings
from .sampling import Sampler, token_logprob
from .scheduler import DEFAULT_DECODE_SHARE, DEFAULT_STEP_TOKENS, Scheduler
from .speculative.acceptance import verify
from .speculative.mtp import MtpDrafter, MtpHead
from .speculative.slot import SlotSpeculation
from .tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """Engine-thread state of one admitted request."""

    handle: RequestHandle
    sampler: Sampler
    decoder: IncrementalDecoder
    stops: StopFilter
    matcher: object = None  # grammar.Matcher of a constrained request
    logprobs: list = None  # the TokenLogprobs so far, when the request asks for them
    spec: SlotSpeculation = None  # the request's drafter, when it drafts
    text: str = ""


def _weak(method):
    """A callback to the bound `method` that does not keep its object alive: the scheduler belongs to the engine, so
    a plain bound method would make the two a cycle, and a dropped engine's slots would hold their KV blocks until
    the cyclic garbage collector ran."""
    ref = weakref.WeakMethod(method)
    return lambda *args: ref()(*args)

class EngineStats:
    """Counters and recent rates, read by the server's /metrics and /slots."""

    def __init__(self):
        self.requests = {}  # finish reason ("stop", "length", "cancelled", "error") -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prompt_per_second = 0.0  # prompt tokens per second of the last step that read a prompt
        self.decode_per_second = 0.0  # decoded tokens per second of the last step that decoded
        self.draft_n = 0  # draft tokens scored
        self.draft_n_accepted = 0  # ... and kept

    def count(self, reason):
        self.requests[reason] = self.requests.get(reason, 0) + 1

    def record_step(self, step, elapsed_s):
        if step.num_prompt:
            self.prompt_per_second = step.num_prompt / elapsed_s
        if step.num_decode:
            self.decode_per_second = (step.num_decode + step.num_accepted) / elapsed_s
        self.draft_n += step.num_draft
        self.draft_n_accepted += step.num_accepted
        self.prompt_tokens += step.num_prompt


class Engine:
    """`llm`: a `hybrid.LLM` (or anything with `.model`, `.tokenizer`, `.max_context`).

    speculation: a `hybrid.speculative.SpecSettings` (None: off). Requests without a grammar then draft
    tokens (n-gram lookup over their own text, or with speculation.mtp the model's MTP / NextN layer,
    speculative/mtp.py) that each step scores with the slot's next token; requests with
    a grammar never draft (their masks would have to follow every draft)."""

    def __init__(self, llm, num_slots=1, max_queue=64, decode_share=DEFAULT_DECODE_SHARE,
                 max_step_tokens=DEFAULT_STEP_TOKENS, conversation_cache=None, clock=time.perf_counter,
                 speculation=None):
        self.model, self.tokenizer, self.max_context = llm.model, llm.tokenizer, llm.max_context
        self.conversations = conversation_cache
        self.clock = clock
        self.usage = llm.model.usage = ExpertUsage.for_config(llm.model.config)  # always on while serving
        self.scheduler = Scheduler(num_slots, lambda: self.model.new_sequence(self.max_context), self.max_context,
                                   eos_ids=self.tokenizer.eos_ids, max_queue=max_queue, decode_share=decode_share,
                                   max_step_tokens=max_step_tokens, clock=clock,
                                   restore_prefix=conversation_cache.restore if conversation_cache else None,
                                   park=_weak(self._park) if conversation_cache else None, draft=_weak(self._draft),
                                   solo_step_tokens=solo_chunk_tokens(self.model))
        self.speculation = speculation if speculation is not None and speculation.enabled and all(
            s.kv.supports_rollback for s in self.scheduler.slots) else None
        self.mtp = MtpHead.of(self.model) if self.speculation is not None and self.speculation.mtp else None
        self.grammar = GrammarVocab.of(self.tokenizer, self.model.config.vocab_size)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        self.stats = EngineStats()
        self._live = {}  # request_id -> _Live
        self._lock = threading.Condition()
        self._last_end = None  # when the last step ended, while steps run back to back
        self._thread = None
        self._stopping = False

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        self._mask_pool.shutdown()

    def submit(self, request):
        """Queue `request`; raises RequestError (bad prompt or parameters; GrammarError: a grammar that does
        not compile against the vocabulary) or QueueFull. The grammar compiles here, on the caller's thread."""
        request.check()
        check_prompt(request.prompt_ids, self.max_context, self.model.config.vocab_size)
        handle = RequestHandle(request)
        matcher = self.grammar.matcher(request.constraint) if request.constraint is not None else None
        live = _Live(handle, Sampler(request.params), IncrementalDecoder(self.tokenizer),
                     StopFilter(request.params.stop), matcher, [] if request.logprobs else None)
        if self.speculation is not None and matcher is None:
            drafter = MtpDrafter(self.mtp, self.max_context) if self.mtp is not None else None
            live.spec = SlotSpeculation(self.speculation, request.prompt_ids, drafter)
        with self._lock:
            self.scheduler.add(request)
            self._live[request.request_id] = live
            self._lock.notify_all()
        return handle

    def cancel(self, request_id):
        """Cancel a queued or running request; its slot is freed at the next step."""
        with self._lock:
            live = self._live.get(request_id)
            if live is not None:
                live.handle.request.cancelled = True
                self._lock.notify_all()

    def snapshot(self):
        """Slot states and queue length, consistent between steps."""
        with self._lock:
            slots = [{"id": s.index, "state": s.state.value,
                      "request_id": s.request.request_id if s.request else None,
                      "prompt_n": len(s.request.prompt_ids) if s.request else 0,
                      "num_cached": s.num_cached if s.request else 0,
                      "predicted_n": len(s.output_ids) if s.request else 0}
                     for s in self.scheduler.slots]
            return {"slots": slots, "queue_length": len(self.scheduler.queue)}

    def _loop(self):
        use_chosen_threads()  # Numba's thread count is per thread: this one starts at every core
        while True:
            with self._lock:
                while not self._stopping and not self.scheduler.has_work():
                    self._last_end = None  # idle: the wait is nobody's step time
                    self._lock.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug outside any one request: log it and keep serving
                log.exception("engine step failed")
                time.sleep(0.1)

    def step(self):
        """One batched forward step; returns False when there was nothing to run.

        The decode share rule is fed the time of the whole step (scheduling and sampling too) and, when
        steps run back to back, the gap since the last one ended (lock hand-overs to the HTTP threads):
        that is what the decoding slots wait for between two tokens, not only the forward pass.
        The grammar masks of the constrained slots are computed in a worker thread while the model runs.
        """
        t0 = self.clock()
        start = t0 if self._last_end is None else self._last_end
        with self._lock:
            step = self.scheduler.schedule()
            for request in step.cancelled:
                self._end(request.request_id, None, "cancelled")
            masks = self._start_masks(step.chunks)
        if not step.chunks:
            self._last_end = None
            return False
        logits = self._forward(step.chunks)
        with self._lock:
            self._postprocess(step, logits, masks)
            self._last_end = self.clock()
            elapsed = self._last_end - start
            self.scheduler.record(step, elapsed)
            self.stats.record_step(step, elapsed)
        return True

    def _forward(self, chunks):
        """Logits per chunk (None for a chunk that asks none or that failed alone)."""
        try:
            return self._run(chunks)
        except Exception as exc:
            if len(chunks) == 1:
                if isinstance(exc, RequestError):  # this request's own limit (e.g. the KV budget): no trace
                    log.warning("request %s failed: %s", chunks[0].slot.request.request_id, exc)
                else:
                    log.exception("request %s failed in the forward pass", chunks[0].slot.request.request_id)
                return [_Failed(exc)]
            return [self._forward([c])[0] for c in chunks]  # find the failing request: one chunk at a time

    def _run(self, chunks):
        """Per chunk: its logits row [V] ("last"), rows [n, V] ("all") or None.

        A decode chunk with drafts goes into the batch as one-token chunks of its sequence at consecutive
        positions (each attends the rows the ones before it wrote): a batch of one-token chunks takes the
        backends' decode paths (the CPU's compiled layers), where a short chunk would take the prompt path. A
        sequence with a recurrent state reads it as one chunk (its state keeps a snapshot at a chunk's start).
        A chunk whose drafter reads hidden rows (MTP) gets them in `c.hidden` [n, H]."""
        seq_chunks = []
        for c in chunks:
            hidden = self._needs_hidden(c)
            if c.logits == "all" and c.slot.kv.recurrent is None:
                seq_chunks += [SeqChunk(c.slot.kv, c.start + i, np.asarray([t], dtype=np.int64), hidden=hidden)
                               for i, t in enumerate(c.token_ids)]
            else:
                seq_chunks.append(SeqChunk(c.slot.kv, c.start, np.asarray(c.token_ids, dtype=np.int64), c.logits,
                                           hidden))
        batch = Batch(seq_chunks)
        logits, out, at, at_hidden = self.model.forward(batch), [], 0, 0  # [T_out, V]
        for c in chunks:
            n = {"last": 1, "all": len(c.token_ids)}.get(c.logits, 0)
            out.append(logits[at] if c.logits == "last" else logits[at:at + n] if n else None)
            at += n
            if self._needs_hidden(c):
                c.hidden = batch.hidden[at_hidden:at_hidden + len(c.token_ids)]  # [n, H]
                at_hidden += len(c.token_ids)
        return out

    def _needs_hidden(self, chunk):
        """Whether the chunk's request drafts from hidden rows (an MTP drafter)."""
        live = self._live.get(chunk.slot.request.request_id)
        return live is not None and live.spec is not None and live.spec.needs_hidden

    def _draft(self, slot, limit, num_slots, step_times):
        """Scheduler callback: the slot's draft tokens for this step (none when its request does not draft)."""
        live = self._live.get(slot.request.request_id)
        return live.spec.draft(limit, num_slots, step_times) if live is not None and live.spec is not None else []

    def _start_masks(self, chunks):
        """The next-token masks of the constrained slots sampled this step, as a `_StepMasks` being filled."""
        matchers = {}
        for chunk in chunks:
            live = self._live[chunk.slot.request.request_id]
            if chunk.logits == "last" and live.matcher is not None:
                matchers[chunk.slot.request.request_id] = live.matcher
        if not matchers:
            return None
        return _StepMasks(list(matchers), self._mask_pool.submit(self.grammar.fill_masks, list(matchers.values())))

    def _postprocess(self, step, logits, masks=None):
        for chunk, row in zip(step.chunks, logits):
            slot = chunk.slot
            if isinstance(row, _Failed):  # a model or device error: the KV of this slot may be invalid, not parked
                message = str(row.error) if isinstance(row.error, RequestError) else \
                    "the forward pass failed for this request"
                self._fail(slot, message, keep_kv=False)
                continue
            try:
                self.scheduler.advance(chunk)
                if chunk.hidden is not None:
                    self._live[slot.request.request_id].spec.add_hidden(chunk.start, chunk.hidden)
                if chunk.logits == "all":
                    step.num_accepted += self._verify(slot, chunk, row)
                elif row is not None:
                    self._sample(slot, row, masks)
            except GrammarError as exc:  # the request's own grammar: its message is the client's to read
                log.warning("request %s failed: %s", slot.request.request_id, exc)
                self._fail(slot, str(exc))
            except Exception:  # the log has the trace; the client gets no internals (file paths among them)
                log.exception("request %s failed", slot.request.request_id)
                self._fail(slot, "sampling or decoding the next token failed")

    def _sample(self, slot, row, masks):
        """Sample the slot's next token from its logits row [V] (masked by its grammar), then emit it."""
        request = slot.request
        live = self._live[request.request_id]
        mask = masks.allowed(request.request_id, live.matcher, row.size) if live.matcher is not None else None
        row = live.sampler.adjusted(row, mask)  # [V]
        token_id = live.sampler.draw(row)
        logprob = token_logprob(row, token_id, request.top_logprobs) if live.logprobs is not None else None
        if live.matcher is not None and not live.matcher.consume(token_id):
            raise GrammarError(f"the grammar refused token {token_id}: {live.matcher.error}")
        self._emit(slot, token_id, logprob, live.matcher is not None and live.matcher.done)

    def _verify(self, slot, chunk, rows):
        """Keep the slot's accepted drafts and one more token from its verification rows [1 + k, V], roll the
        KV back past them, emit them; returns the number of drafts kept."""
        request, drafts = slot.request, slot.drafts
        live = self._live[request.request_id]
        tokens, adjusted = verify(live.sampler, rows[len(rows) - len(drafts) - 1:], drafts)
        num_accepted = len(tokens) - 1
        live.spec.record(len(drafts), num_accepted)
        last = chunk.start + len(chunk.token_ids) - len(drafts) - 1  # the position of the slot's last token
        self.scheduler.rollback(slot, last + len(tokens))
        for i, (token_id, row) in enumerate(zip(tokens, adjusted)):
            logprob = token_logprob(row, token_id, request.top_logprobs) if live.logprobs is not None else None
            if self._emit(slot, token_id, logprob, position=last + i + 1):
                break
        return num_accepted

    def _emit(self, slot, token_id, logprob=None, grammar_done=False, position=None):
        """Append a sampled token and push its text; a complete grammar ends the request as an end token does.
        position: where the token goes (a verification step's tokens: after the ones before it). Returns True
        when the token ended the request."""
        live = self._live[slot.request.request_id]
        if live.spec is not None:
            live.spec.extend([token_id])
        reason = self.scheduler.append_token(slot, token_id, position)
        self.stats.generated_tokens += 1
        is_eos = reason == "stop"
        if grammar_done and reason is None:
            reason = "stop"
        text, hit_stop = live.stops.push("" if is_eos else live.decoder.push(token_id))
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            text += live.stops.flush()
        live.text += text
        logprobs = None
        if logprob is not None and not is_eos:
            live.logprobs.append(logprob)
            logprobs = [logprob]
        if text or not is_eos:
            live.handle.events.put(Delta(text, [token_id], logprobs))
        if reason is not None:
            self.scheduler.finish(slot, reason)
            self._end(slot.request.request_id, slot, reason)
            self.scheduler.release(slot)
        return reason is not None

    def _fail(self, slot, message, keep_kv=True):
        self.scheduler.finish(slot, "error")
        self._end(slot.request.request_id, None, "error", message)
        self.scheduler.release(slot, keep_kv)

    def _park(self, token_ids, kv, finish_reason):
        """Scheduler callback: a finished conversation is parked whole, one that ended early in whole blocks."""
        self.conversations.park(token_ids, kv, whole_blocks=finish_reason not in ("stop", "length"))

    def _end(self, request_id, slot, reason, message=None):
        """Push the final event of a request and forget it; `slot` is None when it did not finish normally."""
        live = self._live.pop(request_id)
        self.stats.count(reason)
        if reason == "error":
            live.handle.events.put(Failed(message))
            return
        if slot is None:
            live.handle.events.put(Finished(reason, live.text, [], len(live.handle.request.prompt_ids), {},
                                            live.logprobs))
            return
        now = self.clock()
        t = timings(len(slot.request.prompt_ids) - slot.cache_n, slot.prompt_finished - slot.prompt_started,
                    len(slot.output_ids), now - slot.prompt_finished, cache_n=slot.cache_n)
        if live.spec is not None:
            t.update(draft_n=live.spec.draft_n, draft_n_accepted=live.spec.draft_n_accepted)
        log.info("request %s done (%s): prompt %d tokens read in %.0f ms (%.1f tok/s), %d restored, %d tokens in "
                 "%.0f ms (%.1f tok/s), queued %.0f ms", request_id, reason, t["prompt_n"], t["prompt_ms"],
                 t["prompt_per_second"], t["cache_n"],
                 t["predicted_n"], t["predicted_ms"], t["predicted_per_second"],
                 (slot.prompt_started - slot.request.created) * 1e3)
        live.handle.events.put(Finished(reason, live.text, list(slot.output_ids), len(slot.request.prompt_ids), t,
                                        live.logprobs))


@dataclass
class _Failed:
    """Stands for the logits of a chunk whose forward pass failed."""

    error: Exception


class _StepMasks:
    """The grammar masks of one step's constrained requests, being filled in the engine's mask thread."""

    def __init__(self, request_ids, future):
        self.rows = {rid: i for i, rid in enumerate(request_ids)}
        self.future = future

    def allowed(self, request_id, matcher, vocab_size):
        """bool [vocab_size]: the tokens the request's grammar allows next; GrammarError when it allows none."""
        try:
            masks = self.future.result()
        except Exception as exc:
            log.exception("computing the grammar masks failed")
            raise GrammarError("computing the grammar's allowed tokens failed") from exc
        if matcher.error:  # e.g. a step past llguidance's work limits
            raise GrammarError(f"the grammar failed: {matcher.error}")
        mask = allowed(masks[self.rows[request_id]], vocab_size)
        if not mask.any():
            raise GrammarError("the grammar allows no next token")
        return mask
