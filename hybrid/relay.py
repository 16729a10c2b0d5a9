"""The decode relay: a decode token's host experts handed over through host memory the device reads
and writes, so the calling thread never waits on the device inside a step.

Without it, each hybrid layer of a decode step makes the calling thread wait for the routing to come
back, run the host experts, then queue the add of their rows: fixed host work in series with the host
experts (bench/results/gpu_model.md). With it, per hybrid layer the calling thread only queues: the
device posts the layer's routing and row to the `Mailbox` (a kernel writes them into mapped pinned
memory, then the layer's flag), a `HostRelay` worker thread waiting on that flag (compiled, GIL
released) runs the non-resident pairs and posts their sum, and a device kernel queued behind the
resident experts waits for that flag and adds the rows. The calling thread runs ahead through the
step's layers meanwhile and waits once, for the logits. Flags carry the step's number, which only grows (cpu_kernels/mailbox.py).

Both sides give up after `timeout_s` (the device writes what it gave up on into `error`) and the step
fails with an error that names the layer; the engine goes on with the next request.
Shape legend: L layers, K top-k, H hidden, T the most tokens of a relayed step, n its tokens.
"""
import queue
import threading
from dataclasses import dataclass

import numba
import numpy as np

from cpu_kernels.mailbox import WAIT_ABORTED, WAIT_OK, WAIT_TIMED_OUT, new_flags, post, ticks
from cpu_kernels.sync import LINE
from cpu_kernels.target import chosen_threads

RELAY_TIMEOUT_S = 30.0  # longest wait on either side: a token's host experts take milliseconds
WAIT_FAILED = 3  # the host experts raised (the worker's own status, beside cpu_kernels.mailbox's)
_REASONS = {WAIT_ABORTED: "were stopped (the step was abandoned)",
            WAIT_TIMED_OUT: "never got the routing from the device", WAIT_FAILED: "failed"}


@dataclass
class Mailbox:
    """Host memory both sides use (pinned and mapped into the device where the device is a GPU). A layer's slot
    holds one step's n <= max_tokens decode tokens: ids [n, K], weights [n, K] and rows x [n, H] one after
    another (n = 1: ids [K], weights [K], x [H]), and their host rows [n, H]."""

    inbox: np.ndarray  # f32 [L, T * (2K + H)]: per layer ids [n, K] (int32 bits), weights [n, K], x [n, H]
    outbox: np.ndarray  # f32 [L, T * H]: per layer the host pairs' sums [n, H]; host-written
    flags_in: np.ndarray  # int64 [L * LINE]: the step number whose routing inbox[l] holds
    flags_out: np.ndarray  # int64 [L * LINE]: the step number whose rows outbox[l] holds
    abort: np.ndarray  # int64 [LINE]: nonzero stops the host's waits
    error: np.ndarray  # int64 [LINE]: (step number, layer) of a device wait that gave up; 0 while none did
    times: np.ndarray  # int64 [L, 2]: the device clock (ns) when layer l's routing was posted / its rows added
    top_k: int = 1
    max_tokens: int = 1  # T: the most tokens a step's slot holds
    addresses: dict = None  # the arrays' device addresses by name, where the device is a GPU

    @classmethod
    def allocate(cls, num_layers, top_k, hidden, empty=np.empty, max_tokens=1):
        """A zeroed mailbox for steps of up to max_tokens tokens; `empty(shape, dtype)` allocates each array
        (pinned memory for a GPU)."""
        def zeros(shape, dtype):
            array = empty(shape, dtype)
            array[...] = 0
            return array

        return cls(zeros((num_layers, max_tokens * (2 * top_k + hidden)), np.float32),
                   zeros((num_layers, max_tokens * hidden), np.float32),
                   new_flags(num_layers, empty), new_flags(num_layers, empty), new_flags(1, empty),
                   new_flags(1, empty), zeros((num_layers, 2), np.int64), top_k=top_k, max_tokens=max_tokens)

    @property
    def hidden(self):
        return self.outbox.shape[1] // self.max_tokens

    def fits(self, num_layers, top_k, hidden, max_tokens=1):
        """Whether this mailbox serves these layers and shapes, for steps of up to max_tokens tokens."""
        return (self.inbox.shape[0], self.top_k, self.hidden) == (num_layers, top_k, hidden) \
            and self.max_tokens >= max_tokens

    def routing_ids(self, layer_index, num_tokens=1):
        """int64 [n, K]: the ids layer_index's routing of an n-token step posted."""
        k = self.top_k
        return self.inbox[layer_index, :num_tokens * k].view(np.int32).astype(np.int64).reshape(num_tokens, k)

    def device_error(self):
        """(step number, layer) of a device wait that gave up, or None."""
        return None if self.error[0] == 0 else (int(self.error[0]), int(self.error[1]))

    def clear_error(self):
        self.error[:2] = 0


