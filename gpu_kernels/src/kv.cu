// The paged KV cache: attention over K/V rows kept in blocks of BT positions, and the writes that
// fill them. Compiled once per storage type, named by a #define before this file: KV_F32 (float),
// KV_F16 (IEEE half bits), KV_BF16 (bf16 bits: the upper half of a float), KV_INT8 (int8 times a
// float scale per (position, kv head)). Rows are widened to float as they are read.
//
// Shape legend: T tokens, Hq / Hkv query / kv heads, G = Hq / Hkv, D head dim, BT positions a block,
// NB pool blocks, nS stage blocks, nb logical blocks, R query rows a block, NK keys a tile, S splits.
// Logical block b (positions [b * BT, (b + 1) * BT)) lives in pool block table[b] when that is >= 0,
// else in stage block b (the device copy of the positions the host keeps).

#if defined(KV_F32)
typedef float kv_t;
#elif defined(KV_F16) || defined(KV_BF16)
typedef u16 kv_t;
#elif defined(KV_INT8)
typedef i8 kv_t;
#else
#error "kv.cu needs one of KV_F32, KV_F16, KV_BF16, KV_INT8"
#endif

// Attention blocks: PA_THREADS threads. The tiled kernel (paged_attention): a thread scores its key
// against up to PA_ROWS_PER_THREAD rows and accumulates up to PA_OUTS output values (the host keeps
// R * D <= PA_OUTS * PA_THREADS). The one-token kernel (paged_attention_1): tiles of PD_KEYS keys, at
// most PD_MAX_KPG of them a lane group.
#define PA_THREADS 128
#define PA_ROWS_PER_THREAD 4
#define PA_OUTS 16
#define PD_KEYS 32
#define PD_MAX_KPG 8

// float -> IEEE half bits, rounded to nearest even (numpy's astype: subnormals, overflow to inf).
__device__ __forceinline__ u16 float_to_half_rn(float v) {
    u32 f = __float_as_uint(v);
    u32 sign = (f >> 16) & 0x8000u, a = f & 0x7fffffffu;
    if (a > 0x7f800000u) return (u16)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // nan stays a (quiet) nan
    if (a >= 0x38800000u) {  // normal half (or beyond: rounds to inf)
        u32 h = (a - 0x38000000u) >> 13, rem = a & 0x1fffu;
        h += (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ? 1u : 0u;
        return (u16)(sign | (h > 0x7c00u ? 0x7c00u : h));
    }
    u32 e = a >> 23;  // below 2^-14: a subnormal half, units of 2^-24
    if (e < 102u) return (u16)sign;  // below 2^-25
    u32 mant = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;  // shift 14 .. 24
    u32 h = mant >> shift, rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
    h += (rem > halfway || (rem == halfway && (h & 1u))) ? 1u : 0u;
    return (u16)(sign | h);
}

// One value of a row, widened (int8: before its row scale).
__device__ __forceinline__ float kv_widen(kv_t x) {
#if defined(KV_F32)
    return x;
#elif defined(KV_F16)
    return half_to_float(x);
#elif defined(KV_BF16)
    return bf16_to_float(x);
#else
    return (float)x;
#endif
}

// Values p[0 .. 3] widened (int8: before its row scale), in one load (p aligned to 4 values).
__device__ __forceinline__ void kv_widen4(const kv_t* p, float* f) {
#if defined(KV_F32)
    float4 x = *(const float4*)p;
    f[0] = x.x;
    f[1] = x.y;
    f[2] = x.z;
    f[3] = x.w;
#elif defined(KV_F16) || defined(KV_BF16)
    uint2 w = *(const uint2*)p;
    u32 words[2] = {w.x, w.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#if defined(KV_F16)
        f[2 * i] = half_to_float((u16)(words[i] & 0xffffu));
        f[2 * i + 1] = half_to_float((u16)(words[i] >> 16));
#else
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
#endif
    }
#else
    u32 w = *(const u32*)p;
#pragma unroll
    for (int b = 0; b < 4; ++b) f[b] = (float)(int)(i8)(u8)(w >> (8 * b));
#endif
}

// Where the rows of one kv head live: pool and stage, with their scales (int8), through the table.
struct PagedKV {
    const kv_t* k_pool;
    const kv_t* v_pool;
    const float* k_scale;
    const float* v_scale;
    const kv_t* k_stage;
    const kv_t* v_stage;
    const float* k_stage_scale;
    const float* v_stage_scale;
    const int* table;
    int BT, Hkv, D, kvh;
};

// K and V values d0 .. d0 + 3 of position p (d0 < D; those past D are 0), widened; vec: D % 4 == 0.
__device__ __forceinline__ void load_kv4(const PagedKV& kv, int p, int d0, bool vec, float* kf, float* vf) {
    int b = p / kv.BT, pb = kv.table[b];
    bool pool = pb >= 0;
    i64 row = ((i64)(pool ? pb : b) * kv.BT + (p - b * kv.BT)) * kv.Hkv + kv.kvh;
    const kv_t* kp = (pool ? kv.k_pool : kv.k_stage) + row * kv.D + d0;
    const kv_t* vp = (pool ? kv.v_pool : kv.v_stage) + row * kv.D + d0;
    if (vec) {
        kv_widen4(kp, kf);
        kv_widen4(vp, vf);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            kf[i] = d0 + i < kv.D ? kv_widen(kp[i]) : 0.0f;
            vf[i] = d0 + i < kv.D ? kv_widen(vp[i]) : 0.0f;
        }
    }
#if defined(KV_INT8)
    float k_mul = (pool ? kv.k_scale : kv.k_stage_scale)[row];
    float v_mul = (pool ? kv.v_scale : kv.v_stage_scale)[row];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        kf[i] *= k_mul;
        vf[i] *= v_mul;
    }
