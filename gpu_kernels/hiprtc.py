"""Compile-only hiprtc through ctypes: checks every kernel source for AMD chips without a GPU (CI), as ROCm's runtime
compiler builds them on a ROCm machine (CuPy for ROCm compiles RawModules with hiprtc).

The library is ROCm's libhiprtc (ROCm 6 and later) or libamdhip64, which holds hiprtc before ROCm 6 (Debian's
`libamdhip64-dev` package, as .ci/run installs). It links each code object with ROCm's device libraries, so it
compiles only for chips those libraries know (Debian's ROCm 5.2: up to gfx1036).
"""
import ctypes

from .rtc import RuntimeCompiler

LIBRARIES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libamdhip64.so.5", "libamdhip64.so")


def find_library():
    """Name of a loadable library that exports hiprtc, or None."""
    for name in LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "hiprtcCompileProgram"):
            return name
    return None


class Hiprtc(RuntimeCompiler):
    prefix = "hiprtc"
    code_functions = ("GetCodeSize", "GetCode")
    missing = "no hiprtc library found (ROCm's libhiprtc, or Debian's libamdhip64-dev)"
    find_library = staticmethod(find_library)

    def compile(self, name, source, chip="gfx906", options=("--std=c++14",)):
        """The code object (ELF) of `source` for `chip`; KernelCompileError naming the module and chip, with the
        compiler's log."""
        return self._build(f"{name} ({chip})", source, chip, options)
