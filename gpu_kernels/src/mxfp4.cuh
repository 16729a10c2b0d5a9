// MXFP4: blocks of 32 weights in 17 bytes: e8m0 exponent e, qs[16] (low nibbles weights 0..15, high ones
// 16..31); weight = d * LEVELS[nibble] (levels.cuh: the E2M1 values doubled), d = 2^(e - 128) as
// ggml_e8m0_to_fp32_half makes it (e < 2: the subnormals 0x00200000 << e). One unit = one slice = one block.
#define UNIT_WEIGHTS 32
#ifndef SLICE_UNROLL
#define SLICE_UNROLL 2  // registers allowing: the int16 decode loop without copies of its loads in flight
#endif

__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 17 * u;
    float d = e8m0_half(b[0]);
    u32 q[4];
    load_words_a1(b + 1, q, 4);
    levels_values(q, d, w);
}

// Blocks are byte-aligned: a block's 17 bytes lie in the 5 aligned words from the one that holds its first byte
// (at o = its address % 4); e is byte o of the first, quant word i the 4 bytes after it, by funnel shifts.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 q[4], e;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 17 * s;
    u32 o = (u32)(size_t)b & 3u;
    const u32* w = (const u32*)(b - o);
    u32 words[5];
#pragma unroll
    for (int i = 0; i < 5; ++i) words[i] = w[i];
    Slice sl;
    sl.e = (words[0] >> (8 * o)) & 0xffu;
#pragma unroll
    for (int i = 0; i < 4; ++i) sl.q[i] = funnel_right(words[i], words[i + 1], 8 * o + 8);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    u32 q[RPT][4];
    float d[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) q[r][i] = sl[r].q[i];
        d[r] = e8m0_half(sl[r].e);
    }
    levels_slice_dot<RPT, TT>(q, d, x + 32 * s, C, n, acc);
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): levels.cuh's levels_dot_q.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r][0] = fmaf(e8m0_half(sl[r].e), levels_dot_q(sl[r].q, xq, s), acc[r][0]);
}
