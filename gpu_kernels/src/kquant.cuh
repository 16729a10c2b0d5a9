// The packed 6-bit (scale, min) pair of sub-block j of a Q4_K / Q5_K super-block (12 bytes at s).
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The same pair from the scales held in registers (s0, s1, s2: bytes 0..3, 4..7, 8..11); j at run time.
__device__ __forceinline__ void scale_min_k4_regs(u32 s0, u32 s1, u32 s2, int j, int* sc, int* m) {
    int shift = 8 * (j & 3);
    u32 a = (s0 >> shift) & 0xffu, b = (s1 >> shift) & 0xffu;
    if (j < 4) {
        *sc = a & 63;
        *m = b & 63;
    } else {
        u32 c = (s2 >> shift) & 0xffu;
        *sc = (c & 15) | ((a >> 6) << 4);
        *m = (c >> 4) | ((b >> 6) << 4);
    }
}

// The (scale, min) pairs of sub-blocks 2c and 2c + 1 (c = 0..3, at run time) as the bytes [sc0, sc1, m0, m1],
// from a super-block's head in registers (.y, .z, .w: scales bytes 0..11): scale_min_k4 for two sub-blocks at
// once, with byte permutes and masks instead of per-sub-block shifts and branches.
__device__ __forceinline__ u32 scale_min_pair_bytes(const uint4& head, int c) {
    u32 jj = (2 * c) & 3, sel = jj | ((jj + 1) << 4) | ((jj + 4) << 8) | ((jj + 5) << 12);
    bool upper = c >= 2;
    u32 lows = __byte_perm(head.y, head.z, sel), nibs = __byte_perm(head.w, head.w >> 4, sel);
    return upper ? ((lows & 0xC0C0C0C0u) >> 2) | (nibs & 0x0F0F0F0Fu) : lows & 0x3F3F3F3Fu;
}

// The sum over a (scale, min) K-quant slice's two sub-blocks 2c, 2c + 1 given their exact integer sums of q * x
// (x as XQ): (d * scale_j) * (dx_j * sum_j) - (dmin * min_j) * xsum_j; xs0 = xs1 = 0 leave out the min terms.
__device__ __forceinline__ float kquant_pair_sum(const uint4& head, int c, int sum0, int sum1, float dx0, float dx1,
                                                 float xs0, float xs1) {
    u32 sm = scale_min_pair_bytes(head, c);
    float d = half_to_float(head.x & 0xffffu), dmin = half_to_float(head.x >> 16);
    float dots = fmaf(BYTE_FLOAT(sm, 0, 0.0f) * dx0, (float)sum0, BYTE_FLOAT(sm, 1, 0.0f) * dx1 * (float)sum1);
    float mins = fmaf(BYTE_FLOAT(sm, 2, 0.0f), xs0, BYTE_FLOAT(sm, 3, 0.0f) * xs1);
    return fmaf(d, dots, -dmin * mins);
}

// What a (scale, min) K-quant slice s (sub-blocks 2c, 2c + 1, bytes 16 (s % 2) .. + 15 of their 32) reads of XQ:
// the hi and lo bytes of its 16 weights of each sub-block, their scales and (on the first half's lane) sums.
struct KquantXQ {
    uint4 h0, h1, l0, l1;
    float dx0, dx1, xs0, xs1;
    int c;
};

__device__ __forceinline__ KquantXQ kquant_xq(const XQ& xq, int s) {
    KquantXQ k;
    int second = s & 1, blk = 8 * (s >> 3) + 2 * ((s & 7) >> 1);
    int at = XQ_BLOCK * blk + 16 * second;  // x index of the slice's first weight of sub-block 2c (2c + 1: +32)
    k.h0 = *(const uint4*)(xq.hi + at);
    k.h1 = *(const uint4*)(xq.hi + at + 32);
    k.l0 = *(const uint4*)(xq.lo + at);
    k.l1 = *(const uint4*)(xq.lo + at + 32);
    k.dx0 = xq.scale[blk];
    k.dx1 = xq.scale[blk + 1];
    k.xs0 = second ? 0.0f : xq.sum[blk];
    k.xs1 = second ? 0.0f : xq.sum[blk + 1];
    k.c = (s & 7) >> 1;
    return k;
}

// The int16-x dot of a (scale, min) K-quant slice s (the `_1q` kernels of Q4_K and Q5_K): per sub-block one exact
// integer sum of q * x through dp4a, then kquant_pair_sum. The format's slice_quants(slice, i, c, &lo, &hi) gives
// the four quants of word i of sub-blocks 2c (lo) and 2c + 1 (hi), one a byte.
template <int RPT, class S>
__device__ __forceinline__ void kquant_slice_dot_q(const S (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    KquantXQ k = kquant_xq(xq, s);
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        int a0 = 0, b0 = 0, a1 = 0, b1 = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int lo, hi;
            slice_quants(sl[r], i, k.c, &lo, &hi);
            a0 = dp4a(lo, (int)WORD(k.h0, i), a0);
            b0 = dp4a(lo, (int)WORD(k.l0, i), b0);
            a1 = dp4a(hi, (int)WORD(k.h1, i), a1);
            b1 = dp4a(hi, (int)WORD(k.l1, i), b1);
        }
        acc[r][0] += kquant_pair_sum(sl[r].head, k.c, 256 * a0 + b0, 256 * a1 + b1, k.dx0, k.dx1, k.xs0, k.xs1);
    }
}
