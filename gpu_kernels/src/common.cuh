// Shared device helpers, in the common subset of CUDA and HIP (no headers, no warp-size assumption).
// Block reductions go through shared memory over a power-of-two blockDim chosen by the host.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// IEEE half bits -> float, exact (normals, subnormals, inf, nan).
__device__ __forceinline__ float half_to_float(u16 h) {
    u32 sign = (u32)(h & 0x8000u) << 16;
    u32 exponent = (h >> 10) & 0x1fu;
    u32 mantissa = h & 0x3ffu;
    if (exponent == 0) {
        float v = (float)mantissa * 5.9604644775390625e-8f;  // mantissa * 2^-24, exact
        return sign ? -v : v;
    }
    if (exponent == 31) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

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
