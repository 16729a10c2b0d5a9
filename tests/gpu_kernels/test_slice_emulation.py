"""The formats' slice dots (gpu_kernels/src/*.cuh: float x and, for INT_DECODE formats, x as int16) compiled
for the CPU with g++ and run one slice after another, against NumPy on the dequantized weights: the
kernels' per-format arithmetic (bit fields, scales, the int16 split, dp4a sums) checked without a GPU.

The GPU-only parts (lane groups, shuffles, shared memory, stage_xq's block reductions) are not emulated:
the harness sets the HIP macros so that common.cuh takes its portable C paths (half conversion, dp4a), and
gets XQ from NumPy (conftest.xq_arrays, the rounding stage_xq does). tests/gpu_kernels/test_kernels.py runs
the real kernels on a GPU.
"""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu_kernels.sources import INT_DECODE, module_name, module_source
from hybrid.formats.synthetic import encode

from .conftest import dequant, xq_arrays

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#define __HIP_PLATFORM_AMD__ 1
#define __device__
#define __forceinline__ inline
#define __shared__
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockDim;
static inline void __syncthreads() {}
template <class T> static inline T __shfl_xor(T v, int, int) { return v; }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned sel) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
static inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
"""

HARNESS = r"""
// out [2] = rows row0 and row1 [B] dotted with x [C], slice after slice as one lane of the kernels would.
extern "C" void dot_float(const u8* row0, const u8* row1, const float* x, int C, float* out) {
    float acc[2][1] = {{0.0f}, {0.0f}};
    for (int s = 0; s < C / SLICE_WEIGHTS; ++s) {
        Slice sl[2] = {load_slice(row0, s), load_slice(row1, s)};
        slice_dot<2, 1>(sl, s, x, C, 1, acc);
    }
    out[0] = acc[0][0];
    out[1] = acc[1][0];
}
#ifdef INT_DECODE
extern "C" void dot_int(const u8* row0, const u8* row1, const i8* hi, const i8* lo, const float* scale,
                        const float* sum, int C, float* out) {
    XQ xq;
    xq.hi = hi;
    xq.lo = lo;
    xq.scale = scale;
    xq.sum = sum;
#ifdef STAGE_TABLES
    blockDim.x = 1;  // one thread copies the format's tables into its "shared memory"
    STAGE_TABLES();
#endif
    float acc[2][1] = {{0.0f}, {0.0f}};
    for (int s = 0; s < C / SLICE_WEIGHTS; ++s) {
        Slice sl[2] = {load_slice(row0, s), load_slice(row1, s)};
        slice_dot_q<2>(sl, s, xq, acc);
    }
    out[0] = acc[0][0];
    out[1] = acc[1][0];
}
#endif
"""

QUANTIZED = [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
ROWS, COLS = 6, 768


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """qtype -> the harness compiled with that format's header, loaded."""
    libs = {}

    def get(qtype):
        if qtype not in libs:
            source = PRELUDE + module_source(module_name(qtype)).split("// ---- matmul.cu")[0]  # tables included
            path = tmp_path_factory.mktemp(qtype.name.lower())
            (path / "slices.cpp").write_text(source + HARNESS)
            subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(path / "slices.so"),
                            str(path / "slices.cpp")], check=True, capture_output=True)
            libs[qtype] = ctypes.CDLL(str(path / "slices.so"))
        return libs[qtype]

    return get


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _rows_dot(lib, fn, raw, *x_args):
    out = np.empty(len(raw), np.float32)
    pair = np.empty(2, np.float32)
    for r in range(0, len(raw), 2):
        getattr(lib, fn)(_ptr(raw[r]), _ptr(raw[r + 1]), *x_args, ctypes.c_int(COLS), _ptr(pair))
        out[r:r + 2] = pair
    return out


def _case(qtype):
    rng = np.random.default_rng(int(qtype) + 7)
    raw = np.ascontiguousarray(encode("w", rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype, rng).raw)
    x = (rng.standard_normal(COLS) * rng.uniform(0.01, 10, COLS // 32).repeat(32)).astype(np.float32)  # [C]
    return raw, x, dequant(raw, qtype, COLS).astype(np.float64)  # [R, B], [C], [R, C]


def _rel_err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_float_slice_dot(build, qtype):
    raw, x, w = _case(qtype)
    got = _rows_dot(build(qtype), "dot_float", raw, _ptr(x))
    assert _rel_err(got, w @ x.astype(np.float64)) < 1e-5


XQ_NIBBLE_POS = np.array([((v & 12) << 1) | ((v & 3) << 1) | (v >> 4) for v in range(32)])  # common.cuh's XQ_POS


def xq_layout(qtype, a):
    """a [C] (a value of x each) laid out as the format's stage_xq keeps it: in order, or under XQ_NIBBLE_ORDER
    value v of each 32-value block at XQ_POS(v)."""
    if "#define XQ_NIBBLE_ORDER" not in module_source(module_name(qtype)):
        return a
    out = np.empty_like(a).reshape(-1, 32)
    out[:, XQ_NIBBLE_POS] = a.reshape(-1, 32)
    return out.reshape(-1)


@pytest.mark.parametrize("qtype", sorted(INT_DECODE), ids=lambda q: Q(q).name)
def test_int16_slice_dot(build, qtype):
    raw, x, w = _case(qtype)
    hi, lo, scale, total = xq_arrays(x)
    got = _rows_dot(build(qtype), "dot_int", raw, _ptr(xq_layout(qtype, hi)), _ptr(xq_layout(qtype, lo)), _ptr(scale),
                    _ptr(total))
    x_hat = (256 * hi.astype(np.float64) + lo) * np.repeat(scale.astype(np.float64), 32)
    assert np.abs(x_hat - x).max() <= np.repeat(scale, 32).max() / 2 * (1 + 1e-6)  # the split holds x's rounding
    assert _rel_err(got, w @ x_hat) < 1e-4  # K-quant min terms use the unrounded sums: measured up to 5.2e-5
    assert _rel_err(got, w @ x.astype(np.float64)) < 2e-4
