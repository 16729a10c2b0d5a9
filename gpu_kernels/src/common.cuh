// Shared device helpers, in the common subset of CUDA and HIP (no headers, no warp-size assumption).
// Block reductions go through shared memory over a power-of-two blockDim chosen by the host; lane
// groups reduce with shuffles over a power-of-two width the host keeps within the device's wave.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// IEEE half bits -> float, exact (normals, subnormals, inf, nan), by the hardware conversion: one
// instruction where the integer version took ~10 (the decode matvecs are bound by instructions a weight).
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
__device__ __forceinline__ float half_to_float(u16 h) {
    _Float16 f;
    __builtin_memcpy(&f, &h, 2);
    return (float)f;
}
#else
__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u16 load_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

__device__ __forceinline__ float load_half(const u8* p) { return half_to_float(load_u16(p)); }

// Sum of v over the block; every thread gets the total. red: blockDim.x floats of shared memory.
__device__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    float total = red[0];
    __syncthreads();
    return total;
}

__device__ float block_max(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    float best = red[0];
    __syncthreads();
    return best;
}

#define NEG_INF __int_as_float(0xff800000)

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define SHFL_XOR(v, mask, width) __shfl_xor((v), (mask), (width))
#else
#define SHFL_XOR(v, mask, width) __shfl_xor_sync(0xffffffffu, (v), (mask), (width))
#endif

// Byte b (0..3, a constant) of v as a float minus `bias`, exactly and without an int-to-float
// conversion: the bits 0x4B0000bb are the float 2^23 + bb.
#define BYTE_FLOAT(v, b, bias) (__int_as_float(__byte_perm((v), 0x4B000000u, 0x7540u | (b))) - (8388608.0f + (bias)))

// Word i (a constant) of a uint4.
#define WORD(q, i) ((i) == 0 ? (q).x : (i) == 1 ? (q).y : (i) == 2 ? (q).z : (q).w)

// The 4 bytes at p + 4i .. p + 4i + 3 (p 2-byte aligned) from the aligned words that hold them:
// no read leaves the 4-byte words of the requested bytes.
__device__ __forceinline__ void load_words_a2(const u8* p, u32* out, int num_words) {
    const u32* w = (const u32*)(p - ((size_t)p & 2u));  // from p, not from an integer: it stays a global load
    u32 shift = ((u32)(size_t)p & 2u) * 8u;  // 0 or 16
    u32 lo = w[0];
    for (int i = 0; i < num_words; ++i) {
        u32 hi = w[shift ? i + 1 : i];
        out[i] = shift ? (lo >> 16) | (hi << 16) : hi;
        lo = hi;
    }
}

// Matmul tiling (matmul.cu): a thread dots the same slices of RPT rows (their activations load
// once) with TT tokens; the decode kernels (one token) take DECODE_ROWS rows, the tiled ones one row.
#define TILE_TOKENS 8
#ifndef DECODE_ROWS
#define DECODE_ROWS 2
#endif
#define MATMUL_THREADS 256

// The one-token kernels (matmul.cu's `_1` and `_1q`; not the few-token `_n` / `_nq`, whose 4 tokens' sums spill under
// such a cap) may cap their registers so that DECODE_MIN_BLOCKS blocks of MATMUL_THREADS fit on an SM (more warps to
// hide the memory latency, at the risk of spills); 0 leaves it to the compiler. CUDA only: HIP's second bound counts
// waves per execution unit, another quantity.
#ifndef DECODE_MIN_BLOCKS
#define DECODE_MIN_BLOCKS 0
#endif
#if DECODE_MIN_BLOCKS > 0 && !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC_RTC__)
#define DECODE_BOUNDS __launch_bounds__(MATMUL_THREADS, DECODE_MIN_BLOCKS)
#else
#define DECODE_BOUNDS
#endif

// sum += wts[o .. o + 3] . xv (a float4 of the token's activations).
#define DOT4(sum, wts, o, xv) \
    sum = fmaf(wts[o + 3], xv.w, fmaf(wts[o + 2], xv.z, fmaf(wts[o + 1], xv.y, fmaf(wts[o], xv.x, sum))))

// ---- int16 activations for the one-token matmuls (the `_1q` kernels of formats that define INT_DECODE)
// A block rounds its token's x [C] once into shared memory, as the CPU's default decode does
// (cpu_kernels.act_quant, int16): per 32-value block a scale amax / XQ_LEVELS and x / scale rounded half to
// even, kept as two signed bytes (hi * 256 + lo, lo in -128..127) so that the weights' integer quants dot
// them with two 4-byte integer dots (dp4a) instead of one float conversion and FMA a weight. XQ_LEVELS
// keeps hi within a signed byte. The integer sums of a block's products (|quants| <= 127) stay exact in int32.
#define XQ_LEVELS 32639.0f
#define XQ_BLOCK 32

struct XQ {
    const i8* hi;        // [C]
    const i8* lo;        // [C]
    const float* scale;  // [C / 32] amax / XQ_LEVELS
    const float* sum;    // [C / 32] the block's sum of x (float)
};

