// Q5_1: blocks of 32 weights in 24 bytes: f16 d, f16 m, u32 qh (bit i: weight i's fifth bit), qs[16] (low
// nibbles weights 0..15, high 16..31); weight = d * q + m. One unit = one slice = one block (block32.cuh).
#define UNIT_WEIGHTS 32
#define Q5_VALUE(nib, c, qh, i) ((int)(((nib) >> (8 * (c))) & 15u) | (int)((((qh) >> (i)) & 1u) << 4))

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 24 * u;
    float d = load_half(b), m = load_half(b + 2);
    u32 qh = *(const u32*)(b + 4);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        w[l] = __fadd_rn(__fmul_rn(d, (float)((b[8 + l] & 15) | (((qh >> l) & 1) << 4))), m);
        w[l + 16] = __fadd_rn(__fmul_rn(d, (float)((b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4))), m);
    }
}

struct Slice {
    u32 dm, qh, q[4];  // blocks are 8-byte multiples: aligned words
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u32* b = (const u32*)(row + 24 * s);
    Slice sl;
    sl.dm = b[0];
    sl.qh = b[1];
#pragma unroll
    for (int i = 0; i < 4; ++i) sl.q[i] = b[2 + i];
    return sl;
}

__device__ __forceinline__ void slice_values(const Slice& sl, float* q, float* scale, float* offset) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo = sl.q[i] & 0x0F0F0F0Fu, hi = (sl.q[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            q[4 * i + c] = (float)Q5_VALUE(lo, c, sl.qh, 4 * i + c);
            q[16 + 4 * i + c] = (float)Q5_VALUE(hi, c, sl.qh, 16 + 4 * i + c);
        }
    }
    *scale = half_to_float(sl.dm & 0xffffu);
    *offset = half_to_float(sl.dm >> 16);
}
