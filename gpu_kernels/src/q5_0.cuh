// Q5_0: blocks of 32 weights in 22 bytes: f16 d, u32 qh (bit i: weight i's fifth bit), qs[16] (low nibbles
// weights 0..15, high 16..31); weight = d * (q - 16). One unit = one slice = one block (block32.cuh's slice dot).
#define UNIT_WEIGHTS 32

// The 5-bit quant of weight i (0..31) from the low nibble word `nib` (bytes: weights i & ~3 ..) and qh.
#define Q5_VALUE(nib, c, qh, i) ((int)(((nib) >> (8 * (c))) & 15u) | (int)((((qh) >> (i)) & 1u) << 4))

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 22 * u;
    float d = load_half(b);
    u32 qh = (u32)load_u16(b + 2) | ((u32)load_u16(b + 4) << 16);
#pragma unroll
    for (int l = 0; l < 16; ++l) {
        w[l] = __fmul_rn(d, (float)((int)((b[6 + l] & 15) | (((qh >> l) & 1) << 4)) - 16));
        w[l + 16] = __fmul_rn(d, (float)((int)((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16));
    }
}

struct Slice {
    u32 q[4], qh;
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 22 * s;  // blocks are 2-byte aligned
    Slice sl;
    sl.d = load_u16(b);
    load_words_a2(b + 2, &sl.qh, 1);
    load_words_a2(b + 6, sl.q, 4);
    return sl;
}

__device__ __forceinline__ void slice_values(const Slice& sl, float* q, float* scale, float* offset) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 lo = sl.q[i] & 0x0F0F0F0Fu, hi = (sl.q[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            q[4 * i + c] = (float)(Q5_VALUE(lo, c, sl.qh, 4 * i + c) - 16);
            q[16 + 4 * i + c] = (float)(Q5_VALUE(hi, c, sl.qh, 16 + 4 * i + c) - 16);
        }
    }
    *scale = half_to_float(sl.d);
    *offset = 0.0f;
}
