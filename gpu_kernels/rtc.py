"""A compile-only runtime compiler (NVRTC or hiprtc) through ctypes: the two share one API, their functions named
with their own prefix, so one class drives both (gpu_kernels.nvrtc, gpu_kernels.hiprtc)."""
import ctypes

from .errors import KernelCompileError


class RuntimeCompiler:
    prefix = ""  # "nvrtc" or "hiprtc"
    arch_option = "--gpu-architecture"
    code_functions = ("", "")  # (size, get) of the compiled binary
    missing = ""  # the error when no library is found

    @staticmethod
    def find_library():
        return None

    def __init__(self, path=None):
        path = path or self.find_library()
        if path is None:
            raise OSError(self.missing)
        self.lib = ctypes.CDLL(path)
        self.path = path
        self._fn("GetErrorString").restype = ctypes.c_char_p

    def _fn(self, name):
        return getattr(self.lib, self.prefix + name)

    def _check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{self.prefix} {what}: {self._fn('GetErrorString')(status).decode()}")

    def _build(self, module, source, arch, options):
        """The binary of `source` for `arch`; KernelCompileError naming `module`, with the compiler's log."""
        prog = ctypes.c_void_p()
        self._check(self._fn("CreateProgram")(ctypes.byref(prog), source.encode(), f"{module}.cu".encode(),
                                              0, None, None), "create")
        try:
            opts = [o.encode() for o in (f"{self.arch_option}={arch}", *options)]
            status = self._fn("CompileProgram")(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if status != 0:
                raise KernelCompileError(module, self._read(prog, "GetProgramLogSize", "GetProgramLog"))
            return self._read(prog, *self.code_functions, binary=True)
        finally:
            self._fn("DestroyProgram")(ctypes.byref(prog))

    def _read(self, prog, size_fn, get_fn, binary=False):
        size = ctypes.c_size_t()
        self._fn(size_fn)(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self._fn(get_fn)(prog, buf)
        return buf.raw if binary else buf.value.decode(errors="replace")
