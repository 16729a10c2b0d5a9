// IQ4_XS: super-blocks of 256 weights in 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128].
// Sub-block j (32 weights: one unit, one slice): 6-bit scale ls = (scales_l[j / 2] >> 4 (j % 2) & 15) |
// ((scales_h >> 2j & 3) << 4); qs[16j .. 16j + 15]: low nibbles weights 0..15, high ones 16..31;
// weight = (d * (ls - 32)) * LEVELS[nibble] (levels.cuh: IQ4_NL's 16 levels).
#define UNIT_WEIGHTS 32
#ifndef SLICE_UNROLL
#define SLICE_UNROLL 2  // registers allowing: the int16 decode loop without copies of its loads in flight
#endif

// ls - 32 of sub-block j from the block's first two words (d | scales_h << 16, scales_l).
__device__ __forceinline__ int iq4xs_scale(u32 head, u32 scales_l, int j) {
    return (int)(((scales_l >> (4 * j)) & 15u) | (((head >> (16 + 2 * j)) & 3u) << 4)) - 32;
}

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 136 * (u >> 3);
    int j = (int)(u & 7);
    u32 head = *(const u32*)b, scales_l = *(const u32*)(b + 4);  // super-blocks are 8-byte multiples: aligned
    float dl = __fmul_rn(half_to_float(head & 0xffffu), (float)iq4xs_scale(head, scales_l, j));
    const u32* w32 = (const u32*)(b + 8 + 16 * j);
    u32 q[4] = {w32[0], w32[1], w32[2], w32[3]};
    levels_values(q, dl, w);
}

// A slice: sub-block s % 8 of super-block s / 8, its 16 quant bytes and the block's d and scales.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 head, scales_l;
    uint2 q[2];
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 136 * (s >> 3);
    Slice sl;
    uint2 head = *(const uint2*)b;  // super-blocks are 8-byte multiples: aligned
    sl.head = head.x;
    sl.scales_l = head.y;
    const uint2* q = (const uint2*)(b + 8 + 16 * (s & 7));
    sl.q[0] = q[0];
    sl.q[1] = q[1];
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    u32 q[RPT][4];
    float dl[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        q[r][0] = sl[r].q[0].x, q[r][1] = sl[r].q[0].y, q[r][2] = sl[r].q[1].x, q[r][3] = sl[r].q[1].y;
        dl[r] = half_to_float(sl[r].head & 0xffffu) * (float)iq4xs_scale(sl[r].head, sl[r].scales_l, s & 7);
    }
    levels_slice_dot<RPT, TT>(q, dl, x + 32 * s, C, n, acc);
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): levels.cuh's levels_dot_q.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        u32 q[4] = {sl[r].q[0].x, sl[r].q[0].y, sl[r].q[1].x, sl[r].q[1].y};
        float dl = half_to_float(sl[r].head & 0xffffu) * (float)iq4xs_scale(sl[r].head, sl[r].scales_l, s & 7);
        acc[r][0] = fmaf(dl, levels_dot_q(q, xq, s), acc[r][0]);
    }
}
