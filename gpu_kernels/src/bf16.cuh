// BF16: one weight per unit, 2 bytes.
#define UNIT_WEIGHTS 1
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    w[0] = bf16_to_float(*(const u16*)(row + 2 * u));
}

// A slice: 8 weights, one 16-byte load (rows are 16-byte multiples: the launcher checks C % 8 == 0).
#define SLICE_WEIGHTS 8
struct Slice {
    uint4 v;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    Slice sl;
    sl.v = *(const uint4*)(row + 16 * s);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    float w[RPT][8];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 v = WORD(sl[r].v, i);
            w[r][2 * i] = bf16_to_float((u16)(v & 0xffffu));
            w[r][2 * i + 1] = bf16_to_float((u16)(v >> 16));
        }
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
            const float4* xs = (const float4*)(x + (i64)t * C + 8 * s);
            float4 x0 = xs[0], x1 = xs[1];
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                DOT4(acc[r][t], w[r], 0, x0);
                DOT4(acc[r][t], w[r], 4, x1);
            }
        }
    }
}