#endif
}

// K and V of positions [k0, k0 + NK), widened, into ks [NK][D + 1] and vs [NK][D]; positions at or
// past kend become 0 and are not read (unwritten rows may hold anything).
__device__ void load_kv_tile(const PagedKV& kv, int k0, int kend, int NK, bool vec, float* ks, float* vs) {
    int D = kv.D, chunks = (D + 3) / 4;
    for (int e = threadIdx.x; e < NK * chunks; e += blockDim.x) {
        int j = e / chunks, d0 = (e - j * chunks) * 4;
        float kf[4] = {0.0f, 0.0f, 0.0f, 0.0f}, vf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (k0 + j < kend) load_kv4(kv, k0 + j, d0, vec, kf, vf);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (d0 + i < D) {
                ks[j * (D + 1) + d0 + i] = kf[i];
                vs[j * D + d0 + i] = vf[i];
            }
        }
    }
}

__device__ __forceinline__ float group_max(float v, int width) {
    for (int m = width >> 1; m > 0; m >>= 1) v = fmaxf(v, SHFL_XOR(v, m, width));
    return v;
}

__device__ __forceinline__ float group_sum(float v, int width) {
    for (int m = width >> 1; m > 0; m >>= 1) v += SHFL_XOR(v, m, width);
    return v;
}

// Online softmax over one tile. Lane j of row group rg (NK lanes, one key each) holds the rows
// rg + i * (blockDim / NK), i < PA_ROWS_PER_THREAD: it scores key k0 + j against them (qs [R][D],
// ks [NK][D + 1]), keeps each row's running max m and sum l, and leaves the tile's probabilities in
// ps [R][NK] and each row's rescale of its earlier sums in cs [R]. Every thread takes part (shuffles).
__device__ __forceinline__ void softmax_tile(const float* qs, const float* ks, int R, int D, int NK, int k0,
                                             const int* kbeg, const int* kend, float scale, float* m, float* l,
                                             float* ps,
                                             float* cs) {
    int j = threadIdx.x % NK, rg = threadIdx.x / NK, num_groups = blockDim.x / NK;
    float s[PA_ROWS_PER_THREAD];
#pragma unroll
    for (int i = 0; i < PA_ROWS_PER_THREAD; ++i) s[i] = 0.0f;
    const float* kr = ks + j * (D + 1);
    for (int d = 0; d < D; ++d) {
        float kd = kr[d];
#pragma unroll
        for (int i = 0; i < PA_ROWS_PER_THREAD; ++i)
            if (rg + i * num_groups < R) s[i] = fmaf(qs[(rg + i * num_groups) * D + d], kd, s[i]);
    }
#pragma unroll
    for (int i = 0; i < PA_ROWS_PER_THREAD; ++i) {
        int r = rg + i * num_groups;
        float si = k0 + j >= kbeg[i] && k0 + j < kend[i] ? s[i] * scale : NEG_INF;
        float new_m = fmaxf(m[i], group_max(si, NK));
        float p = new_m == NEG_INF ? 0.0f : expf(si - new_m);
        float corr = m[i] == NEG_INF ? 0.0f : expf(m[i] - new_m);
        l[i] = l[i] * corr + group_sum(p, NK);
        m[i] = new_m;
        if (r < R) {
            ps[r * NK + j] = p;
            if (j == 0) cs[r] = corr;
        }
    }
}

