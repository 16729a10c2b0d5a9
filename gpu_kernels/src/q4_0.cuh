// Q4_0: blocks of 32 weights in 18 bytes: f16 d, q[16] nibbles (low: weights 0..15, high: 16..31);
// weight = d * (q - 8). One unit = one block.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 18 * u;
    float d = load_half(b);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        w[l] = __fmul_rn(d, (float)((int)(b[2 + l] & 15) - 8));
        w[l + 16] = __fmul_rn(d, (float)((int)(b[2 + l] >> 4) - 8));
    }
}
