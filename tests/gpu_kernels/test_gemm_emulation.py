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

MMA = r"""
// gemm.cu's tensor-core path with mma.sync emulated: each warp's lanes leave their fragments in `mma_frags` and meet
// at the block's barrier (every thread of the block takes the same mma calls), then each sums its outputs.
#define GEMM_MMA 1
#define GEMM_MMA_EMULATED
static inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
static u32 mma_frags[128][6];  // [thread of the block][a0..a3, b0, b1]
static inline void gemm_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    int lane = threadIdx.x % 32, warp0 = threadIdx.x - lane, g = lane / 4, c = lane % 4;
    for (int i = 0; i < 4; ++i) mma_frags[threadIdx.x][i] = a[i];
    mma_frags[threadIdx.x][4] = b[0], mma_frags[threadIdx.x][5] = b[1];
    __syncthreads();
    for (int i = 0; i < 4; ++i) {
        int row = g + 8 * (i / 2), col = 2 * c + i % 2;
        double sum = d[i];  // the products and d summed exactly, then truncated (as an H100's tensor cores round)
        for (int k = 0; k < 8; ++k) {
            u32 av = mma_frags[warp0 + 4 * (row % 8) + k % 4][(row / 8) + 2 * (k / 4)];
            u32 bv = mma_frags[warp0 + 4 * col + k % 4][4 + k / 4];
            sum += (double)__uint_as_float(av & 0xffffe000u) * __uint_as_float(bv & 0xffffe000u);  // TF32 operands
        }
        float f = (float)sum;
        d[i] = std::fabs((double)f) > std::fabs(sum) ? std::nextafter(f, 0.0f) : f;
    }
    __syncthreads();
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
    """(qtype, mma) -> gemm.cu with that format's header (mma: with its tensor-core path, MMA), compiled for the CPU
    and loaded (without GNU unique symbols: the formats' shared arrays, static locals of an inline function, would
    otherwise be one array for all libraries)."""
    libs = {}

    def get(qtype, mma=False):
        if (qtype, mma) not in libs:
            prelude = PRELUDE.replace("#define __shared__\n", "#define __shared__ static\n").replace(
                "static Dim3 threadIdx, blockDim;\nstatic inline void __syncthreads() {}\n", THREADS)
            source = (prelude + module_source(module_name(qtype)).split("// ---- matmul.cu")[0] + MMA * mma
                      + (SRC / "gemm.cu").read_text() + HARNESS)
            path = tmp_path_factory.mktemp(qtype.name.lower() + "_mma" * mma)
            (path / "gemm.cpp").write_text(source)
            subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-fno-gnu-unique", "-shared", "-fPIC", "-o",
                            str(path / "gemm.so"), str(path / "gemm.cpp")], check=True, capture_output=True, text=True)
            libs[qtype, mma] = ctypes.CDLL(str(path / "gemm.so"))
        return libs[qtype, mma]

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


@pytest.mark.parametrize("qtype", [Q.Q4_K, pytest.param(Q.Q6_K, marks=pytest.mark.slow)], ids=lambda q: q.name)
def test_emulated_mma_gemm(build, qtype):
    """The tensor-core path (3xTF32, mma.sync emulated lane by lane, its sums truncated as an H100's): its fragments,
    swizzled tiles and stores; rows past the last block (200, 67), tokens past the last tile and n8 tiles skipped
    (70 = 64 + 6, 2 x 32 + 6, 9), 2048 columns (the truncation's drift where the mma accumulate a whole row: 1.6e-5),
    and work tiles of groups of 70, none, 1 and 17 rows."""
    lib, rng = build(qtype, mma=True), np.random.default_rng(int(qtype) + 5)
    for num_rows, num_tokens, num_cols, tokens in ((200, 70, 256, 64), (67, 9, 2048, 64), (200, 70, 256, 32)):
        raw = np.ascontiguousarray(quant(rng, qtype, (num_rows, num_cols)))  # [R, B]
        x = rng.standard_normal((num_tokens, num_cols)).astype(np.float32)  # [T, C]
        out = np.full((num_tokens, num_rows), np.nan, np.float32)
        lib.run_gemm(_ptr(raw), _ptr(x), _ptr(out), num_tokens, num_rows, num_cols, ctypes.c_int64(raw.shape[1]), 1,
                     tokens)
        assert rel_err(out, reference(raw, qtype, x)) < 1e-5
    raw = np.ascontiguousarray(quant(rng, qtype, (4, 136, 256)))  # [S, R, B]
    sizes = np.array([70, 0, 1, 17])
    slots = np.flatnonzero(sizes)[::-1].copy()
    row_starts = np.concatenate([[0], np.cumsum(sizes[slots])])
    x = rng.standard_normal((row_starts[-1], 256)).astype(np.float32)  # [N, C]
    tiles = [np.ascontiguousarray(t) for t in work_tiles(row_starts, slots, 32)]  # 3 x [W]
    out = np.full((len(x), 136), np.nan, np.float32)
    lib.run_moe_gemm(_ptr(raw), _ptr(x), _ptr(out), *map(_ptr, tiles), len(tiles[0]), len(x), 136, 256,
                     ctypes.c_int64(raw.shape[-1]), 32)
    for slot, start, stop in zip(slots, row_starts[:-1], row_starts[1:]):
        assert rel_err(out[start:stop], reference(raw[slot], qtype, x[start:stop])) < 1e-5