@dataclass
class RelayResult:
    layer: int
    status: int  # WAIT_OK, WAIT_ABORTED, WAIT_TIMED_OUT or WAIT_FAILED
    pairs: int  # pairs the host ran
    seen: int  # time-stamp counter ticks when the routing was seen
    posted: int  # ... when the rows were posted
    error: BaseException = None
    entered: int = 0  # ... when the worker began to wait for the routing (== seen: it came before the worker)

    def problem(self):
        """None, or why this layer's host part gave no rows."""
        if self.status == WAIT_OK:
            return None
        reason = _REASONS.get(self.status, f"ended with status {self.status}")
        return f"layer {self.layer}: the host experts {reason}" + (f": {self.error!r}" if self.error else "")


class HostRelay:
    """The host worker: one job a hybrid layer of a decode step, run in submission order in its thread.

    host: the CPU backend (relay_decode_experts). A job that cannot give rows (its wait ended, the host
    experts raised) still posts zero rows, so the device goes on and the step fails at collect()."""

    def __init__(self, host, mailbox, timeout_s=RELAY_TIMEOUT_S, threads=None):
        self.host, self.mailbox, self.timeout_s = host, mailbox, timeout_s
        self.threads = threads  # Numba threads of the worker's experts, read at each job; None: set_threads' choice
        self.limit_ticks = ticks(timeout_s)
        self._jobs = queue.SimpleQueue()
        self._answered = threading.Condition()
        self._results = []  # RelayResult of the jobs answered since the last collect
        self.outstanding = 0  # jobs submitted since the last collect
        self._thread = threading.Thread(target=self._serve, name="host-relay", daemon=True)
        self._thread.start()

    def submit(self, layer, seq, resident, num_tokens=1):
        """Queue layer's host part of step `seq` (num_tokens decode tokens); resident: bool [E], the experts the
        device runs."""
        self.outstanding += 1
        self._jobs.put((layer, seq, resident, num_tokens))

    def wait_idle(self):
        """Wait until every job submitted so far is answered (the worker runs no compiled code after)."""
        with self._answered:
            if not self._answered.wait_for(lambda: len(self._results) >= self.outstanding, self.timeout_s + 5.0):
                self.mailbox.abort[0] = 1
                raise RuntimeError(f"decode relay: the host worker gave no answer in {self.timeout_s + 5:.0f} s")

    def collect(self):
        """The results of every job submitted since the last collect, in order. A worker that does not
        answer within the timeout (plus a margin) is stopped and RuntimeError raised."""
        self.wait_idle()
        with self._answered:
            results, self._results = self._results, []
        self.outstanding = 0
        self.mailbox.abort[0] = 0
        return results

    def abandon(self):
        """Stop the waits of a step that will not finish (its layers' routing may never be posted)."""
        if self.outstanding:
            self.mailbox.abort[0] = 1
            try:
                self.collect()
            finally:
                self.mailbox.abort[0] = 0

    def close(self, timeout_s=5.0):
        """Stop the worker and wait for it (at most timeout_s): a wait of its in progress ends at once (abort),
        jobs still queued post zero rows."""
        self.mailbox.abort[0] = 1
        self._jobs.put(None)
        self._thread.join(timeout_s)

    @property
    def alive(self):
        return self._thread.is_alive()

    def _serve(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            layer, seq, resident, num_tokens = job
            try:
                threads = min(self.threads or chosen_threads(), numba.config.NUMBA_NUM_THREADS)
                if threads != numba.get_num_threads():
                    numba.set_num_threads(threads)
                status, pairs, entered, seen, posted = self.host.relay_decode_experts(
                    layer, self.mailbox, seq, resident, self.limit_ticks, num_tokens)
                error = None
            except Exception as exc:  # any failure of the host part: the step fails, the worker goes on
                status, pairs, entered, seen, posted, error = WAIT_FAILED, 0, 0, 0, 0, exc
            if status != WAIT_OK:  # zero rows, so a device wait ends now rather than at its timeout
                self.mailbox.outbox[layer.index] = 0.0
                post(self.mailbox.flags_out, layer.index * LINE, seq)
            with self._answered:
                self._results.append(RelayResult(layer.index, int(status), int(pairs), int(seen), int(posted), error,
                                                 int(entered)))
                if len(self._results) >= self.outstanding:  # what wait_idle waits for: a wake-up per layer would
                    self._answered.notify_all()  # take a core from the next layer's experts for nothing
