"""BF16: bfloat16 weights (the high 16 bits of a float32), 2 bytes each, little endian. Kernels in `dense`.

Shape legend: R output rows, C columns, B bytes per row (2 * C), T tokens, E experts,
N (token, expert) rows sorted by group, G groups.
"""
import numpy as np
from gguf import GGMLQuantizationType

from . import dense
from .tiles import ONE_EXPERT, check_dequantize, check_moe

QTYPE = GGMLQuantizationType.BF16
BLOCK_SIZE = 1
BLOCK_BYTES = 2
_SPEC = dense.spec(0x8000, 16, 0x7FFF, 16, 1.0)


def dequantize(raw, out):
    """raw uint8 [..., B] -> out f32 [..., C], bit-exact with gguf.quants.dequantize."""
    check_dequantize(raw, out, BLOCK_SIZE, BLOCK_BYTES, __name__)
    np.left_shift(raw.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)


def matvec(raw, x, out):
    """out [R] = W @ x [C] for raw uint8 [R, B] (decode)."""
    matmul(raw, x.reshape(1, -1), out.reshape(1, -1))


def matmul(raw, x, out):
    """out [T, R] = x [T, C] @ W.T for raw uint8 [R, B] (prefill)."""
    moe_matmul(raw.reshape(1, *raw.shape), x, ONE_EXPERT, np.array([0, x.shape[0]]), out)


def moe_matmul(raw, x, expert_ids, row_starts, out):
    """out[row_starts[g]:row_starts[g+1]] = x[same rows] @ W[expert_ids[g]].T; raw [E, R, B], x [N, C], out [N, R]."""
    check_moe(raw, x, expert_ids, row_starts, out, BLOCK_SIZE, BLOCK_BYTES, __name__)
    dense.moe_matmul(raw.view(np.uint16), x, expert_ids, row_starts, _SPEC, out)


def random_blocks(rng, shape, scale):
    """Random BF16 bytes [..., 2 * C] for a weight of shape (..., C): normal values of std `scale`."""
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)  # [..., C]
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
