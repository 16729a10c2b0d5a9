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
