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

// A slice: a quarter block, 8 weights (slice s: block s / 4, quants 8 (s % 4) ..); neighbouring
// lanes read neighbouring 8-byte runs. Dot: d * sum(q * x).
#define SLICE_WEIGHTS 8
struct Slice {
    u32 q[2];
    u16 d;
};

__device__ __forceinline__ Slice load_slice(const u8* row, int s) {
    const u8* b = row + 34 * (s >> 2);
    Slice sl;
    load_words_a2(b + 2 + 8 * (s & 3), sl.q, 2);
    sl.d = *(const u16*)b;
    return sl;
}

template <int RPT, int TT>
__device__ __forceinline__ void slice_dot(const Slice (&sl)[RPT], int s, const float* x, int C, int n,
                                          float (&acc)[RPT][TT]) {
    float w[RPT][8], d[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        d[r] = half_to_float(sl[r].d);
        u32 a = sl[r].q[0] ^ 0x80808080u, b = sl[r].q[1] ^ 0x80808080u;  // int8 + 128 as unsigned bytes
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[r][i] = BYTE_FLOAT(a, i, 128.0f);
            w[r][4 + i] = BYTE_FLOAT(b, i, 128.0f);
        }
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < n) {
            const float4* xs = (const float4*)(x + (i64)t * C + 8 * s);
            float4 x0 = xs[0], x1 = xs[1];
#pragma unroll
            for (int r = 0; r < RPT; ++r) {
                float dot = 0.0f;
                DOT4(dot, w[r], 0, x0);
                DOT4(dot, w[r], 4, x1);
                acc[r][t] = fmaf(d[r], dot, acc[r][t]);
            }
        }
    }
}

// The same slice dotted with int16 activations (XQ, the `_1q` kernels): d * dx * (sum of q * x, exact in
// int32 through dp4a).
#define INT_DECODE 1
template <int RPT>
__device__ __forceinline__ void slice_dot_q(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    uint2 h = *(const uint2*)(xq.hi + 8 * s), l = *(const uint2*)(xq.lo + 8 * s);
    float dx = xq.scale[s >> 2];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        int q0 = (int)sl[r].q[0], q1 = (int)sl[r].q[1];
        int a = dp4a(q1, (int)h.y, dp4a(q0, (int)h.x, 0)), b = dp4a(q1, (int)l.y, dp4a(q0, (int)l.x, 0));
        acc[r][0] = fmaf(half_to_float(sl[r].d) * dx, (float)(256 * a + b), acc[r][0]);
    }
}
