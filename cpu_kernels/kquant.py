"""Pieces shared by the K-quant formats (Q4_K, Q5_K, Q6_K): super-blocks of 256 weights.

8-bit bit-field intrinsics and the packed 6-bit sub-block scales; the work split,
checks and wrappers are in `tiles`.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from .half import read_half

QK_K = 256  # weights per super-block
SUB = 32  # weights per sub-block of Q4_K / Q5_K (and per run of quant bytes in Q6_K)


@intrinsic
def ubits(typingctx, byte, shift, mask):
    """float32((byte >> shift) & mask) for a uint8 `byte`, computed in 8 bits.

    Numba widens integer arithmetic to int64, and int64 -> float conversions do not
    vectorize before AVX-512; 8-bit shifts, masks and uint8 -> float32 do.
    """
    if byte != types.uint8 or not isinstance(shift, types.Integer) or not isinstance(mask, types.Integer):
        return None
    sig = types.float32(byte, shift, mask)

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        bits = builder.lshr(args[0], builder.trunc(args[1], i8))
        bits = builder.and_(bits, builder.trunc(args[2], i8))
        return builder.uitofp(bits, ir.FloatType())

    return sig, codegen


@intrinsic
def join_bits(typingctx, low, low_shift, high, high_shift, high_mask):
    """float32(((low >> low_shift) & 15) | (((high >> high_shift) & high_mask) << 4)) for uint8 bytes, in 8 bits.

    A 5- or 6-bit quant from its low nibble and its high bits, converted to float once.
    """
    if low != types.uint8 or high != types.uint8:
        return None
    sig = types.float32(low, low_shift, high, high_shift, high_mask)

    def codegen(context, builder, signature, args):
        i8 = ir.IntType(8)
        low_bits = builder.and_(builder.lshr(args[0], builder.trunc(args[1], i8)), ir.Constant(i8, 15))
        high_bits = builder.and_(builder.lshr(args[2], builder.trunc(args[3], i8)), builder.trunc(args[4], i8))
        return builder.uitofp(builder.or_(low_bits, builder.shl(high_bits, ir.Constant(i8, 4))), ir.FloatType())

    return sig, codegen


@njit(inline="always", nogil=True, cache=True)
def scale_min(raw, offset, j):
    """(scale, min) of sub-block j (0-7) from the 12 packed bytes at `offset` (ggml's get_scale_min_k4).

    bytes 0-3: scales 0-3 (low 6 bits), top 2 bits of scales 4-7
    bytes 4-7: mins 0-3 (low 6 bits), top 2 bits of mins 4-7
    bytes 8-11: low 4 bits of scales 4-7 (low nibble), of mins 4-7 (high nibble)
    """
    if j < 4:
        sc = raw[offset + j] & 63
        m = raw[offset + j + 4] & 63
    else:
        sc = (raw[offset + j + 4] & 15) | ((raw[offset + j - 4] >> 6) << 4)
        m = (raw[offset + j + 4] >> 4) | ((raw[offset + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(inline="always", nogil=True, cache=True)
def sub_scales(row, o, j):
    """(d * scale_j, dmin * min_j) of sub-block j of the Q4_K / Q5_K block at byte o (d, dmin, packed scales)."""
    sc, m = scale_min(row, o + 4, j)
    return read_half(row, o) * sc, read_half(row, o + 2) * m
