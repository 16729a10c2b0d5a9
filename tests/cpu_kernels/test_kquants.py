"""Q4_K, Q5_K, Q6_K kernels against gguf's dequantizer and NumPy float64 references."""
from functools import partial

import gguf
import numpy as np
import pytest

from cpu_kernels import q4_k, q5_k, q6_k
from cpu_kernels.tiles import DECODE_MAX_TOKENS

FORMATS = [q4_k, q5_k, q6_k]
R, C = 37, 768  # odd rows; a multiple of 256 that is not a power of two
SCALE = 0.02
# byte offsets of the f16 scales in a block: d and dmin for Q4_K / Q5_K, d for Q6_K
HALF_OFFSETS = {q4_k: (0, 2), q5_k: (0, 2), q6_k: (208,)}
each_format = pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])


def weight(fmt, shape, seed):
    """Random valid raw bytes for `shape`, read-only like the memory-mapped GGUF tensors the kernels get."""
    raw = fmt.random_blocks(np.random.default_rng(seed), shape, SCALE)
    raw.setflags(write=False)
    return raw


def reference(fmt, raw, x):
    """x [T, C] @ W.T in float64 and the float32 error bound: C * eps * (|x| @ |W|.T), the worst case of a
    length-C float32 dot product summed in any order (the kernels reorder and fuse freely)."""
    w = gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)  # [R, C]
    x = x.astype(np.float64)
    return x @ w.T, x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)


def assert_close(got, ref, bound):
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


@each_format
def test_dequantize_matches_gguf_on_random_blocks(fmt):
    raw = weight(fmt, (R, C), 0)
    out = np.empty((R, C), dtype=np.float32)
    fmt.dequantize(raw, out)
    assert np.array_equal(out, gguf.quants.dequantize(raw, fmt.QTYPE))


@each_format
def test_dequantize_matches_gguf_on_random_bytes(fmt):
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(R * C // 256, fmt.BLOCK_BYTES), dtype=np.uint8)  # every bit pattern
    for offset in HALF_OFFSETS[fmt]:  # sane f16 scales of both signs instead of random NaN / inf patterns
        halves = (rng.uniform(1e-4, 1e-2, len(blocks)) * rng.choice([-1, 1], len(blocks))).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(R, -1)
    out = np.empty((R, C), dtype=np.float32)
    fmt.dequantize(raw, out)
    assert np.array_equal(out, gguf.quants.dequantize(raw, fmt.QTYPE))


@each_format
def test_matvec_and_matmul(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = weight(fmt, (R, C), 2)
    x = np.random.default_rng(3).standard_normal((70, C)).astype(np.float32)  # [T, C]
    ref, bound = reference(fmt, raw, x)  # [T, R]
    w_abs = np.abs(gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64))  # [R, C]
    decode_bound = bound[0] + act_rounding_bound(x[:1], w_abs, act_quant)[0]
    out = np.empty(R, dtype=np.float32)
    fmt.matvec(raw, x[0], out, act_quant=act_quant)
    assert_close(out, ref[0], decode_bound)
    for num_tokens in (1, 40, 70):  # decode, prefill past one 32-token pass, past one 64-token item
        out = np.empty((num_tokens, R), dtype=np.float32)
        fmt.matmul(raw, x[:num_tokens], out, act_quant=act_quant)
        prefill_bound = bound[:num_tokens] + prefill_rounding_bound(fmt, x[:num_tokens], w_abs, act_quant)
        assert_close(out, ref[:num_tokens], decode_bound if num_tokens == 1 else prefill_bound)


@each_format
def test_moe_matmul(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    num_experts = 5
    raw = weight(fmt, (num_experts, R, C), 4)  # [E, R, B]
    group_sizes = [3, 0, 1, 35, 2]  # an empty group, a 1-row (decode) group, one past a 32-token tile
    expert_ids = np.array([4, 0, 2, 1, 2], dtype=np.int64)  # [G], expert 2 twice, expert 3 unused
    row_starts = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)  # [G+1]
    x = np.random.default_rng(5).standard_normal((row_starts[-1], C)).astype(np.float32)  # [N, C]
    out = np.full((len(x), R), np.nan, dtype=np.float32)  # [N, R]
    fmt.moe_matmul(raw, x, expert_ids, row_starts, out, act_quant=act_quant)
    for g, e in enumerate(expert_ids):
        rows = slice(row_starts[g], row_starts[g + 1])
        ref, bound = reference(fmt, raw[e], x[rows])
        w_abs = np.abs(gguf.quants.dequantize(raw[e], fmt.QTYPE).astype(np.float64))
        rounding = act_rounding_bound if group_sizes[g] <= DECODE_MAX_TOKENS else partial(prefill_rounding_bound, fmt)
        bound = bound + rounding(x[rows], w_abs, act_quant)
        assert_close(out[rows], ref, bound)


@each_format
def test_random_blocks_scale(fmt):
    raw = weight(fmt, (2, 16, 512), 6)
    assert raw.shape == (2, 16, 2 * fmt.BLOCK_BYTES) and raw.dtype == np.uint8
    w = gguf.quants.dequantize(raw, fmt.QTYPE)
    assert np.all(np.isfinite(w))
    assert 0.5 * SCALE < np.sqrt(np.mean(w.astype(np.float64) ** 2)) < 2 * SCALE


@each_format
def test_moe_matmul_rejects_bad_expert_ids(fmt):
    raw = weight(fmt, (2, R, C), 7)
    x = np.zeros((1, C), dtype=np.float32)
    out = np.empty((1, R), dtype=np.float32)
    with pytest.raises(ValueError):
        fmt.moe_matmul(raw, x, np.array([2]), np.array([0, 1]), out)
