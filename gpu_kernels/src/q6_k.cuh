// Q6_K: super-blocks of 256 weights in 210 bytes: ql[128], qh[64], int8 scales[16], f16 d.
// Sub-block s (16 weights, one scale) = one unit: half h = s / 8, part p = (s % 8) / 2,
// l = 16 * (s % 2) + i; low 4 bits from ql[64h + 32(p & 1) + l] (>> 4 when p >= 2),
// high 2 bits (qh[32h + l] >> 2p) & 3; weight = (d * scale_s) * (q - 32).
#define UNIT_WEIGHTS 16
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 210 * (u >> 4);
    int s = (int)(u & 15), h = s >> 3, p = (s & 7) >> 1, l0 = 16 * (s & 1);
    float ds = __fmul_rn(load_half(b + 208), (float)(i8)b[192 + s]);
    const u8* ql = b + 64 * h + 32 * (p & 1) + l0;
    const u8* qh = b + 128 + 32 * h + l0;
    int shift = 4 * (p >> 1);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int v = ((ql[i] >> shift) & 15) | (((qh[i] >> (2 * p)) & 3) << 4);
        w[i] = __fmul_rn(ds, (float)(v - 32));
    }
}

// A slice: l = l0 .. l0 + 7 (l0 = 8 (k % 4)) of half h = k / 4 (k = s % 8, super-block s / 8): 8 bytes of
// ql at 64h + l0 and 64h + 32 + l0, 8 of qh at 128 + 32h + l0; 32 weights, part p's at column
// 128h + 32p + l, scale 8h + 2p + l0 / 16. Super-blocks are 2-byte aligned: words come from load_words_a2.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 ql[2][2], qh[2];
    i8 sc[4];
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 210 * (s >> 3);
    int k = s & 7, h = k >> 2, l0 = 8 * (k & 3);
    Slice sl;
    load_words_a2(b + 64 * h + l0, sl.ql[0], 2);
    load_words_a2(b + 64 * h + 32 + l0, sl.ql[1], 2);
    load_words_a2(b + 128 + 32 * h + l0, sl.qh, 2);
    const i8* sc = (const i8*)(b + 192 + 8 * h + (l0 >> 4));
#pragma unroll
    for (int p = 0; p < 4; ++p) sl.sc[p] = sc[2 * p];
    sl.d = *(const u16*)(b + 208);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    int k = s & 7;
    const float* xs = x + 256 * (s >> 3) + 128 * (k >> 2) + 8 * (k & 3);
    float d[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) d[r] = half_to_float(sl[r].d);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        float w[RPT][8];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            float ds = __fmul_rn(d[r], (float)sl[r].sc[p]);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                u32 q = ((sl[r].ql[p & 1][i] >> (4 * (p >> 1))) & 0x0F0F0F0Fu) | (((sl[r].qh[i] >> (2 * p)) & 0x03030303u) << 4);
#pragma unroll
                for (int b = 0; b < 4; ++b) w[r][4 * i + b] = __fmul_rn(ds, BYTE_FLOAT(q, b, 32.0f));
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                const float4* x4 = (const float4*)(xs + (i64)t * C + 32 * p);
                float4 x0 = x4[0], x1 = x4[1];
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    DOT4(acc[r][t], w[r], 0, x0);
                    DOT4(acc[r][t], w[r], 4, x1);
                }
            }
        }
    }
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): per part p (8 weights, x block
// 8 (s / 8) + 4h + p) d * scale_p * dx * (sum of q * x - 32 sum of x), the integer sums exact through dp4a,
// the sums of x the rows' shared work.
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    int k = s & 7, blk = 8 * (s >> 3) + 4 * (k >> 2);
    int at = XQ_BLOCK * blk + 8 * (k & 3);  // x index of part 0's first weight (part p: + 32p)
    const int ones = 0x01010101;
    float part[RPT][4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        uint2 h = *(const uint2*)(xq.hi + at + 32 * p), l = *(const uint2*)(xq.lo + at + 32 * p);
        int bias = 32 * (256 * dp4a(ones, (int)h.x, dp4a(ones, (int)h.y, 0)) + dp4a(ones, (int)l.x, dp4a(ones, (int)l.y, 0)));
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            int a = 0, b = 0;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                int q = (int)(((sl[r].ql[p & 1][i] >> (4 * (p >> 1))) & 0x0F0F0F0Fu) | (((sl[r].qh[i] >> (2 * p)) & 0x03030303u) << 4));
                a = dp4a(q, (int)(i ? h.y : h.x), a);
                b = dp4a(q, (int)(i ? l.y : l.x), b);
            }
            part[r][p] = (float)sl[r].sc[p] * (float)(256 * a + b - bias);  // exact ints: |q * x| sums < 2^24
        }
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        float sum = part[r][0] * xq.scale[blk];
#pragma unroll
        for (int p = 1; p < 4; ++p) sum = fmaf(part[r][p], xq.scale[blk + p], sum);
        acc[r][0] = fmaf(half_to_float(sl[r].d), sum, acc[r][0]);
    }
}
