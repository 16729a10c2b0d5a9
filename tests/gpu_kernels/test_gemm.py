"""The prompt chunks' tiled GEMM (gpu_kernels/gemm.py, src/gemm.cu): which launches take it, and (marked gpu) its
results against NumPy on gguf's dequantized weights at prefill sizes, with ragged row and token edges."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gpu_kernels.gemm import (GEMM_FORMATS, GEMM_MIN_PAIRS, GEMM_TOKENS, MOE_GEMM_TOKENS, gemm_fits, moe_tile_tokens,
                              split_count)
from hybrid.backends.gpu_experts import work_tiles
from hybrid.formats.synthetic import encode

FORMATS = [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_K, Q.F16, Q.BF16, Q.F32]
TOL = 1e-5  # float32 sums of the dequantized weights against float64


def rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def quant(rng, qtype, shape):
    return encode("w", rng.standard_normal(shape).astype(np.float32), qtype, rng).raw


def reference(raw, qtype, x):
    """x [T, C] @ gguf's dequantized raw [R, B] in float64."""
    return x.astype(np.float64) @ np.asarray(gguf_dequantize(raw, qtype), np.float64).T


def test_tile_tokens_take_the_gemm_where_every_projection_fits():
    fits = ((Q.Q4_K, 2048), (Q.Q4_K, 2048), (Q.Q6_K, 768))
    assert moe_tile_tokens(fits, 4096, 128, 8) == MOE_GEMM_TOKENS
    assert moe_tile_tokens(fits, GEMM_MIN_PAIRS * 128 - 1, 128, 8) == 8  # few pairs an expert: the 8-row tiles
    assert moe_tile_tokens(fits[:2] + ((Q.IQ3_S, 768),), 4096, 128, 8) == 8  # a format without the GEMM
    assert moe_tile_tokens(((Q.F32, 40),), 4096, 128, 8) == 8  # columns not whole stages
    assert moe_tile_tokens(fits, 0, 0, 8) == 8
    assert all(gemm_fits(q, 256) for q in FORMATS) and set(FORMATS) == GEMM_FORMATS


def test_column_splits_until_the_blocks_fill_the_target():
    assert split_count(64, 8, 132) == 4  # [512, 2048] Q4_K at 512 tokens in 32-token blocks on 132 multiprocessors
    assert split_count(16, 64, 132) == 8  # the router [128, 2048] F32
    assert split_count(128, 16, 132) == 2
    assert split_count(256, 8, 132) == 1
    assert split_count(32, 3, 132) == 1  # splits divide the stages
    assert split_count(1, 64, 132) == 8  # GEMM_MAX_SPLITS


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [17, 64, 200, 512])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_gemm_matches_numpy(runtime, kernels, qtype, num_tokens):
    """Rows past the last block's (200 = 128 + 72) and tokens past the last tile's; through Kernels.matmul, which
    takes the GEMM from GEMM_MIN_TOKENS tokens."""
    rng = np.random.default_rng(int(qtype) * 1000 + num_tokens)
    raw = quant(rng, qtype, (200, 768))  # [R, B]
    x = rng.standard_normal((num_tokens, 768)).astype(np.float32)  # [T, C]
    out = runtime.empty((num_tokens, 200), np.float32)
    kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    assert rel_err(runtime.to_host(out), reference(raw, qtype, x)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.F32], ids=lambda q: q.name)
