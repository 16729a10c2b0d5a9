"""The tiled GEMM (gpu_kernels/src/gemm.cu) compiled for the CPU with g++ and run block after block, each block's
threads as OS threads meeting at a barrier for __syncthreads and its __shared__ arrays shared between them: its
tiling, staging and edges checked without a GPU, against NumPy on gguf's dequantized weights.
tests/gpu_kernels/test_gemm.py runs the real kernels on a GPU."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gpu_kernels.gemm import GEMM_KERNEL, GEMM_ROWS, GEMM_THREADS
from gpu_kernels.sources import SRC, module_name, module_source
from hybrid.backends.gpu_experts import work_tiles

from .test_gemm import quant, reference, rel_err
from .test_slice_emulation import PRELUDE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

THREADS = r"""
#include <barrier>
#include <thread>
#include <vector>
#define __global__
#define __launch_bounds__(...)
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static inline int min(int a, int b) { return a < b ? a : b; }
static thread_local Dim3 threadIdx;
static Dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* block_barrier;
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }

// Block (bx, by, bz) after block: `threads` OS threads run body, its shared arrays (static locals) shared between
// them.
template <class F>
static void run_grid(unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned threads, F body) {
    blockDim = Dim3{threads, 1, 1};
    gridDim = Dim3{grid_x, grid_y, grid_z};
    for (unsigned bz = 0; bz < grid_z; ++bz)
    for (unsigned by = 0; by < grid_y; ++by)
        for (unsigned bx = 0; bx < grid_x; ++bx) {
            blockIdx = Dim3{bx, by, bz};
            std::barrier<> bar(threads);
            block_barrier = &bar;
            std::vector<std::thread> pool;
            for (unsigned t = 0; t < threads; ++t)
                pool.emplace_back([&, t] {
                    threadIdx = Dim3{t, 0, 0};
                    body();
                });
            for (auto& th : pool) th.join();
        }
}
"""

HARNESS = r"""
// tokens: 64 (gemm) or 32 (gemm32) a block.
extern "C" void run_gemm(const u8* raw, const float* x, float* out, int T, int R, int C, i64 row_bytes, int splits,
                         int tokens) {
    run_grid((R + GEMM_ROWS - 1) / GEMM_ROWS, (T + tokens - 1) / tokens, splits, GEMM_THREADS, [=] {
        if (tokens == 64) gemm(raw, x, out, nullptr, nullptr, nullptr, T, R, C, row_bytes);
        else gemm32(raw, x, out, nullptr, nullptr, nullptr, T, R, C, row_bytes);
    });
}

extern "C" void run_moe_gemm(const u8* raw, const float* x, float* out, const int* tile_slot, const int* tile_row,
                             const int* tile_count, int W, int N, int R, int C, i64 row_bytes, int tokens) {
    run_grid((R + GEMM_ROWS - 1) / GEMM_ROWS, W, 1, GEMM_THREADS, [=] {
        if (tokens == 64) gemm(raw, x, out, tile_slot, tile_row, tile_count, N, R, C, row_bytes);
        else gemm32(raw, x, out, tile_slot, tile_row, tile_count, N, R, C, row_bytes);
    });
}
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """qtype -> gemm.cu with that format's header, compiled for the CPU and loaded (without GNU unique symbols: the
    formats' shared arrays, static locals of an inline function, would otherwise be one array for all libraries)."""
    libs = {}

    def get(qtype):
        if qtype not in libs:
            prelude = PRELUDE.replace("#define __shared__\n", "#define __shared__ static\n").replace(
                "static Dim3 threadIdx, blockDim;\nstatic inline void __syncthreads() {}\n", THREADS)
            source = (prelude + module_source(module_name(qtype)).split("// ---- matmul.cu")[0]
                      + (SRC / "gemm.cu").read_text() + HARNESS)
            path = tmp_path_factory.mktemp(qtype.name.lower())
            (path / "gemm.cpp").write_text(source)
            subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-fno-gnu-unique", "-shared", "-fPIC", "-o",
                            str(path / "gemm.so"), str(path / "gemm.cpp")], check=True, capture_output=True, text=True)
            libs[qtype] = ctypes.CDLL(str(path / "gemm.so"))
        return libs[qtype]

    return get


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, pytest.param(Q.Q8_0, marks=pytest.mark.slow),
                                   pytest.param(Q.F16, marks=pytest.mark.slow)], ids=lambda q: q.name)
