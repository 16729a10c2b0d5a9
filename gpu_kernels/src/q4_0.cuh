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
