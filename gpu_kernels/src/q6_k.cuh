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
