"""F32, F16, BF16, Q8_0 and Q4_0 kernels vs gguf's dequantize and float64 NumPy references."""
from functools import partial

import gguf
import numpy as np
import pytest
from numba import njit

from cpu_kernels import bf16, dense, f16, f32, q4_0, q8_0
from cpu_kernels.tiles import DECODE_MAX_TOKENS

FORMATS = [f32, f16, bf16, q8_0, q4_0]
ROWS = 37  # odd, and not a multiple of the 16-row work items or 4-row unpack tiles
COLS = 160  # 5 blocks of 32: not a power of two
# Kernels sum in float32 (fastmath may reorder); dequantized weights are exact, so the only
# error is float32 accumulation over COLS terms: ~sqrt(COLS) * 2^-24 relative to the largest
# output. 1e-5 of max|ref| leaves ~50x margin over that while catching any wrong weight.
REL_TOL = 1e-5
# Read-only weights (memory-mapped GGUF tensors) are a Numba instance of their own: q8_0 checks the block formats'
# driver (tests/hybrid/test_cpu_backend.py runs those instances too), bf16 the float formats'; the other formats take
# writable weights, as the engine's copied ones are, and share its instances
READ_ONLY = {bf16, q8_0}


def _weights(fmt, shape, seed=0):
    return fmt.random_blocks(np.random.default_rng(seed), shape, 0.02)


def _dequant(fmt, raw):
    return gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)


def _assert_close(got, ref, extra=0.0):
    """got within REL_TOL of max|ref| of ref, plus `extra` (the int16 / int8 rounding bound of each output)."""
    assert np.all(np.abs(got - ref) <= REL_TOL * np.abs(ref).max() + extra)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__)
def test_dequantize_matches_gguf_bitwise(fmt):
    raw = _weights(fmt, (ROWS, COLS))
    if fmt.BLOCK_SIZE > 1:  # odd f16 scales: subnormal, negative subnormal, negative, zero
        for row, bits in ((0, 0x0001), (1, 0x8203), (2, 0xB400), (3, 0x0000)):
            raw[row, 0:2] = np.array([bits], dtype="<u2").view(np.uint8)
    out = np.empty((ROWS, COLS), dtype=np.float32)
    fmt.dequantize(raw, out)
    assert np.array_equal(out, gguf.quants.dequantize(raw, fmt.QTYPE))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("num_tokens", [1, 40])
def test_matmul_and_matvec_match_numpy(fmt, num_tokens, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = _weights(fmt, (ROWS, COLS))
    raw.flags.writeable = fmt not in READ_ONLY  # kernels must accept read-only (memory-mapped) weights
    x = np.random.default_rng(1).standard_normal((num_tokens, COLS), dtype=np.float32)  # [T, C]
    w = _dequant(fmt, raw)  # [R, C]
    ref = x.astype(np.float64) @ w.T  # [T, R]
    extra = (act_rounding_bound if num_tokens == 1 else partial(prefill_rounding_bound, fmt))(x, np.abs(w), act_quant)
    out = np.empty((num_tokens, ROWS), dtype=np.float32)
    fmt.matmul(raw, x, out, act_quant=act_quant)
    _assert_close(out, ref, extra)
    vec = np.empty(ROWS, dtype=np.float32)
    fmt.matvec(raw, x[0], vec, act_quant=act_quant)
    _assert_close(vec, ref[0], act_rounding_bound(x[:1], np.abs(w), act_quant)[0])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__)
def test_moe_matmul_matches_numpy(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = _weights(fmt, (5, ROWS, COLS))  # [E, R, B]
    expert_ids = np.array([3, 0, 4, 1, 3], dtype=np.int64)  # [G]; expert 3 twice
    sizes = [2, 0, 1, 35, 3]  # an empty group, a one-row group, one past a 32-token work item
    row_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [G+1]
    x = np.random.default_rng(2).standard_normal((row_starts[-1], COLS), dtype=np.float32)  # [N, C]
    out = np.full((row_starts[-1], ROWS), np.nan, dtype=np.float32)  # [N, R]
    fmt.moe_matmul(raw, x, expert_ids, row_starts, out, act_quant=act_quant)
    weights = _dequant(fmt, raw)  # [E, R, C]
    for g, e in enumerate(expert_ids):
        rows = slice(row_starts[g], row_starts[g + 1])
        if rows.start == rows.stop:
            continue
        ref = x[rows].astype(np.float64) @ weights[e].T
        decode = row_starts[g + 1] - row_starts[g] <= DECODE_MAX_TOKENS  # groups of a few tokens take the decode dots
        bound = act_rounding_bound if decode else partial(prefill_rounding_bound, fmt)
        _assert_close(out[rows], ref, bound(x[rows], np.abs(weights[e]), act_quant))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__)
def test_moe_matmul_rejects_bad_shapes(fmt):
    raw = _weights(fmt, (2, ROWS, COLS))
    x = np.zeros((3, COLS + fmt.BLOCK_SIZE), dtype=np.float32)
    with pytest.raises(ValueError, match=fmt.__name__):
        fmt.moe_matmul(raw, x, np.zeros(1, np.int64), np.array([0, 3]), np.empty((3, ROWS), np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__)
def test_random_blocks_are_finite_with_requested_scale(fmt):
    raw = _weights(fmt, (3, 64, COLS))
    assert raw.dtype == np.uint8 and raw.shape == (3, 64, COLS // fmt.BLOCK_SIZE * fmt.BLOCK_BYTES)
    values = gguf.quants.dequantize(raw, fmt.QTYPE)
    assert np.isfinite(values).all()
    assert 0.01 < np.abs(values).mean() < 0.04  # asked for 0.02


def test_f16_kernels_widen_every_finite_half_exactly():
    """Subnormal halves take a separate branch-free path in the F16 kernels: check each half bit pattern."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]  # [62 * 1024]: all but inf and NaN
    raw = finite.view(np.uint8).reshape(62, 2048)  # [R, B]: every finite half once, zeros and subnormals included
    ref = finite.view(np.float16).astype(np.float32).reshape(62, 1024)  # [R, C]
    eye = np.eye(1024, dtype=np.float32)  # [T, C]: token t picks column t, so x @ W.T is W.T exactly
    out = np.empty((1024, 62), dtype=np.float32)
    f16.matmul(raw, eye, out)
    assert np.array_equal(out, ref.T)
    vec = np.empty(62, dtype=np.float32)
    for c in (0, 1, 513, 1023):  # decode dots each row from its words
        f16.matvec(raw, eye[c], vec)
        assert np.array_equal(vec, ref[:, c])


@njit
def _halves_by_integers(words):
    out = np.empty(words.shape[0], dtype=np.float32)
    for i in range(words.shape[0]):
        out[i] = dense.half_by_integers(words[i], dense.HALF)
    return out


def test_integer_half_conversion_for_targets_without_f16c_is_exact():
    """Hosts with F16C widen halves in hardware; the integer recipe the others use, on every finite half."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00]
    assert np.array_equal(_halves_by_integers(finite), finite.view(np.float16).astype(np.float32))
