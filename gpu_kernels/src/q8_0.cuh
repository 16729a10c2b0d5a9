// Q8_0: blocks of 32 weights in 34 bytes: f16 d, int8 q[32]; weight = q * d. One unit = one block.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 34 * u;
    float d = load_half(b);
#pragma unroll
    for (int l = 0; l < 32; ++l) w[l] = __fmul_rn((float)(i8)b[2 + l], d);
}
