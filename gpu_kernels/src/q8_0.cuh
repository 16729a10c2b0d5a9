// Q8_0: blocks of 32 weights in 34 bytes: f16 d, int8 q[32]; weight = q * d. One unit = one block.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 34 * u;
    float d = load_half(b);
    const u16* q = (const u16*)(b + 2);  // 34-byte blocks: 2-byte aligned
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        u16 v = q[i];
        w[2 * i] = __fmul_rn((float)(i8)(v & 0xff), d);
        w[2 * i + 1] = __fmul_rn((float)(i8)(v >> 8), d);
    }
}
