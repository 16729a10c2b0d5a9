// Q3_K: super-blocks of 256 weights in 110 bytes: hmask[32], qs[64], scales[12] (16 packed 6-bit scales), f16 d.
// Weight 128h + 32p + l (h 0..1, p 0..3, l 0..31): q = ((qs[32h + l] >> 2p) & 3) - 4 where bit 4h + p of
// hmask[l] is clear, sub-block i = 8h + 2p + l / 16 of scale sc_i = (scales[i % 8] >> 4 (i / 8) & 15 |
// (scales[8 + i % 4] >> 2 (i / 4) & 3) << 4) - 32; weight = (d * sc_i) * q. Unit u: h, p of (u % 8), 32 weights.
#define UNIT_WEIGHTS 32

// sc_i from the 12 scale bytes in three words.
__device__ __forceinline__ int q3k_scale(const u32 (&sc)[3], int i) {
    u32 low = (sc[(i & 7) >> 2] >> (8 * (i & 3) + 4 * (i >> 3))) & 15u;
    u32 high = (sc[2] >> (8 * (i & 3) + 2 * (i >> 2))) & 3u;
    return (int)(low | (high << 4)) - 32;
}

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 110 * (u >> 3);
    int k = (int)(u & 7), h = k >> 2, p = k & 3;
    u32 sc[3];
    load_words_a2(b + 96, sc, 3);
    float d = load_half(b + 108);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        float dl = __fmul_rn(d, (float)q3k_scale(sc, 8 * h + 2 * p + half));
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            int ll = 16 * half + l;
            int q = ((b[32 + 32 * h + ll] >> (2 * p)) & 3) - (((b[ll] >> (4 * h + p)) & 1) ? 0 : 4);
            w[ll] = __fmul_rn(dl, (float)q);
        }
    }
}

// A slice: l = l0 .. l0 + 7 (l0 = 8 (k % 4)) of half h = k / 4 (k = s % 8, super-block s / 8): 8 bytes of qs at
// 32 + 32h + l0 and of hmask at l0, 32 weights, part p's at column 128h + 32p + l, sub-block 8h + 2p + l0 / 16.
// Super-blocks are 2-byte aligned: words come from load_words_a2.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 q[2], hm[2], sc[3];
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 110 * (s >> 3);
    int k = s & 7, h = k >> 2, l0 = 8 * (k & 3);
    Slice sl;
    load_words_a2(b + 32 + 32 * h + l0, sl.q, 2);
    load_words_a2(b + l0, sl.hm, 2);
    load_words_a2(b + 96, sl.sc, 3);
    sl.d = *(const u16*)(b + 108);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    int k = s & 7, h = k >> 2, l0 = 8 * (k & 3);
    const float* xs = x + 256 * (s >> 3) + 128 * h + l0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // part p: weights 32p + 0..7 of the slice's columns
        float q[RPT][8], dl[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            dl[r] = half_to_float(sl[r].d) * (float)q3k_scale(sl[r].sc, 8 * h + 2 * p + (l0 >> 4));
#pragma unroll
            for (int wd = 0; wd < 2; ++wd) {  // q + 4 = low bits + 4 * high bit, in 0..7
                u32 v = ((sl[r].q[wd] >> (2 * p)) & 0x03030303u) | (((sl[r].hm[wd] >> (4 * h + p)) & 0x01010101u) << 2);
#pragma unroll
                for (int c = 0; c < 4; ++c) q[r][4 * wd + c] = BYTE_FLOAT(v, c, 4.0f);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 32 * p), x1 = *(const float4*)(xs + (i64)t * C + 32 * p + 4);
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    float dot = 0.0f;
                    DOT4(dot, q[r], 0, x0);
                    DOT4(dot, q[r], 4, x1);
                    acc[r][t] = fmaf(dl[r], dot, acc[r][t]);
                }
            }
        }
    }
}
