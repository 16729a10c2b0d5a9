// Q4_1: blocks of 32 weights in 20 bytes: f16 d, f16 m, qs[16] (low nibbles weights 0..15, high 16..31);
// weight = d * q + m. One unit = one slice = one block (block32.cuh's slice dot).
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 20 * u;
    float d = load_half(b), m = load_half(b + 2);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        w[l] = __fadd_rn(__fmul_rn(d, (float)(b[4 + l] & 15)), m);
        w[l + 16] = __fadd_rn(__fmul_rn(d, (float)(b[4 + l] >> 4)), m);
    }
}

struct Slice {
    u32 dm, q[4];  // d | m << 16, the quant bytes (blocks are 4-byte multiples: aligned)
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u32* b = (const u32*)(row + 20 * s);
    Slice sl;
    sl.dm = b[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) sl.q[i] = b[1 + i];
    return sl;
}

__device__ __forceinline__ void slice_values(const Slice& sl, float* q, float* scale, float* offset) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo = sl.q[i] & 0x0F0F0F0Fu, hi = (sl.q[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            q[4 * i + c] = BYTE_FLOAT(lo, c, 0.0f);
            q[16 + 4 * i + c] = BYTE_FLOAT(hi, c, 0.0f);
        }
    }
    *scale = half_to_float(sl.dm & 0xffffu);
    *offset = half_to_float(sl.dm >> 16);
}