// acc (output values e = threadIdx.x + c * blockDim of the tile's rows: row e / D, dim e % D) =
// acc * cs[row] + ps [R][NK] @ vs [NK][D].
__device__ __forceinline__ void accumulate_tile(const float* ps, const float* cs, const float* vs, int R, int D,
                                                int NK, float* acc) {
#pragma unroll
    for (int c = 0; c < PA_OUTS; ++c) {
        int e = threadIdx.x + c * blockDim.x;
        if (e < R * D) {
            int r = e / D, d = e - r * D;
            const float* pr = ps + r * NK;
            float a = acc[c] * cs[r];
            for (int jj = 0; jj < NK; ++jj) a = fmaf(pr[jj], vs[jj * D + d], a);
            acc[c] = a;
        }
    }
}

// Paged causal GQA attention. q [T, Hq, D] f32, query t at position start + t, attends keys
// [key_lo, start + t + 1), with window > 0 only those from start + t + 1 - window on (a sliding-window
// layer: the splits then start at the first query's window). A block takes R consecutive rows (token,
// head) of one kv head's T * G rows (row t * G + i is query head kv_head * G + i of token t), so they
// share each K/V tile, and split blockIdx.z of the keys: [key_lo + z * split_keys, + split_keys). It
// writes out [T, Hq, D] (0 when no key) and, when want_lse, lse [T, Hq] (max + log sum exp of the scaled
// scores, -inf when no key), at split z's slice (out + z * T * Hq * D, lse + z * T * Hq;
// paged_attention_merge sums them). start_at, when not null, holds start on the device (a captured decode
// step: its splits are planned for a bound on the keys, those past the last key empty).
// grid (ceil(T * G / R), Hkv, S), block PA_THREADS; NK keys a tile (a power of two, at most the wave
// size, dividing PA_THREADS); shared: R * D + NK * (2 * D + 1) + R * NK + 3 * R floats.
extern "C" __global__ void __launch_bounds__(PA_THREADS)
paged_attention(const float* q, const kv_t* k_pool, const kv_t* v_pool, const float* k_scale, const float* v_scale,
                const int* table, const kv_t* k_stage, const kv_t* v_stage, const float* k_stage_scale,
                const float* v_stage_scale, float* out, float* lse, int want_lse, int T, int Hq, int Hkv, int D,
                int BT, int start, int key_lo, float scale, int R, int NK, int split_keys, const i64* start_at,
                int window, int slot_table) {
    if (start_at) start = (int)start_at[0];
    if (window > 0) key_lo = max(key_lo, start + 1 - window);  // the first row's window: the splits' base
    extern __shared__ float sh[];
    float* qs = sh;                         // [R][D]
    float* ks = qs + R * D;                 // [NK][D + 1]
    float* vs = ks + NK * (D + 1);          // [NK][D]
    float* ps = vs + NK * D;                // [R][NK]
    float* cs = ps + R * NK;                // [R]
    float* ms = cs + R;                     // [R]
    float* ls = ms + R;                     // [R]
    PagedKV kv = {k_pool, v_pool, k_scale, v_scale, k_stage, v_stage, k_stage_scale, v_stage_scale, table,
                  BT, Hkv, D, (int)blockIdx.y};
    int G = Hq / Hkv, num_rows = T * G, row0 = blockIdx.x * R;
    int kb = key_lo + blockIdx.z * split_keys;
    int ke = min(kb + split_keys, start + (min(row0 + R, num_rows) - 1) / G + 1);
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int row = row0 + e / D;
        qs[e] = row < num_rows ? q[((i64)(row / G) * Hq + kv.kvh * G + row % G) * D + e % D] : 0.0f;
    }
    int rg = threadIdx.x / NK, num_groups = blockDim.x / NK;
    float m[PA_ROWS_PER_THREAD], l[PA_ROWS_PER_THREAD];
    int kbeg[PA_ROWS_PER_THREAD], kend[PA_ROWS_PER_THREAD];  // each row's keys in this split (kend 0: no such row)
