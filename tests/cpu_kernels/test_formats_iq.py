"""The grid IQ formats' kernels against gguf's dequantizer and float64 NumPy references, and their grid and
sign tables against gguf-py's."""
from functools import partial

import gguf
import numpy as np
import pytest
from gguf import quants

from cpu_kernels import iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs, iq_grids
from cpu_kernels.tiles import DECODE_MAX_TOKENS

FORMATS = [iq3_s, iq2_xxs, iq3_xxs, iq2_xs, iq2_s, iq1_s, iq1_m]
R, C = 37, 512  # odd rows, two super-blocks
SCALE = 0.02
each_format = pytest.mark.parametrize("fmt", FORMATS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
# Kernel tests run by default for IQ3_S, the grid format users run most (test_fused compiles its moe kernels with
# the same argument types, so it adds little but run time); the rest are slow (each costs its own cold compile).
KERNEL_PARAMS = [fmt if fmt is iq3_s else pytest.param(fmt, marks=pytest.mark.slow) for fmt in FORMATS]
each_kernel = pytest.mark.parametrize("fmt", KERNEL_PARAMS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])


def _name(fmt):
    return fmt.__name__.rsplit(".", 1)[-1]


@pytest.mark.parametrize("name, table", [("IQ2_XXS", iq_grids.IQ2_XXS), ("IQ2_XS", iq_grids.IQ2_XS),
                                         ("IQ2_S", iq_grids.IQ2_S), ("IQ3_XXS", iq_grids.IQ3_XXS),
                                         ("IQ3_S", iq_grids.IQ3_S), ("IQ1_S", iq_grids.IQ1), ("IQ1_M", iq_grids.IQ1)])
def test_grids_match_gguf(name, table):
    quant = getattr(quants, name)
    quant.init_grid()
    assert np.array_equal(quant.grid.reshape(table.shape), table.astype(np.float32))


def test_sign_bytes_match_gguf():
    assert np.array_equal(iq_grids.KSIGNS, np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8))


def _halves(rng, n):
    """n sane little-endian f16 scales of both signs, as [n, 2] bytes."""
    d = (rng.uniform(1e-4, 1e-2, n) * rng.choice([-1, 1], n)).astype(np.float16)
    return d.view(np.uint8).reshape(n, 2)


def _words(values):
    """uint32 [n, k] -> their little-endian bytes [n, 4k]."""
    return np.ascontiguousarray(values, dtype="<u4").view(np.uint8).reshape(len(values), -1)