def test_emulated_gemm(build, qtype):
    """Rows past the last block (200, and 67: stores one by one), tokens past the last tile (70 = 64 + 6, 2 x 32 + 6,
    9); raw bytes
    staged in words (Q4_K, Q8_0, F16) and in halves (Q6_K: 210-byte stages)."""
    assert (GEMM_ROWS, GEMM_THREADS, sorted(GEMM_KERNEL)) == (128, 128, [32, 64])
    lib, rng = build(qtype), np.random.default_rng(int(qtype))
    for num_rows, num_tokens, tokens in ((200, 70, 64), (67, 9, 64), (200, 70, 32)):
        raw = np.ascontiguousarray(quant(rng, qtype, (num_rows, 512)))  # [R, B]
        x = rng.standard_normal((num_tokens, 512)).astype(np.float32)  # [T, C]
        out = np.full((num_tokens, num_rows), np.nan, np.float32)
        lib.run_gemm(_ptr(raw), _ptr(x), _ptr(out), num_tokens, num_rows, 512, ctypes.c_int64(raw.shape[1]), 1, tokens)
        assert rel_err(out, reference(raw, qtype, x)) < 1e-5


def test_emulated_gemm_column_splits(build):
    """Dense GEMMs split over 2 and 4 runs of columns: each run's partial sums in its own [T, R] of the output."""
    lib, rng = build(Q.Q4_K), np.random.default_rng(11)
    raw = np.ascontiguousarray(quant(rng, Q.Q4_K, (130, 1024)))  # [R, B]: 4 stages
    x = rng.standard_normal((33, 1024)).astype(np.float32)  # [T, C]
    for splits, tokens in ((2, 64), (4, 32)):
        partial = np.full((splits, 33, 130), np.nan, np.float32)
        lib.run_gemm(_ptr(raw), _ptr(x), _ptr(partial), 33, 130, 1024, ctypes.c_int64(raw.shape[1]), splits, tokens)
        cols = 1024 // splits
        for z in range(splits):
            part = slice(z * cols, (z + 1) * cols)
            w = np.asarray(gguf_dequantize(raw, Q.Q4_K), np.float64)[:, part]
            assert rel_err(partial[z], x[:, part].astype(np.float64) @ w.T) < 1e-5


@pytest.mark.parametrize("qtype", [Q.Q4_K], ids=lambda q: q.name)
def test_emulated_moe_gemm(build, qtype):
    """Groups of 70 (full tiles and a short one), none, 1 and 17 rows, slots in another order than the groups, tiles of
    64 (gemm) and 32 (gemm32) rows; rows of no tile keep what they held."""
    lib, rng = build(qtype), np.random.default_rng(int(qtype) + 3)
    raw = np.ascontiguousarray(quant(rng, qtype, (4, 136, 256)))  # [S, R, B]
    sizes = np.array([70, 0, 1, 17])
    slots = np.flatnonzero(sizes)[::-1].copy()
    row_starts = np.concatenate([[0], np.cumsum(sizes[slots])])
    x = rng.standard_normal((row_starts[-1] + 2, 256)).astype(np.float32)  # [N + 2, C]: 2 rows of no tile
    for tokens in GEMM_KERNEL:
        tiles = [np.ascontiguousarray(t) for t in work_tiles(row_starts, slots, tokens)]  # 3 x [W]
        out = np.full((len(x), 136), 7.0, np.float32)
        lib.run_moe_gemm(_ptr(raw), _ptr(x), _ptr(out), *map(_ptr, tiles), len(tiles[0]), len(x), 136, 256,
                         ctypes.c_int64(raw.shape[-1]), tokens)
        for slot, start, stop in zip(slots, row_starts[:-1], row_starts[1:]):
            assert rel_err(out[start:stop], reference(raw[slot], qtype, x[start:stop])) < 1e-5
        assert (out[row_starts[-1]:] == 7.0).all()
