// MXFP4: blocks of 32 weights in 17 bytes: e8m0 exponent e, qs[16] (low nibbles weights 0..15, high ones
// 16..31); weight = d * LEVELS[nibble] (levels.cuh: the E2M1 values doubled), d = 2^(e - 128) as
// ggml_e8m0_to_fp32_half makes it (e < 2: the subnormals 0x00200000 << e). One unit = one slice = one block.
#define UNIT_WEIGHTS 32

__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 17 * u;
    float d = e8m0_half(b[0]);
    u32 q[4];
    load_words_a1(b + 1, q, 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo = levels4(q[i] & 0x0F0F0F0Fu), hi = levels4((q[i] >> 4) & 0x0F0F0F0Fu);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            w[4 * i + c] = __fmul_rn(d, SBYTE_FLOAT(lo, c));
            w[16 + 4 * i + c] = __fmul_rn(d, SBYTE_FLOAT(hi, c));
        }
    }
}

// Blocks are byte-aligned: the quant words come from the aligned words that hold them.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 q[4], e;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 17 * s;
    Slice sl;
    sl.e = b[0];
    load_words_a1(b + 1, sl.q, 4);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    const float* xs = x + 32 * s;
    float dot[RPT][TT];
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t) dot[r][t] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: weights 4i .. 4i + 3 (low nibbles) and 16 + 4i .. (high)
        float w[RPT][8];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            u32 lo = levels4(sl[r].q[i] & 0x0F0F0F0Fu), hi = levels4((sl[r].q[i] >> 4) & 0x0F0F0F0Fu);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                w[r][c] = SBYTE_FLOAT(lo, c);
                w[r][4 + c] = SBYTE_FLOAT(hi, c);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 4 * i), x1 = *(const float4*)(xs + (i64)t * C + 16 + 4 * i);
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    DOT4(dot[r][t], w[r], 0, x0);
                    DOT4(dot[r][t], w[r], 4, x1);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
            if (t < n) acc[r][t] = fmaf(e8m0_half(sl[r].e), dot[r][t], acc[r][t]);
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): levels.cuh's levels_dot_q.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r][0] = fmaf(e8m0_half(sl[r].e), levels_dot_q(sl[r].q, xq, s), acc[r][0]);
}