def test_gemm_rows_not_a_multiple_of_four(runtime, kernels, qtype):
    """67 rows: the stores of the last rows one by one (no float4 past the row's end)."""
    rng = np.random.default_rng(int(qtype))
    raw = quant(rng, qtype, (67, 512))  # [R, B]
    x = rng.standard_normal((70, 512)).astype(np.float32)  # [T, C]
    out = runtime.zeros((70, 67), np.float32)
    kernels.gemm(runtime.to_device(raw), qtype, runtime.to_device(x), out)
    assert rel_err(runtime.to_host(out), reference(raw, qtype, x)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile_tokens", [MOE_GEMM_TOKENS, GEMM_TOKENS])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_moe_gemm_uneven_tiles(runtime, kernels, qtype, tile_tokens):
    """Groups of 70 (full tiles and a short one), none, 1, 64, 200 and 17 rows, slots in another order than the
    groups, through Kernels.moe_matmul with tiles of 32 (gemm32) and 64 (gemm) rows."""
    rng = np.random.default_rng(int(qtype) + 7)
    raw = quant(rng, qtype, (6, 200, 768))  # [S, R, B]
    sizes = np.array([70, 0, 1, 64, 200, 17])
    slots = np.flatnonzero(sizes)[::-1].copy()
    row_starts = np.concatenate([[0], np.cumsum(sizes[slots])])
    tiles = work_tiles(row_starts, slots, tile_tokens)  # [3, W]
    x = rng.standard_normal((row_starts[-1], 768)).astype(np.float32)  # [N, C]
    out = runtime.empty((len(x), 200), np.float32)
    kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out,
                       *[runtime.to_device(np.ascontiguousarray(t)) for t in tiles], tile_tokens=tile_tokens)
    ref = np.empty((len(x), 200), np.float64)
    for slot, start, stop in zip(slots, row_starts[:-1], row_starts[1:]):
        ref[start:stop] = reference(raw[slot], qtype, x[start:stop])
    assert rel_err(runtime.to_host(out), ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.F16, Q.F32], ids=lambda q: q.name)
def test_gemm_plans(runtime, qtype):
    """Dense GEMMs at each of Kernels.gemm's plans: 64-token blocks, 32-token ones (few row blocks), and columns split
    (their partial sums added by gemm_reduce; a later, larger one grows the scratch), with split_columns on and off."""
    from gpu_kernels.kernels import Kernels

    kernels = Kernels(runtime)
    rng = np.random.default_rng(int(qtype) + 99)
    plans = set()
    for num_rows, num_tokens in ((200, 130), (128, 512), (260, 256), (4096, 300)):
        raw = runtime.to_device(quant(rng, qtype, (num_rows, 2048)))  # [R, B]
        x = rng.standard_normal((num_tokens, 2048)).astype(np.float32)  # [T, C]
        for split in (True, False):
            kernels.split_columns = split
            plans.add(kernels.gemm_plan(qtype, num_tokens, num_rows, 2048))
            out = runtime.empty((num_tokens, num_rows), np.float32)
            kernels.matmul(raw, qtype, runtime.to_device(x), out)
            assert rel_err(runtime.to_host(out), reference(runtime.to_host(raw), qtype, x)) < TOL
    assert {tokens for tokens, _ in plans} == {MOE_GEMM_TOKENS, GEMM_TOKENS} and max(s for _, s in plans) > 1


@pytest.mark.parametrize("qtype", [Q.Q6_K, pytest.param(Q.Q5_K, marks=pytest.mark.slow)], ids=lambda q: q.name)
def test_gemm_modules_compile_for_sm86(qtype):
    """The GEMM's largest static shared memory (Q6_K 47.6 KB at 32 tokens, Q5_K at 64) within an Ampere block's 48 KB;
    test_compile.py builds every module for sm_90."""
    from gpu_kernels.nvrtc import Nvrtc, find_library
    from gpu_kernels.sources import matmul_kernels, module_name, module_source

    if find_library() is None:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc)")
    cubin = Nvrtc().compile(module_name(qtype), module_source(module_name(qtype)), "sm_86", ("--std=c++14",))
    assert all(kernel.encode() in cubin for kernel in matmul_kernels(qtype))


MATH_TOL = {"tf32x3": TOL, "fp32": TOL, "tf32": 2e-3}  # gemm_math's stated tolerance (TF32: 10-bit mantissas)
VARIANTS = ["tf32x3/GEMM_ASYNC=0+GEMM_DEQUANT=0", "tf32x3/GEMM_ASYNC=2"]  # MATH/gemm_variant (gemm.cu's alternatives)


def test_gemm_dynamic_shared():
    """GEMM_ASYNC 1's dynamic shared memory (two staged buffers + tiles): on the tensor-core path only, within an
    H100 / A100 block's 227 KiB and an sm_86 block's 99 KiB; none for the static variants."""
    from gpu_kernels.gemm import gemm_dynamic_shared

    assert gemm_dynamic_shared(Q.Q6_K, MOE_GEMM_TOKENS) == 4 * 32 * 160 + 2 * 4 * 128 * 53  # 74.8 KB: K 32
    assert gemm_dynamic_shared(Q.Q6_K, GEMM_TOKENS) == 4 * 16 * 192 + 2 * 4 * 128 * 53  # K 16 (static tiles: 51.7 KB)
    assert gemm_dynamic_shared(Q.Q4_K, MOE_GEMM_TOKENS) == 4 * 32 * 160 + 2 * 4 * 128 * 37
    assert all(gemm_dynamic_shared(q, t) <= 99 * 1024 for q in FORMATS for t in (MOE_GEMM_TOKENS, GEMM_TOKENS))
    assert gemm_dynamic_shared(Q.Q6_K, MOE_GEMM_TOKENS, mma=False) == 0
    assert gemm_dynamic_shared(Q.Q6_K, MOE_GEMM_TOKENS, (("GEMM_MATH", "0"),)) == 0
    assert gemm_dynamic_shared(Q.Q6_K, MOE_GEMM_TOKENS, (("GEMM_ASYNC", "2"),)) == 0