// Where value l (0..31) of a 32-value block sits in hi and lo: in order, or with XQ_NIBBLE_ORDER defined (before this
// file) in the order levels.cuh's nibble lookup makes a word's levels in: value 4i + c (i, c < 4) at 8i + 2c, value
// 16 + 4i + c at 8i + 2c + 1.
#ifdef XQ_NIBBLE_ORDER
#define XQ_POS(l) ((((l) & 12) << 1) | (((l) & 3) << 1) | ((l) >> 4))
#else
#define XQ_POS(l) (l)
#endif
// Where value l of 32-value block b of C sits in hi and lo: at XQ_BLOCK b + XQ_POS(l), or with XQ_HALVES defined (not with
// XQ_NIBBLE_ORDER) the first 16 values of every block in [0, C / 2) and the last 16 in [C / 2, C), 16 a block: a warp's
// 16-byte reads of neighbouring blocks' halves then lie side by side in shared memory (fewer bank conflicts than 32
// bytes apart).
#ifdef XQ_HALVES
#define XQ_INDEX(b, l, C) (((l) >> 4) * ((C) >> 1) + 16 * (b) + ((l) & 15))
#else
#define XQ_INDEX(b, l, C) (XQ_BLOCK * (b) + XQ_POS(l))
#endif

// Dynamic shared memory bytes of a block's XQ for C columns.
#define XQ_SHARED_BYTES(C) (2 * (C) + 8 * ((C) / XQ_BLOCK))

// Round x [C] into shared memory `smem` (XQ_SHARED_BYTES(C)); the whole block takes part, then syncs.
// Groups of 32 threads take 32-value blocks (shuffles of width 32 work on waves of 32 and 64); a group loads
// XQ_LOADS blocks' values before it reduces any, so that their reads are in flight together.
#define XQ_LOADS 4
// silu(g) * u, as the swiglu kernel computes it (no exp of a large positive value).
__device__ __forceinline__ float silu_mul(float g, float u) {
    float silu;
    if (g >= 0.0f) silu = g / (1.0f + expf(-g));
    else {
        float e = expf(g);
        silu = g * e / (1.0f + e);
    }
    return silu * u;
}

// up: where given, x is silu_mul(x, up) (an expert's SwiGLU, staged without a launch of its own).
__device__ __forceinline__ XQ stage_xq(const float* __restrict__ x, int C, unsigned char* smem,
                                       const float* __restrict__ up = nullptr) {
    XQ xq;
    i8* hi = (i8*)smem;
    i8* lo = hi + C;
    float* scale = (float*)(smem + 2 * C);  // 2C is a multiple of 64: aligned
    float* sum = scale + C / XQ_BLOCK;
    int lane = threadIdx.x & 31, groups = blockDim.x >> 5, num_blocks = C / XQ_BLOCK;
    for (int b0 = threadIdx.x >> 5; b0 < num_blocks; b0 += XQ_LOADS * groups) {
        float v[XQ_LOADS];
#pragma unroll
        for (int u = 0; u < XQ_LOADS; ++u) {
            int b = b0 + u * groups;
            int i = XQ_BLOCK * b + lane;
            v[u] = b >= num_blocks ? 0.0f : up ? silu_mul(x[i], up[i]) : x[i];
        }
#pragma unroll
        for (int u = 0; u < XQ_LOADS; ++u) {
            int b = b0 + u * groups;
            if (b >= num_blocks) break;  // the same b for the whole group: its shuffles stay together
            float amax = fabsf(v[u]), total = v[u];
            for (int m = 16; m > 0; m >>= 1) {
                amax = fmaxf(amax, SHFL_XOR(amax, m, 32));
                total += SHFL_XOR(total, m, 32);
            }
            float inv = amax > 0.0f ? XQ_LEVELS / amax : 0.0f;
            int q = __float2int_rn(v[u] * inv);
            int h = (q + 128) >> 8;
            hi[XQ_INDEX(b, lane, C)] = (i8)h;
            lo[XQ_INDEX(b, lane, C)] = (i8)(q - 256 * h);
            if (lane == 0) {
                scale[b] = amax / XQ_LEVELS;
                sum[b] = total;
            }
        }
    }
    __syncthreads();
    xq.hi = hi;
    xq.lo = lo;
    xq.scale = scale;
    xq.sum = sum;
    return xq;
}

// c + the dot of a's and b's 4 signed bytes. AMD chips with a 4-byte dot instruction use it (AMD_DOT4 1: gfx906, CDNA
// and RDNA2, v_dot4_i32_i8; 2: RDNA3 and 4, v_dot4_i32_iu8 with both operands signed); the others (gfx900, RDNA1)
// take four products, as every chip does with DP4A_PRODUCTS defined (bench/hip_assembly.py compares the two).
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#if defined(DP4A_PRODUCTS)
#define AMD_DOT4 0
#elif defined(__GFX11__) || defined(__GFX12__)
#define AMD_DOT4 2
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || \
    defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__) || defined(__gfx1030__) || \
    defined(__gfx1031__) || defined(__gfx1032__) || defined(__gfx1033__) || defined(__gfx1034__) || \
    defined(__gfx1035__) || defined(__gfx1036__)
#define AMD_DOT4 1
#else
#define AMD_DOT4 0
#endif
__device__ __forceinline__ int dp4a(int a, int b, int c) {
#if AMD_DOT4 == 2
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#elif AMD_DOT4 == 1
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    for (int i = 0; i < 32; i += 8) c += ((a << (24 - i)) >> 24) * ((b << (24 - i)) >> 24);
    return c;
#endif
}
#else
__device__ __forceinline__ int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
#endif
