"""The engine's map from a weight's GGML type to the CPU kernels that run it.

The file formats (hybrid/formats) hand over raw blocks and know nothing of kernels; this module says
which types Strata runs and turns small tensors (norms) into float32 through the kernels' own dequantize.
"""
import numpy as np

from cpu_kernels.formats import FORMATS, format_for, is_supported

from .errors import ModelError


def check_supported(weights):
    """ModelError naming the file and the first tensor whose type no kernel runs."""
    for tensor in weights.tensors.values():
        if not is_supported(tensor.qtype):
            supported = ", ".join(sorted(q.name for q in FORMATS))
            raise ModelError(f"{weights.source}: tensor '{tensor.name}' has type {tensor.qtype.name}, "
                             f"which Strata does not support (supported: {supported})")


def dequantize(tensor):
    """The weight as float32 [..., R, C] (copies; for small tensors and references)."""
    fmt = format_for(tensor.qtype)
    rows = tensor.raw.reshape(-1, tensor.raw.shape[-1])
    out = np.empty((rows.shape[0], tensor.shape[-1]), dtype=np.float32)
    fmt.dequantize(np.ascontiguousarray(rows), out)
    return out.reshape(tensor.shape)
