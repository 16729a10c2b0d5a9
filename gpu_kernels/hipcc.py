"""HIP device code to assembly through the ROCm compiler driver (hipcc), without a GPU: the chips hiprtc cannot link
here (gfx1100: Debian's ROCm 5.2 device libraries stop at gfx1036; its clang 15 goes to gfx1103), and the checks
that read the machine code (which dot instruction a kernel uses).

hiprtc compiles the kernels with the HIP runtime's device functions and the chip's macros (__gfx1100__, __GFX11__,
__AMDGCN_WAVEFRONT_SIZE); hipcc given the same source with `-include hip/hip_runtime.h` compiles it the same way.
The assembly is the backend's output before ROCm's device libraries are linked in.
"""
import os
import re
import shutil
import subprocess
import tempfile

from .errors import KernelCompileError

COMPILE_TIMEOUT_S = 300  # a module takes seconds; more means the compiler hangs
HIP_OPTIONS = ("-O3", "-std=c++14", "-D__HIP_PLATFORM_AMD__", "-include", "hip/hip_runtime.h")


def find_hipcc():
    """Path of hipcc, or None."""
    return shutil.which("hipcc") or next((p for p in ("/opt/rocm/bin/hipcc",) if os.path.exists(p)), None)


class Hipcc:
    def __init__(self, path=None):
        self.path = path or find_hipcc()
        if self.path is None:
            raise OSError("no hipcc found (Debian: apt-get install hipcc; ROCm: /opt/rocm/bin/hipcc)")
        self.env = dict(os.environ, HIP_PLATFORM="amd")  # hipcc would pick nvcc where the CUDA toolkit is installed

    def assembly(self, name, source, chip):
        """The assembly text of `source`'s device code for `chip`; KernelCompileError naming the module and chip,
        with the compiler's log."""
        with tempfile.TemporaryDirectory(prefix="strata-hipcc-") as tmp:
            src, out = os.path.join(tmp, f"{name}.hip"), os.path.join(tmp, f"{name}.s")
            with open(src, "w") as f:
                f.write(source)
            cmd = [self.path, "-S", "--cuda-device-only", "-nogpulib", f"--offload-arch={chip}", *HIP_OPTIONS, src,
                   "-o", out]
            done = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=COMPILE_TIMEOUT_S)
            if done.returncode != 0:
                raise KernelCompileError(f"{name} ({chip})", (done.stderr or done.stdout).replace(src, f"{name}.hip"))
            with open(out) as f:
                return f.read()


def kernel_lines(assembly, kernel):
    """The lines of `kernel` in hipcc's assembly text, stripped: from its label to its end marker (instructions,
    block labels with LLVM's loop comments, directives)."""
    match = re.search(rf"^{re.escape(kernel)}:[^\n]*$(.*?)^\.Lfunc_end\d+:", assembly, re.M | re.S)
    if match is None:
        raise KeyError(f"kernel {kernel!r} is not in the assembly")
    return [ln.strip() for ln in match.group(1).splitlines() if ln.strip()]


def kernel_assembly(assembly, kernel):
    """The instructions of `kernel` in hipcc's assembly text (kernel_lines without labels, comments, directives)."""
    return [ln for ln in kernel_lines(assembly, kernel) if not ln.startswith((";", ".", "//")) and not ln.endswith(":")]
