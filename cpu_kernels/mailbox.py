"""Flags between the host and a device that reads and writes host memory: a posted step number,
waited for with a spin.

The hybrid decode relay (hybrid/relay.py) hands a layer's routing from the device to a host worker,
and the worker's rows back, without the calling Python thread: the writer stores its data, then
the flag (release); the reader waits until the flag reaches the step's number (acquire), then
reads the data. Flags are int64 each on its own cache line (LINE), numbers only ever grow, so a flag
left over from an earlier step never passes a later step's wait.
"""
import numpy as np
from numba import njit, types
from numba.core.extending import intrinsic

from .sync import LINE, atomic_load, cycles, pause, ticks_per_second

WAIT_OK, WAIT_ABORTED, WAIT_TIMED_OUT = 0, 1, 2
_CHECK_EVERY = 256  # spins between looks at the abort flag and the clock


@intrinsic
def atomic_store(typingctx, array, index, value):
    """array[index] = value with release ordering (int64)."""
    sig = types.void(array, index, value)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        builder.store_atomic(args[2], builder.gep(data, [args[1]]), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True)
def post(flags, index, value):
    """flags[index] = value (int64 [n]), after every store before it."""
    atomic_store(flags, index, np.int64(value))


@njit(nogil=True, cache=True)
def wait_for(flags, index, value, abort, limit_ticks):
    """Spin until flags[index] >= value (int64 [n]): WAIT_OK; WAIT_ABORTED once abort[0] is set; WAIT_TIMED_OUT
    after limit_ticks of the CPU's time-stamp counter (where it does not run, after limit_ticks spins)."""
    start = cycles()
    spins = 0
    while atomic_load(flags, index) < value:
        pause()
        spins += 1
        if spins % _CHECK_EVERY == 0:
            if atomic_load(abort, 0) != 0:
                return WAIT_ABORTED
            elapsed = cycles() - start
            if (elapsed if elapsed > 0 else spins) > limit_ticks:
                return WAIT_TIMED_OUT
    return WAIT_OK


def new_flags(count, empty=np.empty):
    """int64 [count * LINE] zeros, each flag i at i * LINE; `empty` allocates (pinned memory for a device)."""
    flags = empty((count * LINE,), np.int64)
    flags[:] = 0
    return flags


def ticks(seconds):
    """A limit for wait_for of about `seconds` (in spins where the counter does not run, ~1e8 a second)."""
    rate = ticks_per_second()
    return np.int64(seconds * (rate if rate > 0 else 1e8))

