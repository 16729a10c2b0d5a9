"""Pieces shared by the K-quant formats (Q4_K, Q5_K, Q6_K): super-blocks of 256 weights.

Shape legend: R output rows, C columns, B bytes per row, T tokens, E experts,
N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from .half import read_half

QK_K = 256  # weights per super-block
SUB = 32  # weights per sub-block of Q4_K / Q5_K (and per run of quant bytes in Q6_K)
ROWS_PER_ITEM = 16  # output rows per parallel work item
TOKENS_PER_ITEM = 32  # tokens per work item: their x slices of one block stay in L1


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


@njit(nogil=True, cache=True)
def work_items(expert_ids, row_starts, num_experts, num_rows):
    """Split every group into (rows, tokens) tiles: [W, 4] of (expert, first row, first token, end token)."""
    num_row_blocks = (num_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    num_items = 0
    for g in range(expert_ids.shape[0]):
        if not 0 <= expert_ids[g] < num_experts or row_starts[g + 1] < row_starts[g]:
            raise ValueError("moe_matmul: expert_ids out of range or row_starts decreasing")
        num_tokens = row_starts[g + 1] - row_starts[g]
        num_items += num_row_blocks * ((num_tokens + TOKENS_PER_ITEM - 1) // TOKENS_PER_ITEM)
    items = np.empty((num_items, 4), dtype=np.int64)  # [W, 4]
    i = 0
    for g in range(expert_ids.shape[0]):
        for t0 in range(row_starts[g], row_starts[g + 1], TOKENS_PER_ITEM):
            t1 = min(t0 + TOKENS_PER_ITEM, row_starts[g + 1])
            for rb in range(num_row_blocks):
                items[i, 0] = expert_ids[g]
                items[i, 1] = rb * ROWS_PER_ITEM
                items[i, 2] = t0
                items[i, 3] = t1
                i += 1
    return items


def check_dequantize(raw, out, block_bytes, name):
    """Raise unless raw is uint8 [R, B] and out float32 [R, C] with B = C // 256 * block_bytes."""
    if (
        raw.dtype != np.uint8 or out.dtype != np.float32 or raw.ndim != 2 or out.ndim != 2
        or out.shape[0] != raw.shape[0] or out.shape[1] % QK_K or raw.shape[1] * QK_K != out.shape[1] * block_bytes
    ):
        raise ValueError(
            f"{name}: raw {raw.dtype} {raw.shape}, out {out.dtype} {out.shape} do not fit raw uint8 [R, B], "
            f"out float32 [R, C] with B = C // {QK_K} * {block_bytes}"
        )


def check_moe(raw, x, expert_ids, row_starts, out, block_bytes, name):
    """Raise unless the moe_matmul arguments have consistent shapes and dtypes."""
    if (
        raw.dtype != np.uint8 or raw.ndim != 3 or x.ndim != 2 or out.shape != (x.shape[0], raw.shape[1])
        or x.shape[1] % QK_K or raw.shape[2] * QK_K != x.shape[1] * block_bytes
        or x.dtype != np.float32 or out.dtype != np.float32
        or expert_ids.dtype != np.int64 or row_starts.dtype != np.int64
        or row_starts.shape != (expert_ids.shape[0] + 1,)
        or row_starts[0] != 0 or row_starts[-1] != x.shape[0]
    ):
        raise ValueError(
            f"{name}: raw {raw.dtype} {raw.shape}, x {x.dtype} {x.shape}, expert_ids {expert_ids.dtype} "
            f"{expert_ids.shape}, row_starts {row_starts.dtype} {row_starts.shape}, out {out.dtype} {out.shape} "
            f"do not fit raw uint8 [E, R, B] (B = C // {QK_K} * {block_bytes}), x float32 [N, C], "
            "expert_ids int64 [G], row_starts int64 [G+1] from 0 to N, out float32 [N, R]"
        )


def random_weight(rng, shape, block_bytes, scale_offsets, unit_rms, scale):
    """Random raw bytes [..., C // 256 * B] with the f16 scales at `scale_offsets` set so values have rms ~ scale.

    unit_rms: the rms of the dequantized values when those f16 scales are 1 (from the random quants).
    """
    *lead, num_cols = shape
    if num_cols % QK_K:
        raise ValueError(f"random_blocks: {num_cols} columns is not a multiple of {QK_K}")
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (num_cols // QK_K)
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)  # [blocks, B]
    d = (scale / unit_rms * rng.uniform(0.5, 1.5, size=num_blocks)).astype(np.float16)
    for offset, factor in scale_offsets:
        blocks[:, offset:offset + 2] = (d * np.float16(factor)).view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(*lead, num_cols // QK_K * block_bytes)
