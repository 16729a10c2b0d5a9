// Q2_K: super-blocks of 256 weights in 84 bytes: scales[16] (scale low nibble, min high), qs[64], f16 d, f16 dmin.
// Weight 128h + 32p + l (h 0..1, p 0..3, l 0..31): q = (qs[32h + l] >> 2p) & 3, sub-block i = 8h + 2p + l / 16;
// weight = (d * (scales[i] & 15)) * q - dmin * (scales[i] >> 4). Unit u: h, p of (u % 8), its 32 weights.
#define UNIT_WEIGHTS 32
__device__ __forceinline__ void unit_dequant(const u8* row, i64 u, float* w) {
    const u8* b = row + 84 * (u >> 3);
    int k = (int)(u & 7), h = k >> 2, p = k & 3;
    float d = load_half(b + 80), dmin = load_half(b + 82);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        u8 sc = b[8 * h + 2 * p + half];
        float dl = __fmul_rn(d, (float)(sc & 15)), ml = __fmul_rn(dmin, (float)(sc >> 4));
#pragma unroll
        for (int l = 0; l < 16; ++l)
            w[16 * half + l] = __fsub_rn(__fmul_rn(dl, (float)((b[16 + 32 * h + 16 * half + l] >> (2 * p)) & 3)), ml);
    }
}

// A slice: l = l0 .. l0 + 7 (l0 = 8 (k % 4)) of half h = k / 4 (k = s % 8, super-block s / 8): 8 bytes of qs at
// 32h + l0, 32 weights, part p's at column 128h + 32p + l, sub-block 8h + 2p + l0 / 16. Super-blocks are 4-byte
// multiples: aligned words.
#define SLICE_WEIGHTS 32
struct Slice {
    u32 q[2], sc[2], dd;  // quants, scales[8h .. 8h + 7], d | dmin << 16
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 84 * (s >> 3);
    int k = s & 7, h = k >> 2, l0 = 8 * (k & 3);
    Slice sl;
    const u32* q = (const u32*)(b + 16 + 32 * h + l0);
    const u32* sc = (const u32*)(b + 8 * h);
    sl.q[0] = q[0];
    sl.q[1] = q[1];
    sl.sc[0] = sc[0];
    sl.sc[1] = sc[1];
    sl.dd = *(const u32*)(b + 80);
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    int k = s & 7, h = k >> 2, l0 = 8 * (k & 3), second = l0 >> 4;
    const float* xs = x + 256 * (s >> 3) + 128 * h + l0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // part p: weights 32p + 0..7 of the slice's columns, 2-bit field p of each byte
        float q[RPT][8], dl[RPT], ml[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            u32 sc = (sl[r].sc[p >> 1] >> (8 * (2 * (p & 1) + second))) & 0xffu;
            dl[r] = half_to_float(sl[r].dd & 0xffffu) * (float)(sc & 15);
            ml[r] = half_to_float(sl[r].dd >> 16) * (float)(sc >> 4);
            u32 a = (sl[r].q[0] >> (2 * p)) & 0x03030303u, b = (sl[r].q[1] >> (2 * p)) & 0x03030303u;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                q[r][c] = BYTE_FLOAT(a, c, 0.0f);
                q[r][4 + c] = BYTE_FLOAT(b, c, 0.0f);
            }
        }
#pragma unroll
        for (int t = 0; t < TT; ++t) {
            if (t < n) {
                float4 x0 = *(const float4*)(xs + (i64)t * C + 32 * p), x1 = *(const float4*)(xs + (i64)t * C + 32 * p + 4);
                float xsum = (x0.x + x0.y) + (x0.z + x0.w) + ((x1.x + x1.y) + (x1.z + x1.w));
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    float dot = 0.0f;
                    DOT4(dot, q[r], 0, x0);
                    DOT4(dot, q[r], 4, x1);
                    acc[r][t] = fmaf(dl[r], dot, fmaf(-ml[r], xsum, acc[r][t]));
                }
            }
        }
    }
}
