"""The runtime interface (gpu_kernels.runtime.CupyRuntime's) over NumPy arrays, without a GPU: device arrays are
NumPy arrays, copies are assignments. It runs GpuBackend's Python side on the CPU: with the tests' NumPy kernels
(tests/gpu_kernels/conftest.py) it checks the backend's wiring, and with launches that do nothing it times the
backend's own host cost (bench/gpu_host_cost.py).

A graph is captured as a CUDA graph is: the copies and kernels queued while capturing (those that go through
queue_or_run) are recorded with their arguments as they were, arrays by reference and numbers by value, and each
launch runs those calls again. So work that passes a step's number as a kernel argument, or reads an array the
next step replaces, gives stale results here as it would on a GPU.

Made with mapped_memory, pinned host arrays have device addresses (their own: the device is the host), as CUDA's
mapped pinned memory does, so the decode relay (hybrid/relay.py) runs here: its kernels' stand-ins read and write the
mailbox through those addresses while the relay's host worker, another thread, answers them.
"""
import threading
import weakref

import numpy as np

_capture = threading.local()  # .calls: the calls recorded by the graph this thread captures, or None


def queue_or_run(fn, *args, **kwargs):
    """fn(*args, **kwargs) now, or, while this thread captures a graph, recorded for the graph's launches."""
    calls = getattr(_capture, "calls", None)
    if calls is None:
        return fn(*args, **kwargs)
    calls.append((fn, args, kwargs))
    return None


def capturing():
    """Whether this thread is capturing a graph."""
    return getattr(_capture, "calls", None) is not None


def _not_capturing(what):
    """A capture may only queue work: allocating or copying synchronously invalidates a CUDA stream capture."""
    if capturing():
        raise RuntimeError(f"{what} during a graph capture")


class NumpyRuntime:
    """The runtime interface over NumPy arrays: runs GpuBackend's Python side without a GPU. Several of them present
    several devices (hybrid/devices.py): `device_index` names one, `memory_bytes` is its memory; `allocated` counts
    the bytes of its arrays alive now and `peak` the most they ever were, so that a test holds a device to its
    budget."""

    xp = np
    name = "numpy"
    warp_size = 32
    captures = 0

    def __init__(self, device_index=0, memory_bytes=64 << 30, mapped_memory=False):
        self.device_index, self.memory_bytes, self.mapped_memory = device_index, memory_bytes, mapped_memory
        self.device_name = "numpy" if device_index == 0 else f"numpy {device_index}"
        self.allocated = self.peak = 0

    def memory_info(self):
        """(free, total) bytes: the memory less what this runtime allocated."""
        return self.memory_bytes - self.allocated, self.memory_bytes

    def use(self):
        """Make this device current in the calling thread (nothing to do over NumPy)."""

    def _count(self, array):
        self.allocated += array.nbytes
        self.peak = max(self.peak, self.allocated)
        weakref.finalize(array, self._free, array.nbytes)
        return array

    def _free(self, nbytes):
        self.allocated -= nbytes

    def empty(self, shape, dtype):
        _not_capturing("an allocation")
        return self._count(np.empty(shape, dtype))

    def zeros(self, shape, dtype):
        _not_capturing("an allocation")
        return self._count(np.zeros(shape, dtype))

    def to_device(self, host, stream=None):
        _not_capturing("a synchronous copy")
        return self._count(np.array(host))

    def copy_from_host(self, dst, host, stream=None):
        _not_capturing("a synchronous copy")
        dst[...] = host

    def to_host(self, dev, out=None, stream=None):
        _not_capturing("a synchronous copy")
        return np.array(dev) if out is None else np.copyto(out, dev) or out

    def pinned_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def mapped_address(self, host):
        """The device address of a pinned host array (its own address), or None unless made with mapped_memory."""
        return host.ctypes.data if self.mapped_memory else None

    @staticmethod
    def page_lock(address, num_bytes):
        return True

    @staticmethod
    def page_unlock(address):
        pass

    def copy_to_host_async(self, host, dev, stream):
        queue_or_run(np.copyto, host, dev)

    def copy_from_host_async(self, dev, host, stream):
        queue_or_run(np.copyto, dev, host)

    def copy_on_device_async(self, dst, src, stream):
        queue_or_run(np.copyto, dst, src)

    def copy_peer_async(self, dst, src, src_runtime, stream):
        """Queue a copy of `src` (an array of `src_runtime`'s device) into `dst` (this device's) on `stream`."""
        queue_or_run(np.copyto, dst, src)

    def can_access_peer(self, other):
        """Whether this device reads `other`'s memory directly (a peer copy); NumPy devices share the host's."""
        return True

    def stream(self):
        return None

    @staticmethod
    def wait_event(stream, event):
        """Make `stream`'s later work wait for `event` (NumPy work runs in order: nothing to wait for)."""

    def event(self, timing=False):
        return NumpyEvent()

    def elapsed(self, start, stop):
        return 0.0

    def capture(self, stream, queue):
        """The graph of the calls queue() queues (recorded, not run)."""
        if capturing():
            raise RuntimeError("a graph capture is already under way in this thread")
        self.captures += 1
        _capture.calls = calls = []
        try:
            queue()
        finally:
            _capture.calls = None
        return NumpyGraph(calls)


class NumpyGraph:
    """A captured graph's stand-in: each launch runs the recorded calls with the arguments they were recorded with."""

    def __init__(self, calls):
        self.calls, self.launches = calls, 0

    def launch(self, stream=None):
        self.launches += 1
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)


class NumpyEvent:
    done = True

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass
