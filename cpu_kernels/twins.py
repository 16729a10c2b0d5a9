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


def serial_twin(kernel):
    """The kernel's Python function compiled without `parallel` (prange runs as range), cached apart."""
    fn = kernel.py_func
    twin = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_serial", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = f"{fn.__qualname__}_serial"  # its own cache file beside the parallel one's
    twin.__doc__ = f"Serial twin of {fn.__qualname__}: {fn.__doc__}"
    return njit(fastmath=True, nogil=True, cache=True)(twin)
