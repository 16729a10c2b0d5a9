// Q4_K: super-blocks of 256 weights in 144 bytes: f16 d, f16 dmin, scales[12], qs[128].
// Sub-block j (32 weights) = one unit: nibbles of qs[32*(j/2) + l], low for even j, high for odd;
// weight = (d * scale_j) * q - dmin * min_j.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 144 * (u >> 3);
    int j = (int)(u & 7), sc, m;
    scale_min_k4(b + 4, j, &sc, &m);
    float ds = __fmul_rn(load_half(b), (float)sc);
    float dm = __fmul_rn(load_half(b + 2), (float)m);
    const u32* q = (const u32*)(b + 16 + 32 * (j >> 1));  // super-blocks are 16-byte multiples: aligned
    int shift = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 v = q[i] >> shift;
#pragma unroll
        for (int c = 0; c < 4; ++c) w[4 * i + c] = __fsub_rn(__fmul_rn(ds, (float)((v >> (8 * c)) & 15)), dm);
    }
}

// A slice: 16 bytes of qs, 32 weights, read as one 16-byte load (super-blocks are 16-byte multiples).
// Slice s: super-block s / 8, k = s % 8, pair c = k / 2 of sub-blocks, bytes l0 = 16 (k % 2) .. + 15 of
// its 32: low nibbles are sub-block 2c's weights l0 + 0..15, high ones sub-block 2c + 1's.
#define SLICE_WEIGHTS 32
struct Slice {
    uint4 head;  // d, dmin, scales[12]
    uint4 q;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 144 * (s >> 3);
    Slice sl;
    sl.head = *(const uint4*)b;
    sl.q = *(const uint4*)(b + 16 + 16 * (s & 7));
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
    // sum_l (ds q_l - dm) x_l = ds sum_l q_l x_l - dm sum_l x_l: one FMA a weight, the sums of x shared by the rows.
    float dq[RPT][TT][2], xsum[TT][2];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        xsum[t][0] = xsum[t][1] = 0.0f;
#pragma unroll
        for (int r = 0; r < RPT; ++r) dq[r][t][0] = dq[r][t][1] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: weights 4i .. 4i + 3 of each sub-block's 16
        float q[RPT][8];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            u32 v = WORD(sl[r].q, i), lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                q[r][b] = BYTE_FLOAT(lo, b, 0.0f);
                q[r][4 + b] = BYTE_FLOAT(hi, b, 0.0f);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 4 * i), x1 = *(const float4*)(xs + (i64)t * C + 32 + 4 * i);
                xsum[t][0] += (x0.x + x0.y) + (x0.z + x0.w);
                xsum[t][1] += (x1.x + x1.y) + (x1.z + x1.w);
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    DOT4(dq[r][t][0], q[r], 0, x0);
                    DOT4(dq[r][t][1], q[r], 4, x1);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                float sum = fmaf(ds[r][0], dq[r][t][0], ds[r][1] * dq[r][t][1]);
                sum = fmaf(-dm[r][0], xsum[t][0], fmaf(-dm[r][1], xsum[t][1], sum));
                acc[r][t] += sum;
            }
        }
    }
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): kquant.cuh's kquant_slice_dot_q, with
// word i's quants of sub-blocks 2c and 2c + 1 the low and high nibbles.
__device__ __forceinline__ void slice_quants(const Slice& sl, int i, int c, int* lo, int* hi) {
    u32 v = WORD(sl.q, i);
    *lo = (int)(v & 0x0F0F0F0Fu);
    *hi = (int)((v >> 4) & 0x0F0F0F0Fu);
}

#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    kquant_slice_dot_q<RPT>(sl, s, xq, acc);
}
