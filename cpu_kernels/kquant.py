"""Pieces shared by the K-quant formats (Q4_K, Q5_K, Q6_K): super-blocks of 256 weights.

Shape legend: R output rows, C columns, B bytes per row, T tokens, E experts,
N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from numba import njit

QK_K = 256  # weights per super-block
SUB = 32  # weights per sub-block of Q4_K / Q5_K (and per quant run of Q6_K)
ROWS_PER_ITEM = 16  # output rows per parallel work item
TOKENS_PER_ITEM = 32  # tokens per work item: their x slices of one block stay in L1


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


@njit(nogil=True, cache=True)
def sub_sums(x):
    """x [N, C] -> [N, C // 32]: the sum of each 32-column run (the part the sub-block mins multiply)."""
    num_sub = x.shape[1] // SUB
    sums = np.empty((x.shape[0], num_sub), dtype=np.float32)  # [N, C // 32]
    for n in range(x.shape[0]):
        for s in range(num_sub):
            acc = np.float32(0)
            for l in range(SUB):
                acc += x[n, s * SUB + l]
            sums[n, s] = acc
    return sums


@njit(nogil=True, cache=True)
def work_items(row_starts, num_rows):
    """Split every group into (rows, tokens) tiles: [W, 4] of (group, first row, first token, end token)."""
    num_row_blocks = (num_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    num_items = 0
    for g in range(row_starts.shape[0] - 1):
        num_tokens = row_starts[g + 1] - row_starts[g]
        num_items += num_row_blocks * ((num_tokens + TOKENS_PER_ITEM - 1) // TOKENS_PER_ITEM)
    items = np.empty((num_items, 4), dtype=np.int64)  # [W, 4]
    i = 0
    for g in range(row_starts.shape[0] - 1):
        for t0 in range(row_starts[g], row_starts[g + 1], TOKENS_PER_ITEM):
            t1 = min(t0 + TOKENS_PER_ITEM, row_starts[g + 1])
            for rb in range(num_row_blocks):
                items[i, 0] = g
                items[i, 1] = rb * ROWS_PER_ITEM
                items[i, 2] = t0
                items[i, 3] = t1
                i += 1
    return items


def check_weight(raw, num_cols, block_bytes, name):
    """Raise if raw [..., B] is not uint8 K-quant bytes for `num_cols` columns."""
    if raw.dtype != np.uint8 or raw.shape[-1] * QK_K != num_cols * block_bytes or num_cols % QK_K:
        raise ValueError(
            f"{name}: raw {raw.dtype} {raw.shape} is not uint8 rows of {num_cols} columns "
            f"({block_bytes} bytes per {QK_K} weights)"
        )


def check_moe(raw, x, expert_ids, row_starts, out, block_bytes, name):
    """Raise unless the moe_matmul arguments have consistent shapes and dtypes."""
    check_weight(raw, x.shape[-1], block_bytes, name)
    if (
        raw.ndim != 3 or x.ndim != 2 or out.shape != (x.shape[0], raw.shape[1])
        or x.dtype != np.float32 or out.dtype != np.float32
        or expert_ids.dtype != np.int64 or row_starts.dtype != np.int64
        or row_starts.shape != (expert_ids.shape[0] + 1,)
        or row_starts[0] != 0 or row_starts[-1] != x.shape[0]
    ):
        raise ValueError(
            f"{name}.moe_matmul: raw {raw.shape}, x {x.dtype} {x.shape}, expert_ids {expert_ids.dtype} "
            f"{expert_ids.shape}, row_starts {row_starts.dtype} {row_starts.shape}, out {out.dtype} {out.shape} "
            "do not fit raw [E, R, B], x f32 [N, C], int64 [G], int64 [G+1] from 0 to N, out f32 [N, R]"
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
