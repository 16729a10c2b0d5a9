// IQ1_M: super-blocks of 256 weights in 56 bytes: qs[32], qh[16], scales u16[4]; the f16 d is the top nibbles
// of the four scale words (word i's at bits 4i ..). Entry e (8 weights): grid row qs[e] | (nibble & 7) << 8 of
// IQ1_GRID (sources.py, from the CPU's table: 8 values -1, 0, 1, two words a row), nibble (e % 2) of qh[e / 2],
// whose bit 3 makes delta -0.125 (else 0.125); 16 weights (two entries) share the 3-bit scale s_i
// (scales[i / 4] >> 3 (i % 4)) & 7, dl = d * (2 s_i + 1); weight = dl * (value + delta). Sub-block j (32 weights,
// entries 4j .. 4j + 3) is one unit and one slice; the slice dot multiplies the weights themselves (block32.cuh
// with scale 1).
#define UNIT_WEIGHTS 32
#define IQ1_DELTA 0.125f

struct Slice {
    u32 qs, sc[2];  // blocks are 8-byte multiples: aligned words
    u16 qh;
    u8 j;  // the sub-block
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 56 * (s >> 3);
    int j = s & 7;
    Slice sl;
    sl.qs = *(const u32*)(b + 4 * j);
    sl.qh = *(const u16*)(b + 32 + 2 * j);
    sl.sc[0] = *(const u32*)(b + 48);
    sl.sc[1] = *(const u32*)(b + 52);
    sl.j = (u8)j;
    return sl;
}

__device__ __forceinline__ void slice_weights(const Slice& sl, float* w) {
    int j = sl.j;
    u32 d_bits = ((sl.sc[0] >> 12) & 0xFu) | ((sl.sc[0] >> 24) & 0xF0u) | ((sl.sc[1] >> 4) & 0xF00u) |
                 ((sl.sc[1] >> 16) & 0xF000u);
    float d = half_to_float((u16)d_bits);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        int i = 2 * j + half;  // the scale of entries 2i, 2i + 1
        u32 word = sl.sc[i >> 3] >> (16 * ((i >> 2) & 1));
        float dl = __fmul_rn(d, (float)(2 * ((word >> (3 * (i & 3))) & 7u) + 1));
#pragma unroll
        for (int k = 2 * half; k < 2 * half + 2; ++k) {
            u32 nibble = (sl.qh >> (4 * k)) & 15u;
            u32 index = ((sl.qs >> (8 * k)) & 0xffu) | ((nibble & 7u) << 8);
            float delta = (nibble & 8u) ? -IQ1_DELTA : IQ1_DELTA;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 values = IQ1_GRID[2 * index + h];
#pragma unroll
                for (int c = 0; c < 4; ++c) w[8 * k + 4 * h + c] = __fmul_rn(dl, __fadd_rn(SBYTE_FLOAT(values, c), delta));
            }
        }
    }
}

__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) { slice_weights(load_slice(row, (int)u), w); }

__device__ __forceinline__ void slice_values(const Slice& sl, float* q, float* scale, float* offset) {
    slice_weights(sl, q);
    *scale = 1.0f;
    *offset = 0.0f;
}
