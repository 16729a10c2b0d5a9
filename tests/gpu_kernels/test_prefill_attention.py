"""kv_prefill.cu's paged_prefill (prompt chunks' attention on tensor cores) against the NumPy reference: on a GPU
(marked gpu) through Kernels.paged_attention, and without one compiled for the CPU with g++, each block's threads as
OS threads and mma.sync emulated lane by lane (test_gemm_emulation's way), on small cases. Random data, prior context
in the cache, stage blocks, windows, GQA groups 8 and 1, head dims 64 and 128, lse."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from gpu_kernels.attention_plan import PF_KEYS, PF_ROWS, PREFILL_MIN_TOKENS, attention_plan
from gpu_kernels.sources import SRC, module_source
from hybrid import kv_store

from .test_gemm_emulation import MMA, THREADS
from .test_kv_kernels import KV_INDEX, assert_lse_close, make_cache, rel_err, run_attention
from .test_slice_emulation import PRELUDE

# (T, start, key_lo, stage blocks, BT, window): chunks of 64, 200 and 512 tokens after prior context, from 0, past a
# prefix (odd key counts), over stage blocks, with a sliding window
CASES = [(64, 0, 0, 0, 16, 0), (64, 700, 0, 2, 64, 0), (200, 333, 17, 3, 16, 0), (512, 1500, 0, 1, 64, 0),
         (200, 901, 0, 2, 64, 128), (37, 100, 5, 1, 16, 0)]


def check(runtime, kern, reference_kernels, kv_dtype, case, head_dim, group, num_kv_heads=2, tol=1e-5):
    num_tokens, start, key_lo, num_stage, block_tokens, window = case
    rng = np.random.default_rng([num_tokens, start, key_lo, head_dim, group, window, KV_INDEX[kv_dtype]])
    cache, _, _ = make_cache(rng, kv_dtype, start + num_tokens, num_kv_heads, head_dim, block_tokens, num_stage,
                             written_from=key_lo)
    q = rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    out, lse = attention(kern, runtime, kv_dtype, q, cache, start, key_lo, scale, window)
    ref, ref_lse = attention(reference_kernels, None, kv_dtype, q, cache, start, key_lo, scale, window)
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < tol
    assert_lse_close(lse, ref_lse, tol)


def attention(kern, runtime, kv_dtype, q, cache, start, key_lo, scale, window):
    if not window:
        return run_attention(kern, runtime, kv_dtype, q, cache, start, key_lo, scale, True)
    dev = cache if runtime is None else cache.on(runtime)
    put = (lambda a: a) if runtime is None else runtime.to_device
    get = (lambda a: a) if runtime is None else runtime.to_host
    out, lse = put(np.zeros(q.shape, np.float32)), put(np.zeros(q.shape[:2], np.float32))
    kern.paged_attention(kv_dtype, put(q), *dev.args(), start, key_lo, scale, out, lse, dev.stage, window=window)
    return get(out), get(lse)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [8, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-s{}-lo{}-st{}-bt{}-w{}".format(*c))
@pytest.mark.parametrize("kv_dtype", kv_store.KV_DTYPES)
def test_prefill_attention(runtime, kernels, reference_kernels, kv_dtype, case, head_dim, group):
    if not kernels.prefill_mma:
        pytest.skip("no tensor-core prefill attention on this GPU")
    plan = attention_plan(case[0], group, 2, head_dim, case[1] + case[0], mma=True,
                          prefill_tokens=kernels.prefill_tokens)
    assert plan.kernel == "paged_prefill"
    check(runtime, kernels, reference_kernels, kv_dtype, case, head_dim, group)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_prefill_attention_tf32_opt_in(runtime, reference_kernels, kv_dtype):
    """gemm_math "tf32": one TF32 mma a product, about 1e-3 off."""
    from gpu_kernels.kernels import Kernels

    kern = Kernels(runtime)
    if not kern.prefill_mma:
        pytest.skip("no tensor-core prefill attention on this GPU")
    kern.gemm_math = "tf32"
    check(runtime, kern, reference_kernels, kv_dtype, (200, 333, 17, 3, 16, 0), 128, 8, tol=3e-3)


@pytest.mark.gpu
def test_prefill_attention_matches_the_simt_kernel(runtime, reference_kernels):
    """The tensor-core kernel against paged_attention (the one before it) on the engine's shape: 512 tokens after 1500,
    32 query heads over 4 kv heads, head dim 128, f32 KV."""
    from gpu_kernels.kernels import Kernels

    new, old = Kernels(runtime), Kernels(runtime)
    if not new.prefill_mma:
        pytest.skip("no tensor-core prefill attention on this GPU")
    old.prefill_mma = False
    rng = np.random.default_rng(50)
    cache, _, _ = make_cache(rng, "f32", 2012, 4, 128, 64, 1)
    q = rng.standard_normal((512, 32, 128)).astype(np.float32)
    got, got_lse = run_attention(new, runtime, "f32", q, cache, 1500, 0, 128 ** -0.5, True)
    want, want_lse = run_attention(old, runtime, "f32", q, cache, 1500, 0, 128 ** -0.5, True)
    assert rel_err(got, want) < 1e-5
    assert_lse_close(got_lse, want_lse, 1e-6)


def test_plan_takes_the_prefill_kernel():
    """Chunks from PREFILL_MIN_TOKENS tokens of head dim 64 or 128 take paged_prefill where the GPU has mma; fewer
    tokens, other head dims and GPUs without it the kernels before it."""
    plan = attention_plan(512, 8, 4, 128, 2048, mma=True)
    assert (plan.kernel, plan.rows, plan.width, plan.num_tiles) == ("paged_prefill", PF_ROWS, PF_KEYS, 64)
    assert plan.shared_mem == 0 and plan.splits * plan.split_keys >= 2048 and plan.split_keys % PF_KEYS == 0
    assert attention_plan(PREFILL_MIN_TOKENS - 1, 8, 4, 128, 2048, mma=True).kernel == "paged_attention"
    assert attention_plan(512, 8, 4, 96, 2048, mma=True).kernel == "paged_attention"
    assert attention_plan(512, 8, 4, 128, 2048).kernel == "paged_attention"
    assert attention_plan(1, 8, 4, 128, 2048, mma=True).kernel == "paged_attention_1"


def test_numpy_runtime_takes_the_simt_kernels(numpy_runtime):
    from gpu_kernels.attention_plan import prefill_mma

    assert not prefill_mma(numpy_runtime)


def test_kv_modules_compile_with_the_prefill_kernel_for_sm86():
    """sm_86 (test_compile.py builds every module for sm_90)."""
    nvrtc = pytest.importorskip("gpu_kernels.nvrtc")
    if nvrtc.find_library() is None:
        pytest.skip("no libnvrtc")
    compiler = nvrtc.Nvrtc()
    cubin = compiler.compile("kv_f32", module_source("kv_f32"), "sm_86", ("--std=c++14",))
    assert b"paged_prefill" in cubin


# Without a GPU: the kernel for the CPU (g++), mma.sync and the warp's shuffles emulated through the block's barrier
# (every thread of a block takes the same mma and shuffle calls).

SHUFFLE = r"""
static float shfl_values[128];  // [thread of the block]
template <class T> static inline T __shfl_xor(T v, int mask, int width) {
    int lane = threadIdx.x % 32;
    shfl_values[threadIdx.x] = v;
    __syncthreads();
    T got = shfl_values[threadIdx.x - lane + ((lane ^ mask) & (width - 1)) + (lane & ~(width - 1))];
    __syncthreads();
    return got;
}
"""

ASYNC = r"""
static inline void pf_copy16(float* dst, const float* src) { std::memcpy(dst, src, 16); }  // cp.async, landed at once
static inline void pf_commit() {}
static inline void pf_wait_prior() {}
"""

HARNESS = r"""
extern "C" void run_prefill(const float* q, const kv_t* k_pool, const kv_t* v_pool, const int* table,
                            const kv_t* k_stage, const kv_t* v_stage, float* out, float* lse, int T, int Hq, int Hkv,
                            int D, int BT, int start, int key_lo, float scale, int split_keys, int splits, int window) {
    int rows = T * (Hq / Hkv);
    run_grid((rows + PF_ROWS - 1) / PF_ROWS, Hkv, splits, PF_THREADS, [=] {
        paged_prefill(q, k_pool, v_pool, nullptr, nullptr, table, k_stage, v_stage, nullptr, nullptr, out, lse, 1, T,
                      Hq, Hkv, D, BT, start, key_lo, scale, PF_ROWS, PF_KEYS, split_keys, nullptr, window, 0);
    });
}
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(kv_dtype, defines) -> kv.cu's helpers and kv_prefill.cu (after `defines`) for the CPU, loaded."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    libs = {}

    def get(kv_dtype, defines=""):
        if (kv_dtype, defines) not in libs:
            prelude = PRELUDE.replace("#define __shared__\n", "#define __shared__ static\n").replace(
                "static Dim3 threadIdx, blockDim;\nstatic inline void __syncthreads() {}\n", THREADS).replace(
                "template <class T> static inline T __shfl_xor(T v, int, int) { return v; }\n", SHUFFLE)
            float_bits = ("static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); "
                          "return i; }\n")
            mma = MMA.replace("gemm_mma", "pf_mma").replace("GEMM_MMA", "PF_MMA").replace(float_bits, "")
            kv = (SRC / "kv.cu").read_text().split("// Paged causal GQA attention.")[0]
            common = module_source(f"kv_{kv_dtype}").split("// ---- kv.cu")[0]
            source = (prelude + float_bits + "struct float2 { float x, y; };\nstatic inline int max(int a, int b) "
                      "{ return a > b ? a : b; }\n" + common + kv + mma + ASYNC + defines
                      + (SRC / "kv_prefill.cu").read_text()
                      + HARNESS)
            path = tmp_path_factory.mktemp("prefill_" + kv_dtype + "_sync" * ("PF_ASYNC" in defines))
            (path / "prefill.cpp").write_text(source)
            subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-fno-gnu-unique", "-shared", "-fPIC", "-o",
                            str(path / "prefill.so"), str(path / "prefill.cpp")], check=True, capture_output=True,
                           text=True)
            libs[kv_dtype, defines] = ctypes.CDLL(str(path / "prefill.so"))
        return libs[kv_dtype, defines]

    return get