#pragma unroll
    for (int i = 0; i < PA_ROWS_PER_THREAD; ++i) {
        int row = row0 + rg + i * num_groups;
        m[i] = NEG_INF;
        l[i] = 0.0f;
        kend[i] = rg + i * num_groups < R && row < num_rows ? min(start + row / G + 1, ke) : 0;
        kbeg[i] = window > 0 ? max(kb, start + row / G + 1 - window) : kb;
    }
    float acc[PA_OUTS];
#pragma unroll
    for (int c = 0; c < PA_OUTS; ++c) acc[c] = 0.0f;
    bool vec = D % 4 == 0;
    int k_first = window > 0 ? max(kb, start + row0 / G + 1 - window) : kb;  // the block's first row's window
    for (int k0 = k_first; k0 < ke; k0 += NK) {
        __syncthreads();  // the last tile's ps, cs and vs are read
        load_kv_tile(kv, k0, ke, NK, vec, ks, vs);
        __syncthreads();
        softmax_tile(qs, ks, R, D, NK, k0, kbeg, kend, scale, m, l, ps, cs);
        __syncthreads();
        accumulate_tile(ps, cs, vs, R, D, NK, acc);
    }
#pragma unroll
    for (int i = 0; i < PA_ROWS_PER_THREAD; ++i) {
        int r = rg + i * num_groups;
        if (r < R && threadIdx.x % NK == 0) {
            ms[r] = m[i];
            ls[r] = l[i];
        }
    }
    __syncthreads();
    i64 split_rows = (i64)blockIdx.z * T * Hq;
#pragma unroll
    for (int c = 0; c < PA_OUTS; ++c) {
        int e = threadIdx.x + c * blockDim.x, row = row0 + e / D;
        if (e < R * D && row < num_rows) {
            i64 o = split_rows + (i64)(row / G) * Hq + kv.kvh * G + row % G;
            float sum = ls[e / D];
            out[o * D + e % D] = sum > 0.0f ? acc[c] / sum : 0.0f;
        }
    }
    for (int r = threadIdx.x; want_lse && r < R && row0 + r < num_rows; r += blockDim.x) {
        int row = row0 + r;
        lse[split_rows + (i64)(row / G) * Hq + kv.kvh * G + row % G] = ls[r] > 0.0f ? ms[r] + logf(ls[r]) : NEG_INF;
    }
}

// The one-token kernel. A lane group of LG lanes (a power of two, 8 .. the wave size, 4 * LG >= D)
// takes a key at a time, lane l its values 4l .. 4l + 3, with the query values of R rows (heads) in
// registers; the block's PA_THREADS / LG groups take a tile's PD_KEYS keys between them.

// Sums over the `width` lanes of each of v's R values (R <= width, powers of two); each lane ends with
// one of them, sum lane / (width / R). The first log2(R) steps halve the values a lane holds.
template <int R>
__device__ __forceinline__ float reduce_scatter(float (&v)[R], int width) {
    int lane = threadIdx.x & (width - 1), m = width >> 1;
#pragma unroll
    for (int half = R / 2; half >= 1; half /= 2, m >>= 1) {
        bool upper = (lane & m) != 0;
#pragma unroll
        for (int i = 0; i < half; ++i) {
            float send = upper ? v[i] : v[i + half], keep = upper ? v[i + half] : v[i];
            v[i] = keep + SHFL_XOR(send, m, width);
        }
    }
    for (; m > 0; m >>= 1) v[0] += SHFL_XOR(v[0], m, width);
    return v[0];
}

