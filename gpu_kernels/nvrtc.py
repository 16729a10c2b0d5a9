"""Compile-only NVRTC through ctypes: checks every kernel source without a GPU (CI) and finds the library.

The library comes from the `nvidia-cuda-nvrtc` wheel (nvidia/cu13/lib) or the system (libnvrtc.so).
"""
import ctypes
import glob
import os

from .errors import KernelCompileError


def find_library():
    """Path of a libnvrtc shared library, or None."""
    try:
        import nvidia

        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for pattern in ("cu*/lib/libnvrtc.so*", "cuda_nvrtc/lib/libnvrtc.so*"):
            hits = sorted(p for p in glob.glob(os.path.join(root, pattern)) if "builtins" not in p and ".alt." not in p)
            if hits:
                return hits[-1]
    for name in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


class Nvrtc:
    def __init__(self, path=None):
        path = path or find_library()
        if path is None:
            raise OSError("no libnvrtc found (pip install nvidia-cuda-nvrtc)")
        self.lib = ctypes.CDLL(path)
        self.path = path

    def _check(self, status, what):
        if status != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"NVRTC {what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, name, source, arch="sm_90", options=()):
        """Machine code (CUBIN) of `source` for `arch`; KernelCompileError naming the module, with NVRTC's log."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                                0, None, None), "create")
        try:
            opts = [o.encode() for o in (f"--gpu-architecture={arch}", *options)]
            status = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if status != 0:
                raise KernelCompileError(name, self._read(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog"))
            return self._read(prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN", binary=True)
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _read(self, prog, size_fn, get_fn, binary=False):
        size = ctypes.c_size_t()
        getattr(self.lib, size_fn)(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        getattr(self.lib, get_fn)(prog, buf)
        return buf.raw if binary else buf.value.decode(errors="replace")
