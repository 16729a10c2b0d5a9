"""Compile-only HIP through the ROCm compiler driver (hipcc): checks every kernel source for AMD chips without one.

On a ROCm machine the kernels are compiled at run time by hiprtc, which is clang with the HIP runtime's device
functions and the chip's macros (__gfx1100__, __GFX11__, __AMDGCN_WAVEFRONT_SIZE). hipcc given the same source
with `-include hip/hip_runtime.h` compiles it the same way, so CI can check the HIP side of the sources (the
branches under __HIP_PLATFORM_AMD__) with Debian's `hipcc` package and no GPU.

Two forms: a code object (the chip's machine code linked with ROCm's device libraries, as hiprtc gives) where the
installed device libraries cover the chip, and assembly (the backend's output, before that link) for any chip
the compiler knows: Debian's ROCm 5.2 libraries stop at gfx1036, its clang 15 goes to gfx1103.
"""
import glob
import os
import re
import shutil
import subprocess
import tempfile

from .errors import KernelCompileError

DEVICE_LIB_DIRS = ("/opt/rocm/amdgcn/bitcode", "/opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode",
                   "/usr/lib/*/amdgcn/bitcode")
HIP_OPTIONS = ("-O3", "-std=c++14", "-D__HIP_PLATFORM_AMD__", "-include", "hip/hip_runtime.h")


def find_hipcc():
    """Path of hipcc, or None."""
    return shutil.which("hipcc") or next((p for p in ("/opt/rocm/bin/hipcc",) if os.path.exists(p)), None)


def find_device_libs():
    """The folder of ROCm's device libraries (ocml, ockl, one oclc_isa_version_<chip>.bc a chip), or None."""
    for pattern in DEVICE_LIB_DIRS:
        for folder in sorted(glob.glob(pattern)):
            if glob.glob(os.path.join(folder, "oclc_isa_version_*.bc")):
                return folder
    return None


def linkable_chips(device_libs):
    """The chips ("gfx906", "gfx1030", ...) whose code objects the device libraries in `device_libs` can link."""
    names = glob.glob(os.path.join(device_libs, "oclc_isa_version_*.bc")) if device_libs else ()
    return {"gfx" + re.search(r"oclc_isa_version_(\w+)\.bc$", n).group(1) for n in names}


class Hipcc:
    def __init__(self, path=None):
        self.path = path or find_hipcc()
        if self.path is None:
            raise OSError("no hipcc found (Debian: apt-get install hipcc; ROCm: /opt/rocm/bin/hipcc)")
        self.device_libs = find_device_libs()
        self.env = dict(os.environ, HIP_PLATFORM="amd")  # hipcc would pick nvcc where the CUDA toolkit is installed

    def code_object(self, name, source, chip):
        """The code object (a clang offload bundle) of `source` for `chip`, linked with the device libraries."""
        if chip not in linkable_chips(self.device_libs):
            raise OSError(f"ROCm's device libraries here ({self.device_libs}) have no {chip}")
        return self._run(name, source, chip, ("--genco", f"--rocm-device-lib-path={self.device_libs}"), binary=True)

    def assembly(self, name, source, chip):
        """The assembly text of `source`'s device code for `chip`, before the device libraries are linked in."""
        return self._run(name, source, chip, ("-S", "--cuda-device-only", "-nogpulib"))

    def _run(self, name, source, chip, mode, binary=False):
        with tempfile.TemporaryDirectory(prefix="strata-hipcc-") as tmp:
            src, out = os.path.join(tmp, f"{name}.hip"), os.path.join(tmp, f"{name}.out")
            with open(src, "w") as f:
                f.write(source)
            cmd = [self.path, *mode, f"--offload-arch={chip}", *HIP_OPTIONS, src, "-o", out]
            done = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
            if done.returncode != 0:
                raise KernelCompileError(f"{name} ({chip})", (done.stderr or done.stdout).replace(src, f"{name}.hip"))
            with open(out, "rb" if binary else "r") as f:
                return f.read()


def kernel_assembly(assembly, kernel):
    """The instructions of `kernel` in hipcc's assembly text: the lines from its label to its end marker."""
    match = re.search(rf"^{re.escape(kernel)}:[^\n]*$(.*?)^\.Lfunc_end\d+:", assembly, re.M | re.S)
    if match is None:
        raise KeyError(f"kernel {kernel!r} is not in the assembly")
    return [ln.strip() for ln in match.group(1).splitlines()
            if ln.strip() and not ln.strip().startswith((";", ".", "//")) and not ln.strip().endswith(":")]
