"""Backends run the model's ops on a device; the model only calls their methods."""
import logging

from .cpu import CpuBackend

__all__ = ["CpuBackend", "select_backends"]

log = logging.getLogger(__name__)

DEVICES = ("auto", "gpu", "cpu")


def select_backends(device, cpu_options=None, gpu_options=None):
    """(backend, host) for `device`: (CpuBackend, None) on the CPU; (GpuBackend, CpuBackend) with a GPU,
    the host running the experts the GPU does not hold. "auto" falls back to the CPU with one log
    line saying why; "gpu" raises ValueError instead. cpu_options go to each CpuBackend, gpu_options to
    GpuBackend."""
    if device not in DEVICES:
        raise ValueError(f"device '{device}': expected one of {', '.join(DEVICES)}")
    cpu_options = cpu_options or {}
    if device == "cpu":
        return CpuBackend(**cpu_options), None
    from gpu_kernels.runtime import probe

    found = probe()
    if found.runtime is None:
        if device == "gpu":
            raise ValueError(f"device 'gpu' is not available: {found.reason}")
        log.info("device auto: running on the CPU: %s", found.reason)
        return CpuBackend(**cpu_options), None
    from .gpu import GpuBackend

    return GpuBackend(found.runtime, **(gpu_options or {})), CpuBackend(**cpu_options)
