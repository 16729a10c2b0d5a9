"""BF16: bfloat16 weights (the high 16 bits of a float32), 2 bytes each, little endian. Kernels in `dense`.

Shape legend: R output rows, C columns, B bytes per row (2 * C), T tokens, E experts,
N (token, expert) rows sorted by group, G groups.
"""
import numpy as np
from gguf import GGMLQuantizationType

from . import dense
from .tiles import format_api

QTYPE = GGMLQuantizationType.BF16
BLOCK_SIZE = 1
BLOCK_BYTES = 2


def _unpack_rows(raw, out):
    """raw uint8 [R, B] -> out f32 [R, C]."""
    np.left_shift(raw.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)


dequantize, matvec, matmul, moe_matmul, moe_matmul_pair = format_api(
    __name__, BLOCK_SIZE, BLOCK_BYTES, _unpack_rows, *dense.moe_kernels(np.uint16, dense.BF16_BITS))


def random_blocks(rng, shape, scale):
    """Random BF16 bytes [..., 2 * C] for a weight of shape (..., C): normal values of std `scale`."""
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)  # [..., C]
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
