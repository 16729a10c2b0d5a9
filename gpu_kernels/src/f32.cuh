// F32: one weight per unit, 4 bytes.
#define UNIT_WEIGHTS 1
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    w[0] = __uint_as_float(*(const u32*)(row + 4 * u));
}

// A slice: 4 weights, one 16-byte load (rows are 16-byte multiples: the launcher checks C % 4 == 0).
#define SLICE_WEIGHTS 4
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
    float w[RPT][4];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        w[r][0] = __uint_as_float(sl[r].v.x), w[r][1] = __uint_as_float(sl[r].v.y);
        w[r][2] = __uint_as_float(sl[r].v.z), w[r][3] = __uint_as_float(sl[r].v.w);
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
            float4 x0 = *(const float4*)(x + (i64)t * C + 4 * s);
#pragma unroll
            for (int r = 0; r < RPT; ++r) DOT4(acc[r][t], w[r], 0, x0);
        }
    }
}
