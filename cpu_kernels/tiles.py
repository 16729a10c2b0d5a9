"""Work split, prefill tile math and argument checks shared by the F32, F16, BF16, Q8_0 and Q4_0 kernels.

A work item is (group, first row, first token, end token): ROWS_PER_ITEM output
rows of one expert for at most TOKENS_PER_ITEM of its tokens. Decode items (one
token) dot each row straight from its blocks; prefill items unpack UNPACK_ROWS
rows to float32 once and dot them with every token of the item.

Shape legend: R output rows, C columns, B bytes per row, T tokens, E experts,
N (token, expert) rows sorted by group, G groups, W work items, K = UNPACK_ROWS.
"""
import numpy as np
from numba import njit

ROWS_PER_ITEM = 16  # output rows per parallel work item
TOKENS_PER_ITEM = 32  # tokens per work item: their x rows stay in L2
UNPACK_ROWS = 4  # rows unpacked to float together: each x load feeds 4 FMAs

ONE_EXPERT = np.zeros(1, dtype=np.int64)  # expert_ids of a plain matmul


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


@njit(inline="always", nogil=True, cache=True)
def dot_unpacked(w, num_rows, x, t0, t1, out, r0):
    """out[t0:t1, r0:r0 + num_rows] = x[t0:t1] @ w[:num_rows].T; w f32 [K, C] (rows past num_rows are ignored)."""
    for t in range(t0, t1):
        a0 = np.float32(0)
        a1 = np.float32(0)
        a2 = np.float32(0)
        a3 = np.float32(0)
        for c in range(w.shape[1]):
            xc = x[t, c]
            a0 += w[0, c] * xc
            a1 += w[1, c] * xc
            a2 += w[2, c] * xc
            a3 += w[3, c] * xc
        acc = (a0, a1, a2, a3)
        for k in range(num_rows):
            out[t, r0 + k] = acc[k]


def num_cols(raw, block_size, block_bytes, name):
    """C of raw uint8 [..., B]; raises unless B is whole blocks."""
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % block_bytes:
        raise ValueError(f"{name}: raw {raw.dtype} {raw.shape} is not uint8 rows of {block_bytes}-byte blocks")
    return raw.shape[-1] // block_bytes * block_size


def check_dequantize(raw, out, block_size, block_bytes, name):
    """Raise unless out is f32 [..., C] matching raw [..., B]."""
    cols = num_cols(raw, block_size, block_bytes, name)
    if out.dtype != np.float32 or out.shape != (*raw.shape[:-1], cols):
        raise ValueError(f"{name}.dequantize: out {out.dtype} {out.shape} should be float32 {(*raw.shape[:-1], cols)}")


def check_moe(raw, x, expert_ids, row_starts, out, block_size, block_bytes, name):
    """Raise unless the moe_matmul arguments have consistent shapes and dtypes."""
    cols = num_cols(raw, block_size, block_bytes, name)
    if (
        raw.ndim != 3 or x.ndim != 2 or x.shape[1] != cols or out.shape != (x.shape[0], raw.shape[1])
        or x.dtype != np.float32 or out.dtype != np.float32
        or expert_ids.dtype != np.int64 or row_starts.dtype != np.int64
        or row_starts.shape != (expert_ids.shape[0] + 1,)
        or row_starts[0] != 0 or row_starts[-1] != x.shape[0]
    ):
        raise ValueError(
            f"{name}.moe_matmul: raw {raw.shape}, x {x.dtype} {x.shape}, expert_ids {expert_ids.dtype} "
            f"{expert_ids.shape}, row_starts {row_starts.dtype} {row_starts.shape}, out {out.dtype} {out.shape} "
            f"do not fit raw [E, R, B], x f32 [N, {cols}], int64 [G], int64 [G+1] from 0 to N, out f32 [N, R]"
        )


def random_scales(rng, num_blocks, scale):
    """[num_blocks, 2] uint8: little-endian f16 block scales of about `scale` (0.5x to 1.5x, random sign)."""
    d = scale * rng.uniform(0.5, 1.5, size=num_blocks) * rng.choice([-1.0, 1.0], size=num_blocks)
    return d.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)
