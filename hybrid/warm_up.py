"""LLM.warm_up: the steps a request can take, run on scratch sequences before the first request.

Numba compiles a kernel at its first call, for the argument types of that call, and the CPU backend
picks a serial or a parallel kernel by the size of each op; a prompt of ~20+ tokens that arrived
first used to stall its step for seconds while the parallel variants compiled. The steps here take
every variant a request can reach: a short prompt chunk (the serial kernels), a decode step (the
compiled decode layer), a long prompt chunk (the parallel kernels), a decode step batched with a
prompt chunk and one of two sequences. On a warm start they load from Numba's cache instead.
"""
import logging
import time
from contextlib import contextmanager

import numpy as np
from numba.core import event
from tqdm import tqdm

from .batch import Batch, SeqChunk
from .errors import ModelError

log = logging.getLogger(__name__)

SHORT_CHUNK = 2  # tokens of the short prompt chunk: every op small enough for its serial kernel
FALLBACK_LONG_CHUNK = 32  # the long chunk's tokens on a backend that does not say what makes its ops parallel


class _CompileWatch(event.Listener):
    """Names the kernel Numba is compiling in the bar's postfix and counts the compilations. Given no bar, it
    opens one at the first compilation, `what` its description (compile_notice closes it)."""

    def __init__(self, bar, what=None):
        self.bar, self.what, self.depth, self.compiled = bar, what, 0, 0

    def on_start(self, ev):
        if self.bar is None:
            self.bar = tqdm(desc=self.what, bar_format="{desc}: {elapsed}{postfix}", leave=False)
        if self.depth == 0:
            fn = ev.data["dispatcher"].py_func
            self.bar.set_postfix_str(f"compiling {fn.__module__}.{fn.__qualname__}", refresh=True)
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        if self.depth == 0:
            self.compiled += 1
            self.bar.set_postfix_str("", refresh=False)


@contextmanager
def compile_notice(what):
    """A bar on stderr, opened only if Numba compiles inside the block: `what` is being done, the time spent so
    far and the kernel being compiled (the start-up steps before warm-up that compile on a first run)."""
    watch = _CompileWatch(None, what)
    try:
        with event.install_listener("numba:compile", watch):
            yield
    finally:
        if watch.bar is not None:
            watch.bar.close()
            log.info("%s: %d kernels compiled", what, watch.compiled)


def warm_chat_template(tokenizer):
    """Render a one-message chat once: Jinja compiles the template at its first use (14 ms for the demo's,
    the largest part left of a first chat request's extra time after the kernels). A template that refuses
    the message is left to say why to the requests."""
    if tokenizer.chat_template is None:
        return
    try:
        tokenizer.encode_chat([{"role": "user", "content": "warm-up"}])
    except ModelError as exc:
        log.debug("chat template not warmed up: %s", exc)


def long_chunk_tokens(backend, config, max_step_tokens, max_context):
    """Tokens of the long prompt chunk: the fewest with which every op of a step runs its parallel kernel
    (backend.parallel_min_tokens where it has one), within a step's budget and half the context."""
    wanted = backend.parallel_min_tokens(config) if backend.capabilities.parallel_min_tokens else FALLBACK_LONG_CHUNK
    return max(SHORT_CHUNK + 1, min(wanted, max_step_tokens, max_context // 2))


def _steps(model, long_tokens):
    """[(what, weight, run)]: the warm-up's forward steps in order, over two scratch sequences; weight: the
    step's share (%) of a cold warm-up, for the bar's estimate (the demo and Q4_K_M models on 2 cores:
    bench/results/startup.md)."""
    ids = lambda n: np.arange(n, dtype=np.int64) % model.config.vocab_size  # noqa: E731
    short = model.new_sequence(SHORT_CHUNK + 4)
    long = model.new_sequence(long_tokens + 4)

    def step(*chunks):
        return lambda: model.forward(Batch([SeqChunk(kv, kv.length, ids(n), logits) for kv, n, logits in chunks]))

    return [
        (f"a {SHORT_CHUNK}-token prompt chunk", 40, step((short, SHORT_CHUNK, "none"))),
        ("a decode step", 45, step((short, 1, "last"))),
        (f"a {long_tokens}-token prompt chunk", 13, step((long, long_tokens, "last"))),
        ("a decode step beside a prompt chunk", 1, step((short, 1, "last"), (long, SHORT_CHUNK, "last"))),
        ("a decode step of two sequences", 1, step((short, 1, "last"), (long, 1, "last"))),
    ]


def warm_up(model, long_tokens, progress=True):
    """Run _steps on `model` with its usage profile and dynamic expert cache detached (they do not see
    the warm-up); a tqdm bar on stderr (unless progress is False) names each step and the kernel being
    compiled. Returns the seconds it took."""
    start = time.perf_counter()
    usage, residency = model.usage, model.residency
    model.usage = model.residency = None
    try:
        steps = _steps(model, long_tokens)
        with tqdm(total=sum(weight for _, weight, _ in steps), desc="warming up the kernels", disable=not progress,
                  leave=False, bar_format="{l_bar}{bar}| {elapsed}<{remaining}{postfix}") as bar:
            watch = _CompileWatch(bar)
            with event.install_listener("numba:compile", watch):
                for what, weight, run in steps:
                    bar.set_description(f"warming up the kernels: {what}")
                    run()
                    bar.update(weight)
    finally:
        model.usage, model.residency = usage, residency
    log.info("warm-up: %d kernels compiled, the others loaded from Numba's cache", watch.compiled)
    return time.perf_counter() - start
