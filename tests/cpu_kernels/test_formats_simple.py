"""Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 and TQ2_0 kernels against gguf's dequantizer and NumPy
float64 references (cpu_kernels.runs builds their block code)."""
import importlib
from functools import partial

import gguf
import numpy as np
import pytest

from cpu_kernels.tiles import DECODE_MAX_TOKENS

NAMES = ["iq4_xs", "q3_k", "q2_k", "mxfp4", "q4_1", "q5_0", "q5_1", "iq4_nl", "tq2_0"]
# A format's kernels take 10-30 s to compile cold: by default IQ4_XS's (the most used; test_fused compiles the
# same writable-array kernels) and Q2_K's (the only group mins and float prefill); the others are slow tests.
DEFAULT_KERNELS = {"iq4_xs", "q2_k"}
KERNEL_NAMES = [name if name in DEFAULT_KERNELS else pytest.param(name, marks=pytest.mark.slow) for name in NAMES]
R = 37  # odd rows, not a multiple of the 16-row work items
SCALE = 0.02


@pytest.fixture(scope="module", params=NAMES)
def fmt(request):
    """Each format module once per test module (its scalar dequantizer compiles on first use and is shared)."""
    return importlib.import_module(f"cpu_kernels.{request.param}")


@pytest.fixture(scope="module", params=KERNEL_NAMES)
def kfmt(request):
    """The format modules whose kernels the tests below compile and run."""
    return importlib.import_module(f"cpu_kernels.{request.param}")


