// Q4_0: blocks of 32 weights in 18 bytes: f16 d, q[16] nibbles (low: weights 0..15, high: 16..31);
// weight = d * (q - 8). One unit = one block.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 18 * u;
    float d = load_half(b);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        w[l] = __fmul_rn(d, (float)((int)(b[2 + l] & 15) - 8));
        w[l + 16] = __fmul_rn(d, (float)((int)(b[2 + l] >> 4) - 8));
    }
}

// A slice: half a block's quant bytes, 16 weights (slice s: block s / 2, bytes 8 (s % 2) .. + 7:
// low nibbles are weights 8 (s % 2) + 0..7, high ones 16 + 8 (s % 2) + 0..7). Dot: d * sum((q - 8) * x).
#define SLICE_WEIGHTS 16
struct Slice {
    u32 q[2];
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 18 * (s >> 1);
    Slice sl;
    load_words_a2(b + 2 + 8 * (s & 1), sl.q, 2);
    sl.d = *(const u16*)b;
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    const float* xs = x + 32 * (s >> 1) + 8 * (s & 1);
    float d[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) d[r] = half_to_float(sl[r].d);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float w[RPT][8];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            u32 lo = sl[r].q[i] & 0x0F0F0F0Fu, hi = (sl[r].q[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                w[r][b] = BYTE_FLOAT(lo, b, 8.0f);
                w[r][4 + b] = BYTE_FLOAT(hi, b, 8.0f);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 4 * i), x1 = *(const float4*)(xs + (i64)t * C + 16 + 4 * i);
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    float dot = 0.0f;
                    DOT4(dot, w[r], 0, x0);
                    DOT4(dot, w[r], 4, x1);
                    acc[r][t] = fmaf(d[r], dot, acc[r][t]);
                }
            }
        }
    }
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): d * dx * (sum of q * x - 8 sum of x),
// exact in int32 through dp4a; the sums of x are the rows' shared work.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    int at = 32 * (s >> 1) + 8 * (s & 1);  // x index of the low nibbles' first weight (high: +16)
    uint2 h0 = *(const uint2*)(xq.hi + at), h1 = *(const uint2*)(xq.hi + at + 16);
    uint2 l0 = *(const uint2*)(xq.lo + at), l1 = *(const uint2*)(xq.lo + at + 16);
    const int ones = 0x01010101;
    int xh = dp4a(ones, (int)h0.x, dp4a(ones, (int)h0.y, dp4a(ones, (int)h1.x, dp4a(ones, (int)h1.y, 0))));
    int xl = dp4a(ones, (int)l0.x, dp4a(ones, (int)l0.y, dp4a(ones, (int)l1.x, dp4a(ones, (int)l1.y, 0))));
    int bias = 8 * (256 * xh + xl);
    float dx = xq.scale[s >> 1];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        int a = 0, b = 0;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            u32 v = sl[r].q[i];
            int lo = (int)(v & 0x0F0F0F0Fu), hi = (int)((v >> 4) & 0x0F0F0F0Fu);
            a = dp4a(lo, (int)(i ? h0.y : h0.x), dp4a(hi, (int)(i ? h1.y : h1.x), a));
            b = dp4a(lo, (int)(i ? l0.y : l0.x), dp4a(hi, (int)(i ? l1.y : l1.x), b));
        }
        acc[r][0] = fmaf(half_to_float(sl[r].d) * dx, (float)(256 * a + b - bias), acc[r][0]);
    }
}
