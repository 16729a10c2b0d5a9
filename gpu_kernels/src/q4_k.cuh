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
