"""Threads of one parallel region meeting between stages: atomic counters and a spin-wait.

A compiled decode layer at many threads opens one parallel region and runs its ops as stages
inside it (hybrid/backends/cpu_decode_fused.py), where each op would otherwise open a region of its
own, which costs a few times one of these meetings at many threads (bench/results/vs_llamacpp_h200.md).
Each of the region's W workers (its iterations) owns a contiguous share of a stage's items, as a static
schedule would give it, so its rows stream on; it claims them from its own counter, then claims what the
other workers have left. Each adds
what it finished to the stage's done count and waits until every item is done. Waiting on items
rather than on workers keeps this deadlock-free however the iterations map to threads: an item
claimed is an item some running thread finishes.

Counters: int64 [stages, W + 1, LINE] (new_counters), zero at the start: per stage each worker's
claim count, then the done count, each on its own cache line.
"""
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

LINE = 8  # int64s a cache line holds: one counter each


@intrinsic
def atomic_add(typingctx, array, index, value):
    """array[index] += value atomically (int64, sequentially consistent); returns the old value."""
    sig = types.int64(array, index, value)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, array, index):
    """array[index] read with acquire ordering (int64)."""
    sig = types.int64(array, index)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "acquire", 8)

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The x86 spin-wait hint."""
    def codegen(context, builder, signature, args):
        fn = builder.module.globals.get("llvm.x86.sse2.pause")
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (int64 ticks at a fixed rate: ticks_per_second)."""
    def codegen(context, builder, signature, args):
        fn = builder.module.globals.get("llvm.readcyclecounter")
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


_TICKS_PER_SECOND = None


def ticks_per_second():
    """The time-stamp counter's rate (cycles() ticks a second), measured once over 50 ms against perf_counter;
    0 where the counter does not run."""
    global _TICKS_PER_SECOND
    if _TICKS_PER_SECOND is None:
        _now()  # compiled before the clocks are read
        t0, c0 = time.perf_counter(), _now()
        time.sleep(0.05)
        t1, c1 = time.perf_counter(), _now()
        _TICKS_PER_SECOND = max(0.0, (c1 - c0) / (t1 - t0))
    return _TICKS_PER_SECOND


@njit(nogil=True, cache=True)
def _now():
    return cycles()


@njit(inline="always", nogil=True)
def mark(trace, worker, slot, last):
    """Where trace [W, S] has a row for `worker` (a profile asked for it): trace[worker, slot] += ticks since
    `last`; returns now. Else returns `last`, untouched, at the cost of one comparison."""
    if worker < trace.shape[0]:
        now = cycles()
        trace[worker, slot] += now - last
        return now
    return last


@njit(nogil=True, cache=True)
def new_counters(num_stages, num_workers):
    return np.zeros((num_stages * (num_workers + 1)) * LINE, dtype=np.int64)


@njit(inline="always", nogil=True)
def _slot(stage, worker, num_workers):
    return (stage * (num_workers + 1) + worker) * LINE


@njit(inline="always", nogil=True)
def take(counters, stage, worker, num_workers, num_items, tried):
    """(item, tried): the next item of `stage` for `worker`, from its own share (tried = 0), then from the
    shares after it; item = num_items once there is none. Pass back the `tried` it returns."""
    while tried < num_workers:
        owner = (worker + tried) % num_workers
        lo, hi = owner * num_items // num_workers, (owner + 1) * num_items // num_workers
        slot = _slot(stage, owner, num_workers)
        # another's share is read before it is claimed from: a locked add waits for the line and serializes
        # the scan (microseconds a stage over 16 shares), plain reads of spent shares overlap
        if hi > lo and (tried == 0 or lo + atomic_load(counters, slot) < hi):
            i = lo + atomic_add(counters, slot, 1)
            if i < hi:
                return i, tried
        tried += 1
    return num_items, tried


@njit(inline="always", nogil=True)
def finish(counters, stage, num_workers, num_done, num_items):
    """Count num_done items of `stage` finished here, then wait until all num_items are."""
    slot = _slot(stage, num_workers, num_workers)
    if num_done:
        atomic_add(counters, slot, num_done)
    while atomic_load(counters, slot) < num_items:
        pause()