def _cover_iq3_s(rng):
    """Blocks whose 64 grid indices run through all 512 and whose sign bytes through all 256."""
    n = 8
    blocks = rng.integers(0, 256, size=(n, iq3_s.BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :2] = _halves(rng, n)
    indices = np.arange(512).reshape(n, 64)
    blocks[:, 2:66] = indices & 255
    blocks[:, 66:74] = np.packbits((indices >> 8).reshape(n, 8, 8).astype(np.uint8), axis=-1,
                                   bitorder="little").reshape(n, 8)
    blocks[:, 74:106] = np.arange(256).reshape(n, 32)
    return blocks


def _cover_ksigns_words(rng, n, first_sign):
    """[n, 8] uint32 words of 4 7-bit sign indices (all 128 from sign index first_sign on) and a random scale."""
    signs = (np.arange(n * 32) + first_sign).reshape(n, 8, 4) % 128
    words = (signs << np.array([0, 7, 14, 21])).sum(axis=-1)
    return (words | rng.integers(0, 16, size=(n, 8)) << 28).astype(np.uint32)


def _cover_iq2_xxs(rng):
    """Blocks whose grid indices run through all 256 and sign indices through all 128."""
    n = 8
    runs = np.empty((n, 8, 8), dtype=np.uint8)
    runs[:, :, :4] = np.arange(256).reshape(n, 8, 4)
    runs[:, :, 4:] = _words(_cover_ksigns_words(rng, n, 0).reshape(-1, 1)).reshape(n, 8, 4)
    return np.concatenate([_halves(rng, n), runs.reshape(n, 64)], axis=1)


def _cover_iq3_xxs(rng):
    """Blocks whose grid indices run through all 256 and sign indices through all 128."""
    n = 4
    indices = np.arange(256).reshape(n, 64).astype(np.uint8)
    return np.concatenate([_halves(rng, n), indices, _words(_cover_ksigns_words(rng, n, 0))], axis=1)


def _cover_iq2_xs(rng):
    """Blocks whose grid indices run through all 512 and sign indices through all 128."""
    n = 16
    entries = np.arange(512).reshape(n, 32)
    words = (entries | (entries % 128) << 9).astype("<u2").view(np.uint8)
    scales = rng.integers(0, 256, size=(n, 8), dtype=np.uint8)
    return np.concatenate([_halves(rng, n), words, scales], axis=1)


def _cover_iq2_s(rng):
    """Blocks whose grid indices run through all 1024 and sign bytes through all 256."""
    n = 32
    indices = np.arange(1024).reshape(n, 32)
    high = ((indices >> 8).reshape(n, 8, 4) << np.array([0, 2, 4, 6])).sum(axis=-1).astype(np.uint8)
    signs = (np.arange(n * 32) % 256).reshape(n, 32).astype(np.uint8)
    scales = rng.integers(0, 256, size=(n, 8), dtype=np.uint8)
    return np.concatenate([_halves(rng, n), (indices & 255).astype(np.uint8), signs, high, scales], axis=1)


def _cover_iq1_s(rng):
    """Blocks whose grid indices run through all 2048, with both delta signs and every scale."""
    n = 64
    indices = np.arange(2048).reshape(n, 32)
    words = ((indices >> 8).reshape(n, 8, 4) << np.array([0, 3, 6, 9])).sum(axis=-1)
    words |= (np.arange(n * 8).reshape(n, 8) % 16) << 12  # scale and delta sign
    return np.concatenate([_halves(rng, n), (indices & 255).astype(np.uint8), words.astype("<u2").view(np.uint8)],
                          axis=1)


def _cover_iq1_m(rng):
    """Blocks whose grid indices run through all 2048, with both delta signs and every scale."""
    n = 64
    indices = np.arange(2048).reshape(n, 32)
    nibbles = (indices >> 8) | (np.arange(n * 32).reshape(n, 32) // 3 % 2) << 3  # [n, 32]
    high = (nibbles[:, 0::2] | nibbles[:, 1::2] << 4).astype(np.uint8)
    blocks = np.concatenate([(indices & 255).astype(np.uint8), high, rng.integers(0, 256, size=(n, 8), dtype=np.uint8)],
                            axis=1)
    iq1_m.set_d(blocks, _halves(rng, n).view(np.float16)[:, 0])
    return blocks


COVER = {iq3_s: _cover_iq3_s, iq2_xxs: _cover_iq2_xxs, iq3_xxs: _cover_iq3_xxs, iq2_xs: _cover_iq2_xs,
         iq2_s: _cover_iq2_s, iq1_s: _cover_iq1_s, iq1_m: _cover_iq1_m}


def _set_d(fmt, blocks, bits):
    """Set the f16 d of blocks uint8 [n, block bytes] to the bit pattern `bits`."""
    halves = np.full(len(blocks), bits, dtype="<u2")
    if fmt is iq1_m:
        iq1_m.set_d(blocks, halves.view(np.float16))
    else:
        blocks[:, :2] = halves.view(np.uint8).reshape(-1, 2)


def _dequantize(fmt, raw):
    out = np.empty((*raw.shape[:-1], raw.shape[-1] // fmt.BLOCK_BYTES * fmt.BLOCK_SIZE), dtype=np.float32)
    fmt.dequantize(raw, out)
    return out


@each_format
def test_dequantize_matches_gguf(fmt):
    """Random blocks, odd f16 scales (subnormal, negative, zero), and blocks of every grid row and sign pattern."""
    rng = np.random.default_rng(0)
    raw = fmt.random_blocks(rng, (R, C), SCALE)
    for row, bits in ((0, 0x0001), (1, 0x8203), (2, 0xB400), (3, 0x0000)):
        _set_d(fmt, raw[row].reshape(-1, fmt.BLOCK_BYTES), bits)
    assert np.array_equal(_dequantize(fmt, raw), gguf.quants.dequantize(raw, fmt.QTYPE))
    cover = COVER[fmt](rng)
    assert np.array_equal(_dequantize(fmt, cover), gguf.quants.dequantize(cover, fmt.QTYPE))


@each_format
def test_random_blocks_scale(fmt):
    w = gguf.quants.dequantize(fmt.random_blocks(np.random.default_rng(1), (2, 16, 512), SCALE), fmt.QTYPE)
    assert np.all(np.isfinite(w))
    assert 0.7 * SCALE < np.sqrt(np.mean(w.astype(np.float64) ** 2)) < 1.4 * SCALE


def _reference(fmt, raw, x):
    """x [T, C] @ W.T in float64 and the float32 error bound C * eps * (|x| @ |W|.T) (any summation order)."""
    w = gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)  # [R, C]
    x = x.astype(np.float64)
    return x @ w.T, x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T), np.abs(w)


def _assert_close(got, ref, bound):
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


@each_kernel
def test_matvec_and_matmul(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = fmt.random_blocks(np.random.default_rng(2), (R, C), SCALE)  # writable: test_fused compiled these types
    x = np.random.default_rng(3).standard_normal((33, C)).astype(np.float32)  # [T, C]
    ref, bound, w_abs = _reference(fmt, raw, x)  # [T, R]
    decode_bound = bound[0] + act_rounding_bound(x[:1], w_abs, act_quant)[0]
    out = np.empty(R, dtype=np.float32)
    fmt.matvec(raw, x[0], out, act_quant=act_quant)
    _assert_close(out, ref[0], decode_bound)
    fmt.matvec(raw, x[0], out, serial=True, act_quant=act_quant)
    _assert_close(out, ref[0], decode_bound)
    out = np.empty((33, R), dtype=np.float32)  # prefill past one 32-token pass
    fmt.matmul(raw, x, out, act_quant=act_quant)
    _assert_close(out, ref, bound + prefill_rounding_bound(fmt, x, w_abs, act_quant))


@each_kernel
def test_kernels_cover_every_grid_row(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    """The decode dots and the prefill on blocks of every grid row and sign pattern (IQ3_S looks its grid up by
    byte permutes over table quarters where the CPU has VBMI: every quarter and both nibbles are read)."""
    raw = COVER[fmt](np.random.default_rng(7))  # [R, B]: rows of one block
    x = np.random.default_rng(8).standard_normal((33, fmt.BLOCK_SIZE)).astype(np.float32)  # [T, C]
    ref, bound, w_abs = _reference(fmt, raw, x)
    out = np.empty(len(raw), dtype=np.float32)
    fmt.matvec(raw, x[0], out, serial=True, act_quant=act_quant)
    _assert_close(out, ref[0], bound[0] + act_rounding_bound(x[:1], w_abs, act_quant)[0])
    out = np.empty((len(x), len(raw)), dtype=np.float32)
    fmt.matmul(raw, x, out, act_quant=act_quant)
    _assert_close(out, ref, bound + prefill_rounding_bound(fmt, x, w_abs, act_quant))


@each_kernel
def test_moe_matmul(fmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = fmt.random_blocks(np.random.default_rng(4), (5, R, C), SCALE)  # [E, R, B]
    group_sizes = [3, 0, 1, 33, 2]  # an empty group, a 1-row (decode) group, one past a 32-token pass
    expert_ids = np.array([4, 0, 2, 1, 2], dtype=np.int64)  # [G], expert 2 twice, expert 3 unused
    row_starts = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)  # [G+1]
    x = np.random.default_rng(5).standard_normal((row_starts[-1], C)).astype(np.float32)  # [N, C]
    out = np.full((len(x), R), np.nan, dtype=np.float32)  # [N, R]
    fmt.moe_matmul(raw, x, expert_ids, row_starts, out, act_quant=act_quant)
    out_b = np.full_like(out, np.nan)
    fmt.moe_matmul_pair(raw, raw[::-1].copy(), x, expert_ids, row_starts, out, out_b, act_quant=act_quant)
    for g, e in enumerate(expert_ids):
        rows = slice(row_starts[g], row_starts[g + 1])
        rounding = act_rounding_bound if group_sizes[g] <= DECODE_MAX_TOKENS else partial(prefill_rounding_bound, fmt)
        for got, expert in ((out, raw[e]), (out_b, raw[4 - e])):
            ref, bound, w_abs = _reference(fmt, expert, x[rows])
            _assert_close(got[rows], ref, bound + rounding(x[rows], w_abs, act_quant))


@each_format
def test_moe_matmul_rejects_bad_shapes(fmt):
    raw = fmt.random_blocks(np.random.default_rng(6), (2, R, C), SCALE)
    x = np.zeros((3, C + 256), dtype=np.float32)
    with pytest.raises(ValueError, match=_name(fmt)):
        fmt.moe_matmul(raw, x, np.zeros(1, np.int64), np.array([0, 3]), np.empty((3, R), np.float32))
