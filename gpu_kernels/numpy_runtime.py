"""The runtime interface (gpu_kernels.runtime.CupyRuntime's) over NumPy arrays, without a GPU: device arrays are
NumPy arrays, copies are assignments, a captured graph runs its work again. It runs GpuBackend's Python side on the
CPU: with the tests' NumPy kernels (tests/gpu_kernels/conftest.py) it checks the backend's wiring, and with launches
that do nothing it times the backend's own host cost (bench/gpu_host_cost.py)."""
import numpy as np


class NumpyRuntime:
    """The runtime interface over NumPy arrays: runs GpuBackend's Python side without a GPU."""

    xp = np
    name = device_name = "numpy"
    warp_size = 32
    captures = 0

    def memory_info(self):
        return 64 << 30, 64 << 30

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def to_device(self, host, stream=None):
        return np.array(host)

    def copy_from_host(self, dst, host, stream=None):
        dst[...] = host

    def to_host(self, dev, out=None, stream=None):
        return np.array(dev) if out is None else np.copyto(out, dev) or out

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def copy_to_host_async(self, host, dev, stream):
        host[...] = dev

    def copy_from_host_async(self, dev, host, stream):
        dev[...] = host

    def copy_on_device_async(self, dst, src, stream):
        dst[...] = src

    def stream(self):
        return None

    def event(self, timing=False):
        return NumpyEvent()

    def elapsed(self, start, stop):
        return 0.0

    def capture(self, stream, queue):
        self.captures += 1
        return NumpyGraph(queue)


class NumpyGraph:
    """A captured graph's stand-in: launching it runs the captured work again, so the work must read its
    inputs from the buffers it was captured with, as a real graph's does."""

    def __init__(self, queue):
        self.queue, self.launches = queue, 0

    def launch(self, stream=None):
        self.launches += 1
        self.queue()


class NumpyEvent:
    done = True

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass
