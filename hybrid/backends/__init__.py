"""Backends run the model's ops on a device; the model only calls their methods."""
from .cpu import CpuBackend

__all__ = ["CpuBackend"]