// Scores of the group's kpg keys (k0 + first ..) against the R rows into sc [R][PD_KEYS]; -inf at
// and past kend.
template <int R>
__device__ __forceinline__ void score_keys(const float (&qv)[R][4], const float (&kf)[PD_MAX_KPG][4], int kpg,
                                           int first, int k0, int kend, float scale, int LG, float* sc) {
    int lane = threadIdx.x & (LG - 1), span = LG / R;
#pragma unroll
    for (int kk = 0; kk < PD_MAX_KPG; ++kk) {
        if (kk < kpg) {  // the same in the whole block
            float s[R];
#pragma unroll
            for (int r = 0; r < R; ++r)
                s[r] = fmaf(qv[r][3], kf[kk][3],
                            fmaf(qv[r][2], kf[kk][2], fmaf(qv[r][1], kf[kk][1], qv[r][0] * kf[kk][0])));
            float total = reduce_scatter<R>(s, LG);
            int key = first + kk;
            if ((lane & (span - 1)) == 0)
                sc[(lane / span) * PD_KEYS + key] = k0 + key < kend ? total * scale : NEG_INF;
        }
    }
}

// Online softmax step of R rows over the tile's scores sc [R][PD_KEYS] (left as probabilities): from
// the running max and sum prev [2][R] to next [2][R], each row's rescale of its earlier sums in cs [R].
__device__ __forceinline__ void softmax_rows(float* sc, float* cs, const float* prev, float* next, int R) {
    for (int e = threadIdx.x; e < R * PD_KEYS; e += blockDim.x) {  // a row's PD_KEYS lanes loop together
        int r = e / PD_KEYS;
        float m_old = prev[r], s = sc[e];
        float new_m = fmaxf(m_old, group_max(s, PD_KEYS));
        float p = new_m == NEG_INF ? 0.0f : expf(s - new_m);
        float sum = group_sum(p, PD_KEYS);
        sc[e] = p;
        if (e % PD_KEYS == 0) {
            float corr = m_old == NEG_INF ? 0.0f : expf(m_old - new_m);
            cs[r] = corr;
            next[r] = new_m;
            next[R + r] = prev[R + r] * corr + sum;
        }
    }
}

