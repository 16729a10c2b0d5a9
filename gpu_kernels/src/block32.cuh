// The slice dot of formats whose slice is 32 weights w = scale * q + offset (Q4_1, Q5_0, Q5_1, IQ4_NL, IQ3_XXS):
// the format's header defines its Slice, load_slice and slice_values(slice, q, &scale, &offset) (q: the 32 values
// before scaling, as floats); this file defines SLICE_WEIGHTS and slice_dot. Slice s covers x[32s .. 32s + 31].
#define SLICE_WEIGHTS 32
template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    const float* xs = x + 32 * s;
    float q[RPT][32], scale[RPT], offset[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) slice_values(sl[r], q[r], &scale[r], &offset[r]);
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
            float dot[RPT], xsum = 0.0f;
#pragma unroll
            for (int r = 0; r < RPT; ++r) dot[r] = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float4 xv = *(const float4*)(xs + (i64)t * C + 4 * i);
                xsum += (xv.x + xv.y) + (xv.z + xv.w);
#pragma unroll
                for (int r = 0; r < RPT; ++r) DOT4(dot[r], q[r], 4 * i, xv);
            }
#pragma unroll
            for (int r = 0; r < RPT; ++r) acc[r][t] = fmaf(scale[r], dot[r], fmaf(offset[r], xsum, acc[r][t]));
        }
    }
}
