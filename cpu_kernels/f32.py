"""F32: float32 weights, 4 bytes each, little endian. Kernels in `dense`.

Shape legend: R output rows, C columns, B bytes per row (4 * C), T tokens, E experts,
N (token, expert) rows sorted by group, G groups.
"""
import numpy as np
from gguf import GGMLQuantizationType

from . import dense
from .tiles import format_api

QTYPE = GGMLQuantizationType.F32
BLOCK_SIZE = 1
BLOCK_BYTES = 4


def _unpack_rows(raw, out):
    """raw uint8 [R, B] -> out f32 [R, C]."""
    np.copyto(out, raw.view(np.float32))


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _unpack_rows, *dense.moe_kernels(np.uint32, dense.F32_BITS))


def random_blocks(rng, shape, scale):
    """Random F32 bytes [..., 4 * C] for a weight of shape (..., C): normal values of std `scale`."""
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).view(np.uint8)