// Heads h0 .. h0 + R - 1 (h0 = blockIdx.x * R; those at or past G skipped) of kv head kv.kvh, one token
// (q [Hq, D]), over split blockIdx.z of its keys; writes as paged_attention, its rows at row0 (the slot's first).
template <int R>
__device__ void attend_one(const float* q, const PagedKV& kv, float* out, float* lse, int want_lse, int Hq,
                           int start, int key_lo, float scale, int LG, int split_keys, i64 row0) {
    extern __shared__ float sh[];
    int D = kv.D, G = Hq / kv.Hkv, h0 = blockIdx.x * R, q0 = kv.kvh * G + h0;
    int lane = threadIdx.x & (LG - 1), grp = threadIdx.x / LG, num_groups = blockDim.x / LG;
    int kpg = PD_KEYS / num_groups;
    float* sc = sh;                // [R][PD_KEYS] the tile's scores, then probabilities
    float* cs = sc + R * PD_KEYS;  // [R]
    float* stats = cs + R;         // [2 (by tile parity)][2 (max, sum)][R]
    float* red = stats + 4 * R;    // [groups][R][D] the groups' sums, at the end
    int kb = key_lo + blockIdx.z * split_keys, ke = min(kb + split_keys, start + 1);
    float qv[R][4], acc[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int d = 4 * lane + i;
            qv[r][i] = d < D && h0 + r < G ? q[(i64)(q0 + r) * D + d] : 0.0f;
            acc[r][i] = 0.0f;
        }
    if (threadIdx.x < R) {
        stats[threadIdx.x] = NEG_INF;
        stats[R + threadIdx.x] = 0.0f;
    }
    bool vec = D % 4 == 0;
    int cur = 0;
    for (int k0 = kb; k0 < ke; k0 += PD_KEYS, cur ^= 1) {
        float kf[PD_MAX_KPG][4], vf[PD_MAX_KPG][4];
#pragma unroll
        for (int kk = 0; kk < PD_MAX_KPG; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) kf[kk][i] = vf[kk][i] = 0.0f;
            int p = k0 + grp * kpg + kk;
            if (kk < kpg && p < ke && 4 * lane < D) load_kv4(kv, p, 4 * lane, vec, kf[kk], vf[kk]);
        }
        __syncthreads();  // the last tile's probabilities are read
        score_keys<R>(qv, kf, kpg, grp * kpg, k0, ke, scale, LG, sc);
        __syncthreads();
        softmax_rows(sc, cs, stats + cur * 2 * R, stats + (cur ^ 1) * 2 * R, R);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float c = cs[r];
#pragma unroll
            for (int kk = 0; kk < PD_MAX_KPG; ++kk) {
                float p = kk < kpg ? sc[r * PD_KEYS + grp * kpg + kk] : 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(p, vf[kk][i], kk == 0 ? acc[r][i] * c : acc[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (4 * lane + i < D) red[(grp * R + r) * D + 4 * lane + i] = acc[r][i];
    __syncthreads();
    const float* fin = stats + cur * 2 * R;
    i64 o = row0 + q0;  // this split's slice
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int r = e / D, d = e - r * D;
        if (h0 + r < G) {
            float a = 0.0f;
            for (int g = 0; g < num_groups; ++g) a += red[(g * R + r) * D + d];
            out[(o + r) * D + d] = fin[R + r] > 0.0f ? a / fin[R + r] : 0.0f;
        }
    }
    int r = threadIdx.x;
    if (want_lse && r < R && h0 + r < G) lse[o + r] = fin[R + r] > 0.0f ? fin[r] + logf(fin[R + r]) : NEG_INF;
}

// The one-token kernels over n slots (one-token sequences) in one launch: grid y = slot * Hkv + kv head. Slot t's
// query is q [n, Hq, D]'s row t, its table table + t * slot_table, its position start_at[t] (start_at null: one slot
// at `start`); split z of its rows goes to row (z * n + t) * Hq of out / lse ([S, n, Hq(, D)]: split parts, or with
// S = 1 the output [n, Hq, D] itself). (slot, kv head) of a block; moves q and table to its slot's.
__device__ __forceinline__ int2 slot_of_block(const float*& q, const int*& table, int& start, const i64* start_at,
                                              int Hq, int Hkv, int D, int slot_table) {
    int t = blockIdx.y / Hkv;
    if (start_at) start = (int)start_at[t];
    q += (i64)t * Hq * D;
    table += (i64)t * slot_table;
    return make_int2(t, blockIdx.y - t * Hkv);
}

// paged_attention of one token (T = 1; window as there), its G heads a kv head sharing every K/V load:
// R (1, 2, 4 or 8, at most LG) heads a block. grid (ceil(G / R), n * Hkv, S) (slot_of_block), block PA_THREADS; LG
// as above; shared: R * PD_KEYS + 5 * R + (PA_THREADS / LG) * R * D floats.
#define PA1_ARGS                                                                                                   \
    const float *q, const kv_t *k_pool, const kv_t *v_pool, const float *k_scale, const float *v_scale,            \
        const int *table, const kv_t *k_stage, const kv_t *v_stage, const float *k_stage_scale,                    \
        const float *v_stage_scale, float *out, float *lse, int want_lse, int Hq, int Hkv, int D, int BT, int start, \
        int key_lo, float scale, int R, int LG, int split_keys, const i64 *start_at, int window, int slot_table
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attention_1(PA1_ARGS) {
    int2 slot = slot_of_block(q, table, start, start_at, Hq, Hkv, D, slot_table);
    if (window > 0) key_lo = max(key_lo, start + 1 - window);
    PagedKV kv = {k_pool, v_pool, k_scale, v_scale, k_stage, v_stage, k_stage_scale, v_stage_scale, table,
                  BT, Hkv, D, slot.y};
    i64 row0 = ((i64)blockIdx.z * (gridDim.y / Hkv) + slot.x) * Hq;
    if (R == 1) attend_one<1>(q, kv, out, lse, want_lse, Hq, start, key_lo, scale, LG, split_keys, row0);
    else if (R == 2) attend_one<2>(q, kv, out, lse, want_lse, Hq, start, key_lo, scale, LG, split_keys, row0);
    else if (R == 4) attend_one<4>(q, kv, out, lse, want_lse, Hq, start, key_lo, scale, LG, split_keys, row0);
    else attend_one<8>(q, kv, out, lse, want_lse, Hq, start, key_lo, scale, LG, split_keys, row0);
}

// out [T, Hq, D] (and lse [T, Hq] when want_lse) from the S partial results of paged_attention's
// splits, part [S, T, Hq, D] and part_lse [S, T, Hq]: weights exp(lse_s - max), a split with no key
// (-inf) weighs 0. grid (T * Hq); shared: S floats.
extern "C" __global__ void paged_attention_merge(const float* part, const float* part_lse, float* out, float* lse,
                                                 int want_lse, int S, int num_rows, int D) {
    extern __shared__ float w[];
    i64 o = blockIdx.x;
    float m = NEG_INF;
    for (int s = 0; s < S; ++s) m = fmaxf(m, part_lse[s * (i64)num_rows + o]);
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        float ls = part_lse[s * (i64)num_rows + o];
        w[s] = ls == NEG_INF ? 0.0f : expf(ls - m);
    }
    __syncthreads();
    float total = 0.0f;
    for (int s = 0; s < S; ++s) total += w[s];
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < S; ++s)
            if (w[s] > 0.0f) a = fmaf(w[s], part[(s * (i64)num_rows + o) * D + d], a);
        out[o * D + d] = total > 0.0f ? a / total : 0.0f;
    }
    if (want_lse && threadIdx.x == 0) lse[o] = total > 0.0f ? m + logf(total) : NEG_INF;
}

