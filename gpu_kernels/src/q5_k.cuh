// Q5_K: super-blocks of 256 weights in 176 bytes: f16 d, f16 dmin, scales[12], qh[32], qs[128].
// Sub-block j (32 weights) = one unit: 4 low bits as Q4_K, bit 4 = (qh[l] >> j) & 1;
// weight = (d * scale_j) * q - dmin * min_j.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 176 * (u >> 3);
    int j = (int)(u & 7), sc, m;
    scale_min_k4(b + 4, j, &sc, &m);
    float ds = __fmul_rn(load_half(b), (float)sc);
    float dm = __fmul_rn(load_half(b + 2), (float)m);
    const u32* qh = (const u32*)(b + 16);  // super-blocks are 16-byte multiples: aligned
    const u32* q = (const u32*)(b + 48 + 32 * (j >> 1));
    int shift = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 lo = q[i] >> shift, hi = qh[i] >> j;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            int v = ((lo >> (8 * c)) & 15) | (((hi >> (8 * c)) & 1) << 4);
            w[4 * i + c] = __fsub_rn(__fmul_rn(ds, (float)v), dm);
        }
    }
}

// A slice: 16 bytes of qs and the 16 bytes of qh beside them, 32 weights, as Q4_K's slice.
#define SLICE_WEIGHTS 32
struct Slice {
    uint4 head;  // d, dmin, scales[12]
    uint4 qh;
    uint4 q;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 176 * (s >> 3);
    Slice sl;
    sl.head = *(const uint4*)b;
    sl.qh = *(const uint4*)(b + 16 + 16 * (s & 1));
    sl.q = *(const uint4*)(b + 48 + 16 * (s & 7));
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    int k = s & 7, c = k >> 1;
    const float* xs = x + 256 * (s >> 3) + 64 * c + 16 * (k & 1);
    float ds[RPT][2], dm[RPT][2];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        float d = half_to_float(sl[r].head.x & 0xffffu), dmin = half_to_float(sl[r].head.x >> 16);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int sc, m;
            scale_min_k4_regs(sl[r].head.y, sl[r].head.z, sl[r].head.w, 2 * c + h, &sc, &m);
            ds[r][h] = __fmul_rn(d, (float)sc);
            dm[r][h] = __fmul_rn(dmin, (float)m);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float w[RPT][8];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            u32 v = WORD(sl[r].q, i), h = WORD(sl[r].qh, i) >> (2 * c);
            u32 lo = (v & 0x0F0F0F0Fu) | ((h & 0x01010101u) << 4);
            u32 hi = ((v >> 4) & 0x0F0F0F0Fu) | (((h >> 1) & 0x01010101u) << 4);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                w[r][b] = fmaf(ds[r][0], BYTE_FLOAT(lo, b, 0.0f), -dm[r][0]);
                w[r][4 + b] = fmaf(ds[r][1], BYTE_FLOAT(hi, b, 0.0f), -dm[r][1]);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 4 * i), x1 = *(const float4*)(xs + (i64)t * C + 32 + 4 * i);
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    DOT4(acc[r][t], w[r], 0, x0);
                    DOT4(acc[r][t], w[r], 4, x1);
                }
            }
        }
    }
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): kquant.cuh's kquant_slice_dot_q, with
// word i's quants the nibbles and their fifth bits (bits 2c and 2c + 1 of qh).
__device__ __forceinline__ void slice_quants(const Slice& sl, int i, int c, int* lo, int* hi) {
    u32 v = WORD(sl.q, i), h = WORD(sl.qh, i) >> (2 * c);
    *lo = (int)((v & 0x0F0F0F0Fu) | ((h & 0x01010101u) << 4));
    *hi = (int)(((v >> 4) & 0x0F0F0F0Fu) | (((h >> 1) & 0x01010101u) << 4));
}

#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    kquant_slice_dot_q<RPT>(sl, s, xq, acc);
}
