"""The GPU runtime: which backend drives the GPU, and the few things Strata asks of it.

Backends, in order of preference: CuPy on CUDA, CuPy on ROCm (CuPy built for HIP). HIP-Python
alone is detected and reported, but Strata's GPU model backend works on CuPy arrays, so it does
not run the model yet. The interface: allocate, copy to and from (pinned) host memory, streams,
events, compile a kernel module from source (CuPy caches the binary on disk, in CUPY_CACHE_DIR)
and launch its kernels.
"""
import logging
from dataclasses import dataclass

from .errors import KernelCompileError

log = logging.getLogger(__name__)

COMPILE_OPTIONS = ("--std=c++14",)
HOST_REGISTER_FLAGS = 1 | 8  # portable (every device) | read-only (a mapped file may be locked); HIP numbers them alike


@dataclass
class Probe:
    """The outcome of looking for a usable GPU: a runtime, or why there is none."""

    runtime: object
    reason: str


class CupyRuntime:
    """CuPy on CUDA or on ROCm; device arrays are CuPy arrays."""

    def __init__(self, device_index=0, memory_limit=None):
        import cupy
        import cupyx

        self.cp, self._cupyx = cupy, cupyx
        self.xp = cupy
        self.device = cupy.cuda.Device(device_index)
        self.device.use()
        self.is_hip = bool(cupy.cuda.runtime.is_hip)
        props = cupy.cuda.runtime.getDeviceProperties(device_index)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.warp_size = int(props["warpSize"])
        self.multiprocessors = int(props["multiProcessorCount"])
        self.registers_per_multiprocessor = int(props.get("regsPerMultiprocessor", 65536))
        self.name = "cupy-rocm" if self.is_hip else "cupy-cuda"
        self.chip = amd_chip(props.get("gcnArchName")) if self.is_hip else None  # "gfx1100"; None on NVIDIA
        self._modules = {}
        self.device_index = device_index
        self.memory_limit = memory_limit  # (free, total) of a logical device's share (hybrid/devices.py), or None

    def memory_info(self):
        """(free bytes, total bytes) of the device, or of this logical device's share of it."""
        return self.memory_limit or self.cp.cuda.runtime.memGetInfo()

    def use(self):
        """Make this device current in the calling thread (its arrays, kernels and streams are this device's)."""
        self.device.use()

    def can_access_peer(self, other):
        """Whether this device reads `other`'s memory directly (the same device, or peer access enabled here)."""
        if other.device_index == self.device_index:
            return True
        if not self.cp.cuda.runtime.deviceCanAccessPeer(self.device_index, other.device_index):
            return False
        with self.device:
            try:
                self.cp.cuda.runtime.deviceEnablePeerAccess(other.device_index)
            except self.cp.cuda.runtime.CUDARuntimeError:  # already enabled
                pass
        return True

    def copy_peer_async(self, dst, src, src_runtime, stream):
        """Queue a copy of the contiguous `src` (an array of `src_runtime`'s device) into `dst` (this device's) on
        `stream`: a device-to-device copy on one device (two logical devices), a peer copy between two."""
        rt = self.cp.cuda.runtime
        if src_runtime.device_index == self.device_index:
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, _ptr(stream))
        else:
            rt.memcpyPeerAsync(dst.data.ptr, self.device_index, src.data.ptr, src_runtime.device_index, src.nbytes,
                               _ptr(stream))

    @staticmethod
    def wait_event(stream, event):
        """Make `stream`'s later work wait for `event` (recorded on another stream, maybe another device's)."""
        stream.wait_event(event)

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype=dtype)

    def to_device(self, host, stream=None):
        """A device copy of the NumPy array `host` (asynchronous on `stream` when `host` is pinned)."""
        out = self.cp.empty(host.shape, dtype=host.dtype)
        self.copy_from_host(out, host, stream)
        return out

    def copy_from_host(self, dst, host, stream=None):
        """Copy the contiguous NumPy array `host` into the device array `dst` of the same shape."""
        dst.set(host, stream=stream)

    def to_host(self, dev, out=None, stream=None):
        """Copy `dev` into the NumPy array `out` (a new one if None) and wait for it."""
        return dev.get(stream=stream, out=out)

    def pinned_empty(self, shape, dtype):
        """A NumPy array in page-locked host memory (fast, asynchronous copies)."""
        return self._cupyx.empty_pinned(shape, dtype=dtype)

    def page_lock(self, address, num_bytes):
        """Page-lock num_bytes of host memory at `address` in place, read-only to the device, so that copies from it
        are direct transfers; False where the platform refuses (a memory-lock limit, a runtime without it)."""
        try:
            self.cp.cuda.runtime.hostRegister(address, num_bytes, HOST_REGISTER_FLAGS)
        except Exception:  # CuPy's runtime error: the pages stay as they were
            return False
        return True

    def page_unlock(self, address):
        """Undo page_lock(address, ...)."""
        self.cp.cuda.runtime.hostUnregister(address)

    def mapped_address(self, host):
        """The device address at which kernels read the pinned array `host` directly (CUDA maps page-locked
        memory into the device's address space), or None where it is not mapped."""
        try:
            address = self.cp.cuda.runtime.pointerGetAttributes(host.ctypes.data).devicePointer
        except Exception:  # CuPy's runtime errors, or a build whose attributes lack it
            return None
        return int(address) or None

    def copy_to_host_async(self, host, dev, stream):
        """Queue a copy of the contiguous device array `dev` into the pinned array `host` on `stream`."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes, rt.memcpyDeviceToHost, _ptr(stream))

    def copy_from_host_async(self, dev, host, stream):
        """Queue a copy of the pinned array `host` into the contiguous device array `dev` on `stream`."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice, _ptr(stream))

    def copy_on_device_async(self, dst, src, stream):
        """Queue a copy of the contiguous device array `src` into the contiguous `dst` (same bytes) on `stream`."""
        rt = self.cp.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice, _ptr(stream))

    def stream(self):
        """A stream of its own that still orders with the legacy default stream, so CuPy work that
        runs there (allocation copies, other threads) never races the model's kernels."""
        return self.cp.cuda.Stream(non_blocking=False)

    def event(self, timing=False):
        return self.cp.cuda.Event(disable_timing=not timing)

    def capture(self, stream, queue):
        """A graph of the work `queue()` puts on `stream` (captured, not run); graph.launch(stream) replays it
        with one call. Raises RuntimeError where capture fails (the work must not allocate or wait)."""
        stream.begin_capture()
        try:
            queue()
        finally:
            graph = stream.end_capture()  # ends the capture even when queue() failed; raises if it was invalidated
        if graph is None:
            raise RuntimeError("stream capture gave no graph")
        return graph

    def elapsed(self, start, stop):
        """Seconds between two recorded timing events (waits for `stop`)."""
        stop.synchronize()
        return self.cp.cuda.get_elapsed_time(start, stop) / 1e3

    def compile(self, name, source, kernel_names):
        """Compile module `name`; returns {kernel name: function}. KernelCompileError with the log on failure."""
        if name not in self._modules:
            module = self.cp.RawModule(code=source, options=COMPILE_OPTIONS)
            try:
                module.compile()
            except self.cp.cuda.compiler.CompileException as exc:
                raise KernelCompileError(name, str(exc)) from None
            self._modules[name] = {k: module.get_function(k) for k in kernel_names}
            log.debug("compiled GPU kernel module %s", name)
        return self._modules[name]

    def resident_blocks(self, function, threads, shared_mem=0):
        """Blocks of `threads` threads (and shared_mem dynamic shared bytes) of the compiled `function` that the whole
        GPU holds at once: the driver's occupancy, else an estimate from the kernel's registers."""
        try:
            per_unit = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, threads, shared_mem)
        except Exception:  # a CuPy build without the call, or a function object without .ptr
            registers = max(1, int(getattr(function, "num_regs", 64) or 64))
            per_unit = min(2048 // threads, self.registers_per_multiprocessor // (registers * threads))
        return self.multiprocessors * max(1, int(per_unit))

    def launch(self, function, grid, block, args, shared_mem=0, stream=None):
        """Run `function` on `grid` x `block` threads; args: device arrays and NumPy scalars."""
        if stream is None or stream == self.cp.cuda.get_current_stream():  # entering `with stream` costs more
            function(grid, block, args, shared_mem=shared_mem)
        else:
            with stream:
                function(grid, block, args, shared_mem=shared_mem)


def amd_chip(arch_name):
    """An AMD device's chip ("gfx90a") from its gcnArchName ("gfx90a:sramecc+:xnack-", bytes or str), or None."""
    if not arch_name:
        return None
    name = arch_name.decode() if isinstance(arch_name, bytes) else str(arch_name)
    return name.split(":")[0].strip() or None


def _ptr(stream):
    return 0 if stream is None else stream.ptr


def _probe_cupy():
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (pip install strata[cuda])"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError without a driver or a device
        return None, f"CuPy finds no usable GPU ({exc})"
    if count == 0:
        return None, "CuPy finds no GPU"
    try:
        return CupyRuntime(), ""
    except Exception as exc:
        return None, f"CuPy could not open the GPU ({exc})"


def _hip_python_note():
    try:
        from hip import hip  # noqa: F401
    except ImportError:
        return ""
    return "; HIP-Python is installed but the GPU model backend needs CuPy arrays (CuPy for ROCm)"


def probe():
    """Find the GPU runtime: Probe(runtime, "") or Probe(None, why not)."""
    runtime, reason = _probe_cupy()
    if runtime is None:
        return Probe(None, reason + _hip_python_note())
    return Probe(runtime, "")