def test_gemm_math_names():
    from gpu_kernels.gemm import DEFAULT_GEMM_MATH, GEMM_MATHS, gemm_math

    assert gemm_math(None) == DEFAULT_GEMM_MATH == "tf32x3" and gemm_math(" TF32 ") == "tf32"
    assert set(GEMM_MATHS) == set(MATH_TOL)
    with pytest.raises(ValueError, match="gemm_math 'fp16'"):
        gemm_math("fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*MATH_TOL, *VARIANTS])
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_gemm_math_at_prefill_sizes(runtime, qtype, case):
    """Each gemm_math and gemm.cu variant (CUDA sm_80+: cp.async stages, word-wise dequantization) within the math's
    tolerance: a dense GEMM of 512 tokens over 2048 columns (column splits) and of 300 tokens (a short last tile),
    and expert groups of 512 x top-8 pairs routed at random over 32 experts plus ragged ones (1, 31, 33, 70 rows;
    Q6_K's 768-column rows 2-byte aligned every other row) in tiles of 32 and 64 rows."""
    from gpu_kernels.kernels import Kernels

    kernels = Kernels(runtime)
    math, _, kernels.gemm_variant = case.partition("/")
    kernels.gemm_math = math
    rng = np.random.default_rng(int(qtype) * 31 + len(math))
    raw = quant(rng, qtype, (260, 2048))  # [R, B]
    for num_tokens in (512, 300):
        x = rng.standard_normal((num_tokens, 2048)).astype(np.float32)  # [T, C]
        out = runtime.empty((num_tokens, 260), np.float32)
        kernels.matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out)
        assert rel_err(runtime.to_host(out), reference(raw, qtype, x)) < MATH_TOL[math]
    raw = quant(rng, qtype, (36, 136, 768))  # [S, R, B]
    sizes = np.concatenate([np.bincount(rng.integers(0, 32, 512 * 8), minlength=32), [1, 31, 33, 70]])
    slots = rng.permutation(36)
    row_starts = np.concatenate([[0], np.cumsum(sizes[slots])])
    x = rng.standard_normal((row_starts[-1], 768)).astype(np.float32)  # [N, C]
    ref = np.empty((len(x), 136), np.float64)
    for slot, start, stop in zip(slots, row_starts[:-1], row_starts[1:]):
        ref[start:stop] = reference(raw[slot], qtype, x[start:stop])
    for tile_tokens in (MOE_GEMM_TOKENS, GEMM_TOKENS):
        tiles = work_tiles(row_starts, slots, tile_tokens)  # [3, W]
        out = runtime.empty((len(x), 136), np.float32)
        kernels.moe_matmul(runtime.to_device(raw), qtype, runtime.to_device(x), out,
                           *[runtime.to_device(np.ascontiguousarray(t)) for t in tiles], tile_tokens=tile_tokens)
        assert rel_err(runtime.to_host(out), ref) < MATH_TOL[math]


def test_gemm_math_setting_reaches_the_kernels(numpy_runtime):
    """EngineConfig's gemm_math through gpu_options to GpuBackend's Kernels; unknown names refused."""
    from hybrid.backends.gpu import GpuBackend
    from hybrid.config import EngineConfig
    from hybrid.llm import gpu_options

    cfg = EngineConfig.resolve({"gemm_math": "TF32"}, environ={})
    assert GpuBackend(numpy_runtime, **gpu_options(cfg, 64, None)).kernels.gemm_math == "tf32"
    assert GpuBackend(numpy_runtime, max_context=64).kernels.gemm_math == "tf32x3"
    with pytest.raises(ValueError, match="gemm_math"):
        GpuBackend(numpy_runtime, max_context=64, gemm_math="fp16")