def unpack(fmt, raw):
    """raw [R, B] -> f32 [R, C] through the format's scalar dequantizer row by row (what `dequantize` runs in
    parallel; the parallel wrapper is compiled by the slow test below)."""
    out = np.empty((raw.shape[0], raw.shape[1] // fmt.BLOCK_BYTES * fmt.BLOCK_SIZE), dtype=np.float32)
    for r in range(raw.shape[0]):
        fmt._unpack_row(raw[r], out[r])
    return out


def cols(fmt):
    """Columns of the test weights: 3 blocks (768 for super-block formats, 96 for 32-weight blocks)."""
    return 3 * fmt.BLOCK_SIZE


def weight(fmt, shape, seed):
    """Random valid raw bytes for `shape`, writable like the weights the CPU backend places (the array type
    test_fused compiles too)."""
    return fmt.random_blocks(np.random.default_rng(seed), shape, SCALE)


def random_bytes(fmt, num_blocks, seed):
    """[num_blocks, B] of random bytes, every bit pattern, with sane scales (finite f16 of both signs, E8M0 in
    2^-20..2^10) written over the format's scale fields: what gguf's dequantizer is compared with."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(num_blocks, fmt.BLOCK_BYTES), dtype=np.uint8)
    for at in fmt.HALF_OFFSETS:
        halves = (rng.uniform(1e-4, 1e-2, num_blocks) * rng.choice([-1, 1], num_blocks)).astype(np.float16)
        blocks[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    if fmt.QTYPE == gguf.GGMLQuantizationType.MXFP4:
        blocks[:, 0] = rng.integers(108, 138, size=num_blocks)
    return blocks


def dequant(fmt, raw):
    return gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64)


def reference(fmt, raw, x):
    """x [T, C] @ W.T in float64 and the float32 error bound: C * eps * (|x| @ |W|.T)."""
    w = dequant(fmt, raw)  # [R, C]
    x = x.astype(np.float64)
    return x @ w.T, x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)


def weight_parts(fmt, raw):
    """|W| for the rounding bounds: Q2_K's integer dot multiplies the rounded x with its scaled quants and its
    mins apart, so its bound takes |d * scale * q| + |dmin * min| per weight."""
    if hasattr(fmt, "abs_parts"):
        return fmt.abs_parts(raw)
    return np.abs(dequant(fmt, raw))


def assert_close(got, ref, bound):
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) - bound)


def test_dequantize_matches_gguf_on_random_blocks(fmt):
    raw = weight(fmt, (R, cols(fmt)), 0)
    assert np.array_equal(unpack(fmt, raw), gguf.quants.dequantize(raw, fmt.QTYPE))


def test_dequantize_matches_gguf_on_random_bytes(fmt):
    raw = random_bytes(fmt, 3 * R, 1).reshape(R, -1)
    assert np.array_equal(unpack(fmt, raw), gguf.quants.dequantize(raw, fmt.QTYPE))


@pytest.mark.slow
def test_public_dequantize(fmt):
    raw = random_bytes(fmt, 3 * R, 1).reshape(R, -1)
    out = np.empty((R, cols(fmt)), dtype=np.float32)
    fmt.dequantize(raw, out)
    assert np.array_equal(out, gguf.quants.dequantize(raw, fmt.QTYPE))


@pytest.mark.parametrize("name", ["iq4_xs", "iq4_nl", "mxfp4"])
def test_dequantize_every_level_and_exponent(name):
    """The table formats (IQ4_NL, IQ4_XS, MXFP4) on blocks whose index bytes run through all 256 values (every
    level in both nibbles), MXFP4 on every exponent byte that keeps its values finite, against gguf; their tables are gguf's."""
    fmt = importlib.import_module(f"cpu_kernels.{name}")
    table = gguf.quants.MXFP4 if fmt.QTYPE == gguf.GGMLQuantizationType.MXFP4 else gguf.quants.IQ4_NL
    assert np.array_equal(fmt.KVALUES, table.kvalues)
    blocks = random_bytes(fmt, 256, 8)
    header = fmt.BLOCK_BYTES - fmt.BLOCK_SIZE // 2  # the 4-bit indices fill the rest of a block
    blocks[:, header:] = (np.arange(blocks[:, header:].size) % 256).reshape(256, -1)
    if fmt.QTYPE == gguf.GGMLQuantizationType.MXFP4:
        blocks[:, 0] = np.minimum(np.arange(256), 250)  # 2^-128 (subnormal) .. 2^122 (more overflows float32)
    raw = blocks.reshape(1, -1)
    assert np.array_equal(unpack(fmt, raw), gguf.quants.dequantize(raw, fmt.QTYPE))


def test_matvec_and_matmul(kfmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    raw = weight(kfmt, (R, cols(kfmt)), 2)
    x = np.random.default_rng(3).standard_normal((33, cols(kfmt))).astype(np.float32)  # [T, C]
    ref, bound = reference(kfmt, raw, x)  # [T, R]
    w_abs = weight_parts(kfmt, raw)  # [R, C]
    decode_bound = bound[0] + act_rounding_bound(x[:1], w_abs, act_quant)[0]
    out = np.empty(R, dtype=np.float32)
    kfmt.matvec(raw, x[0], out, act_quant=act_quant)
    assert_close(out, ref[0], decode_bound)
    out = np.empty((33, R), dtype=np.float32)  # prefill: one 32-token pass and one more token
    kfmt.matmul(raw, x, out, act_quant=act_quant)
    assert_close(out, ref, bound + prefill_rounding_bound(kfmt, x, w_abs, act_quant))


def test_moe_matmul(kfmt, act_quant, act_rounding_bound, prefill_rounding_bound):
    num_experts = 4
    raw = weight(kfmt, (num_experts, R, cols(kfmt)), 4)  # [E, R, B]
    group_sizes = [3, 0, 1, 17]  # an empty group, a 1-row (decode) group
    expert_ids = np.array([3, 0, 2, 3], dtype=np.int64)  # [G], expert 3 twice, expert 1 unused
    row_starts = np.concatenate([[0], np.cumsum(group_sizes)]).astype(np.int64)  # [G+1]
    x = np.random.default_rng(5).standard_normal((row_starts[-1], cols(kfmt))).astype(np.float32)  # [N, C]
    out = np.full((len(x), R), np.nan, dtype=np.float32)  # [N, R]
    kfmt.moe_matmul(raw, x, expert_ids, row_starts, out, act_quant=act_quant)
    for g, e in enumerate(expert_ids):
        rows = slice(row_starts[g], row_starts[g + 1])
        ref, bound = reference(kfmt, raw[e], x[rows])
        # groups of a few tokens run the decode dots, token by token (tiles.DECODE_MAX_TOKENS)
        rounding = act_rounding_bound if group_sizes[g] <= DECODE_MAX_TOKENS else partial(prefill_rounding_bound, kfmt)
        assert_close(out[rows], ref, bound + rounding(x[rows], weight_parts(kfmt, raw[e]), act_quant))


def test_random_blocks_scale(fmt):
    raw = weight(fmt, (2, 16, 2 * fmt.BLOCK_SIZE), 6)
    assert raw.shape == (2, 16, 2 * fmt.BLOCK_BYTES) and raw.dtype == np.uint8
    w = dequant(fmt, raw)
    assert np.all(np.isfinite(w))
    assert 0.5 * SCALE < np.sqrt(np.mean(w ** 2)) < 2 * SCALE


def test_moe_matmul_rejects_bad_expert_ids(kfmt):
    raw = weight(kfmt, (2, R, cols(kfmt)), 7)
    out = np.empty((1, R), dtype=np.float32)
    with pytest.raises(ValueError):
        kfmt.moe_matmul(raw, np.zeros((1, cols(kfmt)), dtype=np.float32), np.array([2]), np.array([0, 1]), out)


FLOOR_PROBE = """
import hybrid  # applies STRATA_ISA_FLOOR before the kernels are imported
import importlib
import gguf
import numpy as np
rng = np.random.default_rng(0)
for name in NAMES:
    fmt = importlib.import_module(f"cpu_kernels.{name}")
    cols = 2 * max(fmt.BLOCK_SIZE, 96)
    raw = fmt.random_blocks(rng, (37, cols), 0.05)
    x = rng.standard_normal((33, cols)).astype(np.float32)
    ref = x @ gguf.quants.dequantize(raw, fmt.QTYPE).astype(np.float64).T
    for act_quant in ("float", "int16"):  # int16 runs as float below AVX2, but its dot still compiles
        out = np.empty((33, 37), np.float32)
        fmt.matmul(raw, x, out, act_quant=act_quant)
        fmt.matvec(raw, x[0], out[0], act_quant=act_quant)
        assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max(), (name, act_quant)
"""


@pytest.mark.slow
@pytest.mark.parametrize("floor", ["avx", "avx2"])
def test_formats_run_under_each_isa_floor(tmp_path, floor):
    """The block code (pshufb of 16 or 32 bytes, SSE2 or AVX2 pmaddwd, lane masks without AVX-512) compiles and
    computes right for the older CPUs users run (a fresh process and cache per floor, ~5 min cold)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "STRATA_ISA_FLOOR": floor, "NUMBA_CACHE_DIR": str(tmp_path)}
    probe = f"NAMES = {NAMES!r}\n" + FLOOR_PROBE
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
