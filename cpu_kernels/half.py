"""IEEE half -> float32 inside Numba kernels (Numba has no float16 arrays).

Quant blocks store their scales as little-endian f16; kernels read the two
bytes and widen them here. The conversion is exact (every half is a float32).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from . import simd


@njit(inline="always", nogil=True, cache=True)
def half_bits_to_f32(bits):
    """bits: the 16-bit pattern of a half as an integer -> its float32 value."""
    bits = np.uint32(bits)
    sign = (bits >> np.uint32(15)) & np.uint32(1)
    exp = (bits >> np.uint32(10)) & np.uint32(0x1F)
    mant = bits & np.uint32(0x3FF)
    if exp == 0:
        # zero or subnormal: mant * 2^-24, exact in float32
        val = np.float32(mant) * np.float32(5.9604644775390625e-08)
        return -val if sign else val
    if exp == 31:
        out_bits = (sign << np.uint32(31)) | np.uint32(0x7F800000) | (mant << np.uint32(13))
    else:
        out_bits = (sign << np.uint32(31)) | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))
    return u32_as_f32(out_bits)


@intrinsic
def u32_as_f32(typingctx, u):
    """Reinterpret the bits of a uint32 as a float32 (an LLVM bitcast, no memory)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", nogil=True, cache=True)
def read_half(raw, offset):
    """raw: uint8 bytes; the little-endian half at `offset` as float32."""
    return half_bits_to_f32(np.uint32(raw[offset]) | (np.uint32(raw[offset + 1]) << np.uint32(8)))


@intrinsic
def half_bits_as_f32(typingctx, bits):
    """The float32 value of the IEEE half whose bits are the low 16 of `bits` (an integer), exact, as
    simd.half_to_f32 builds it: one vcvtph2ps per vector where the target has F16C (target.has_f16c)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return simd.half_to_f32(builder, builder.trunc(args[0], ir.IntType(16)))

    return sig, codegen
