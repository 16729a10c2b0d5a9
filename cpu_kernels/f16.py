"""F16: IEEE half weights, 2 bytes each, little endian. Kernels in `dense` (see there for how halves widen).

Shape legend: R output rows, C columns, B bytes per row (2 * C), T tokens, E experts,
N (token, expert) rows sorted by group, G groups.
"""
import numpy as np
from gguf import GGMLQuantizationType

from . import dense
from .tiles import format_api

QTYPE = GGMLQuantizationType.F16
BLOCK_SIZE = 1
BLOCK_BYTES = 2


def _unpack_rows(raw, out):
    """raw uint8 [R, B] -> out f32 [R, C]."""
    np.copyto(out, raw.view(np.float16))


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _unpack_rows, *dense.moe_kernels(np.uint16, dense.HALF))


def random_blocks(rng, shape, scale):
    """Random F16 bytes [..., 2 * C] for a weight of shape (..., C): normal values of std `scale`."""
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16).view(np.uint8)