// Rows x [n, Hkv, D] f32 of positions start .. start + n - 1 (start_at: start on the device, or null),
// encoded (as hybrid/kv_store.py's encode) into pool [NB, BT, Hkv, D] through table (pool blocks only); int8
// also writes scale [NB, BT, Hkv]. slot_table > 0: row t is slot t's (n one-token sequences), at position
// start_at[t] through table + t * slot_table.
// grid (n * Hkv, 1 or 2): blocks of y = 1 write x2 into pool2 and scale2 instead (v's rows beside k's, one launch).
// shared (int8): blockDim floats, blockDim a power of two.
extern "C" __global__ void kv_write(const float* x, kv_t* pool, float* scale, const float* x2, kv_t* pool2,
                                    float* scale2, const int* table, int start, int Hkv, int D, int BT,
                                    const i64* start_at, int slot_table) {
    if (blockIdx.y) {
        x = x2;
        pool = pool2;
        scale = scale2;
    }
    int t = blockIdx.x / Hkv;
    if (slot_table > 0) {
        start = (int)start_at[t] - t;
        table += (i64)t * slot_table;
    } else if (start_at) {
        start = (int)start_at[0];
    }
    int p = start + t, b = p / BT;
    i64 row = ((i64)table[b] * BT + (p - b * BT)) * Hkv + blockIdx.x % Hkv;
    const float* xr = x + (i64)blockIdx.x * D;
    kv_t* dst = pool + row * D;
#if defined(KV_INT8)
    extern __shared__ float red[];
    float amax = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) amax = fmaxf(amax, fabsf(xr[d]));
    amax = block_max(amax, red);
    float row_scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        dst[d] = (i8)(int)fminf(fmaxf(rintf(xr[d] / row_scale), -127.0f), 127.0f);
    if (threadIdx.x == 0) scale[row] = row_scale;
#else
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = xr[d];
#if defined(KV_F32)
        dst[d] = v;
#elif defined(KV_F16)
        dst[d] = float_to_half_rn(v);
#else
        u32 bits = __float_as_uint(v);
        dst[d] = (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
#endif
    }
#endif
}
