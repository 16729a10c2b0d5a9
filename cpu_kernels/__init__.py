"""Numba CPU kernels: quant formats (one module each), GEMV/GEMM, attention, norms, routing.

Every quant-format module exposes the same interface over GGUF's raw blocks
(uint8 rows of `BLOCK_BYTES`-sized blocks, each holding `BLOCK_SIZE` weights):

    QTYPE, BLOCK_SIZE, BLOCK_BYTES
    dequantize(raw [R, B], out f32 [R, C])
    matvec(raw [R, B], x f32 [C], out f32 [R])
    matmul(raw [R, B], x f32 [T, C], out f32 [T, R])
    moe_matmul(raw [E, R, B], x f32 [N, C], expert_ids int64 [G], row_starts int64 [G+1], out f32 [N, R])

Shape legend: R output rows, C columns (input features), B bytes per row,
T tokens, E experts, N (token, expert) rows sorted by expert, G groups.
"""
from .target import apply_isa_floor

# The target CPU must be fixed before the first kernel compiles.
apply_isa_floor()

import numba  # noqa: E402
from gguf import GGMLQuantizationType as _Q  # noqa: E402

# Kernels loaded from Numba's cache call the threading layer without launching it, and a serial twin
# that holds a parallel helper crashed when it was a fresh process's first kernel (the backend's
# set_threads launches it; other callers of these modules may not): launch it here.
numba.get_num_threads()

from . import bf16, f16, f32, q4_0, q4_k, q5_k, q6_k, q8_0  # noqa: E402

FORMATS = {m.QTYPE: m for m in (f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k)}


def format_for(qtype):
    """The kernel module of a GGML quant type; KeyError if Strata has none."""
    return FORMATS[_Q(qtype)]


def is_supported(qtype):
    try:
        return _Q(qtype) in FORMATS
    except ValueError:
        return False
