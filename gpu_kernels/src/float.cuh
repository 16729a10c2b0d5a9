// F32, F16, BF16: one weight per unit of FLOAT_BYTES bytes. The module defines FLOAT_BYTES, FLOAT_BITS (u32 or
// u16: a weight's bits) and TO_FLOAT (the bits to a float: __uint_as_float, half_to_float, bf16_to_float).
#define UNIT_WEIGHTS 1
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    w[0] = TO_FLOAT(*(const FLOAT_BITS*)(row + FLOAT_BYTES * u));
}

// A slice: 16 / FLOAT_BYTES weights, one 16-byte load (rows are 16-byte multiples: the launcher checks
// C % SLICE_WEIGHTS == 0).
#define SLICE_WEIGHTS (16 / FLOAT_BYTES)
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
    float w[RPT][SLICE_WEIGHTS];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
#if FLOAT_BYTES == 4  // written out: nvcc unrolls the callers less around the loop form
        w[r][0] = TO_FLOAT(sl[r].v.x), w[r][1] = TO_FLOAT(sl[r].v.y);
        w[r][2] = TO_FLOAT(sl[r].v.z), w[r][3] = TO_FLOAT(sl[r].v.w);
#else
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 v = WORD(sl[r].v, i);
            w[r][2 * i] = TO_FLOAT((u16)(v & 0xffffu));
            w[r][2 * i + 1] = TO_FLOAT((u16)(v >> 16));
        }
#endif
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
            const float4* xs = (const float4*)(x + (i64)t * C + SLICE_WEIGHTS * s);
            float4 x0 = xs[0], x1 = xs[SLICE_WEIGHTS / 4 - 1];  // the slice's x: one float4 (F32) or two
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                DOT4(acc[r][t], w[r], 0, x0);
                if (SLICE_WEIGHTS == 8) DOT4(acc[r][t], w[r], SLICE_WEIGHTS - 4, x1);
            }
        }
    }
}
