"""Errors of the GPU side."""


class KernelCompileError(RuntimeError):
    """A kernel module failed to compile; the message names it and holds the compiler's log."""

    def __init__(self, module, log):
        super().__init__(f"GPU kernel module '{module}' failed to compile:\n{log.strip()}")
        self.module, self.log = module, log


class VramError(RuntimeError):
    """The GPU's memory cannot hold what the configuration needs."""
