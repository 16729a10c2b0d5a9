// IQ4_NL: blocks of 32 weights in 18 bytes: f16 d, qs[16] (low nibbles weights 0..15, high 16..31);
// weight = d * LEVELS[nibble] (levels.cuh). One unit = one slice = one block (block32.cuh's slice dot).
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 18 * u;
    float d = load_half(b);
    u32 q[4];
    load_words_a2(b + 2, q, 4);
    levels_values(q, d, w);
}

struct Slice {
    u32 q[4];
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 18 * s;  // blocks are 2-byte aligned
    Slice sl;
    sl.d = load_u16(b);
    load_words_a2(b + 2, sl.q, 4);
    return sl;
}

__device__ __forceinline__ void slice_values(const Slice& sl, float* q, float* scale, float* offset) {
    levels_values(sl.q, 1.0f, q);
    *scale = half_to_float(sl.d);
    *offset = 0.0f;
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): levels.cuh's levels_dot_q.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) acc[r][0] = fmaf(half_to_float(sl[r].d), levels_dot_q(sl[r].q, xq, s), acc[r][0]);
}