class Emulated:
    """paged_attention's signature over the emulated paged_prefill (f32 / f16 KV), splits as attention_plan's."""

    def __init__(self, lib, splits=1):
        self.lib, self.splits = lib, splits

    def paged_attention(self, kv_dtype, q, k_pool, v_pool, k_scale, v_scale, table, start, key_lo, scale, out,
                        lse=None, stage=None, start_at=None, window=0):
        from .conftest import ReferenceKernels

        num_tokens, num_q_heads, head_dim = q.shape
        num_keys = start + num_tokens - key_lo
        if window > 0:
            num_keys = min(num_keys, window + num_tokens - 1)
        split_keys = -(-num_keys // self.splits // PF_KEYS) * PF_KEYS
        splits = -(-num_keys // split_keys)
        k_stage, v_stage = (k_pool[:1], v_pool[:1]) if stage is None else stage[:2]
        part = np.full((splits, *q.shape), np.nan, np.float32)
        part_lse = np.full((splits, *q.shape[:2]), np.nan, np.float32)
        ptr = [np.ascontiguousarray(a).ctypes.data_as(ctypes.c_void_p) for a in
               (q, k_pool, v_pool, table, k_stage, v_stage, part, part_lse)]
        self.lib.run_prefill(*ptr, num_tokens, num_q_heads, k_pool.shape[2], head_dim, k_pool.shape[1], start, key_lo,
                             ctypes.c_float(scale), split_keys, splits, window)
        # the splits' merge (kv.cu's paged_attention_merge) as attn_merge's reference, pair by pair
        merged, merged_lse = part[0], part_lse[0]
        for z in range(1, splits):
            into = np.empty_like(merged)
            ReferenceKernels().attn_merge(merged, merged_lse, part[z], part_lse[z], into)
            merged_lse = np.logaddexp(merged_lse, part_lse[z])
            merged = into
        out[:] = merged
        if lse is not None:
            lse[:] = merged_lse


@pytest.mark.parametrize("case,head_dim,group,splits", [
    ((9, 40, 5, 1, 16, 0), 64, 8, 1),  # 72 rows: a second block of 8 rows, 44 keys: a short second tile
    ((70, 20, 0, 0, 16, 24), 64, 1, 1),  # a window, rows of 64 tokens a block
    ((9, 61, 0, 2, 16, 0), 128, 8, 2),  # two key splits (the second from key 32), stage blocks
], ids=["g8-d64", "g1-window", "d128-splits"])
def test_emulated_prefill(build, reference_kernels, case, head_dim, group, splits):
    check(None, Emulated(build("f32"), splits), reference_kernels, "f32", case, head_dim, group, num_kv_heads=1)


@pytest.mark.slow
def test_emulated_prefill_f16(build, reference_kernels):
    """f16 K/V: their hi x lo pass left out (TF32 values already)."""
    check(None, Emulated(build("f16")), reference_kernels, "f16", (9, 40, 5, 1, 16, 0), 64, 8, num_kv_heads=1)


@pytest.mark.slow
@pytest.mark.parametrize("case,head_dim,group,splits", [((70, 20, 0, 0, 16, 24), 64, 1, 1),
                                                        ((9, 61, 0, 2, 16, 0), 128, 8, 2)], ids=["window", "splits"])
def test_emulated_prefill_one_buffer(build, reference_kernels, case, head_dim, group, splits):
    """f32 K/V without PF_ASYNC (the other types' way: one buffer of 32 keys, loaded and widened between the
    products); the default f32 build above copies the next 16 keys (cp.async, here a memcpy) before this tile's
    products."""
    lib = build("f32", "#define PF_ASYNC 0\n")
    check(None, Emulated(lib, splits), reference_kernels, "f32", case, head_dim, group, num_kv_heads=1)
