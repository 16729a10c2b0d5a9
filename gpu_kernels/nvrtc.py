"""Compile-only NVRTC through ctypes: checks every kernel source without a GPU (CI) and finds the library.

The library comes from the `nvidia-cuda-nvrtc` wheel (nvidia/cu13/lib) or the system (libnvrtc.so).
"""
import ctypes
import glob
import os

from .rtc import RuntimeCompiler


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


class Nvrtc(RuntimeCompiler):
    prefix = "nvrtc"
    code_functions = ("GetCUBINSize", "GetCUBIN")
    missing = "no libnvrtc found (pip install nvidia-cuda-nvrtc)"
    find_library = staticmethod(find_library)

    def compile(self, name, source, arch="sm_90", options=()):
        """Machine code (CUBIN) of `source` for `arch`; KernelCompileError naming the module, with NVRTC's log."""
        return self._build(name, source, arch, options)
