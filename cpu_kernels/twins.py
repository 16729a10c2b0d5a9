"""Serial twins of parallel kernels, for decode-sized calls.

Every parallel kernel call opens an OpenMP region: waking the pool and the closing
barrier cost ~25 us on 2 threads here (and milliseconds when the host is oversubscribed),
more than a one-token norm, rope or routing takes. With one thread the backend calls the
twin, the same code compiled without threads, when the work is that small; with more it keeps
to the parallel kernels (hybrid/backends/cpu.py says why). Kernels also call the twins of their
own parallel helpers below a size (cpu_kernels.tiles, cpu_kernels.prefill).
"""
import types

from numba import njit


def renamed_copy(fn, suffix, **new_globals):
    """A copy of the Python function fn named fn_suffix, its globals overridden by new_globals. Numba keys
    its cache files by qualified name, so a copy compiles and caches apart from fn and from other copies."""
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **new_globals} if new_globals else fn.__globals__,
                              f"{fn.__name__}_{suffix}", fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"{fn.__qualname__}_{suffix}"
    return copy


def serial_twin(kernel):
    """The kernel's Python function compiled without `parallel` (prange runs as range), cached apart."""
    fn = kernel.py_func
    twin = renamed_copy(fn, "serial")
    twin.__doc__ = f"Serial twin of {fn.__qualname__}: {fn.__doc__}"
    options = dict(fastmath=True)  # and the kernel's own fast-math flags and error model, where it sets them
    options.update({key: value for key, value in kernel.targetoptions.items() if key in ("fastmath", "error_model")})
    return njit(nogil=True, cache=True, **options)(twin)
