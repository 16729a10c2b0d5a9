// Prompt-chunk attention on tensor cores (flash-attention style), after kv.cu in the kv modules (its kv_t, PagedKV,
// load_kv4). A block of PF_THREADS (4 warps) takes PF_ROWS query rows (token, head) of one kv head, warp w the 16
// rows 16 w .. 16 w + 15 (one m16 tile), their queries held in registers as mma A fragments; it streams the keys
// by tiles of PF_KEYS positions, K and V widened to float into shared memory (shared by the 64 rows), and keeps an
// online softmax per row in registers: S = Q K^T and O += P V by mma.sync m16n8k8, P never leaving registers (its
// C-fragment values are the A fragment of the keys' order (2c, 2c + 1) -> (c, c + 4): V's B fragment reads keys
// 8 kk + 2c and 8 kk + 2c + 1).
//
// Products (PF_MATH): 3 (default) 3xTF32 as gemm.cu's GEMM_MATH 3 (each operand a TF32 high part and the TF32 part
// of its remainder: lo x hi, hi x lo, hi x hi), near float32; f16 and bf16 K/V are TF32 values already, their
// remainder 0, so their hi x lo pass is left out. 1 (opt-in, gemm_math "tf32"): one mma of operands rounded to
// TF32. The mma accumulate into fresh fragments, added in float32 (S once per PF_DSTEP dims, O once per key tile):
// an H100's tensor cores truncate their sums. CUDA sm_80+ only (PF_MMA); elsewhere paged_prefill is an empty
// kernel that the host never launches (attention_plan's `mma`: the paged_attention kernel instead).
//
// Shape legend: T tokens, Hq / Hkv query / kv heads, G = Hq / Hkv, D head dim (64 or 128), BT positions a block,
// NK = PF_KEYS keys a tile, g = lane / 4, c = lane % 4 (a fragment's row and column group).

#define PF_THREADS 128
#define PF_ROWS 64  // query rows a block: 16 a warp
#ifndef PF_MIN_BLOCKS
#define PF_MIN_BLOCKS 2  // blocks a multiprocessor holds (__launch_bounds__: registers a thread at most 255)
#endif
#define PF_DSTEP 32  // dims of S's products summed in one fresh fragment
#define PF_PAD 4  // K and V tiles' row stride D + PF_PAD (fragments' 32 lanes on 32 banks)
#ifndef PF_VGROUP
#define PF_VGROUP 4  // n8 tiles of O's dims whose P V products interleave (fresh accumulators in registers)
#endif
#ifndef PF_MATH
#define PF_MATH 3
#endif
#ifndef PF_MMA
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC_RTC__)
#define PF_MMA 1
#else
#define PF_MMA 0
#endif
#endif
// PF_ASYNC (on by default for f32 K/V on the mma path): the next tile's K and V copied by cp.async into a second
// buffer while the block computes on this one; two buffers of PF_KEYS 16 fit the 48 KiB of static shared memory (as
// fast as two of 32 in dynamic shared memory: bench/results/vs_llamacpp_gpu.md, session 50). The other types widen
// their rows as they load them: one buffer of 32 keys. PF_KEYS, PF_ASYNC, PF_DYNAMIC_SHARED: compile-time
// alternatives for bench/gpu_prefill_attention.py --variants.
#ifndef PF_ASYNC
#define PF_ASYNC 1
#endif
#if !defined(KV_F32) || !PF_MMA
#undef PF_ASYNC
#define PF_ASYNC 0
#endif
#ifndef PF_KEYS
#define PF_KEYS (PF_ASYNC ? 16 : 32)  // keys a tile
#endif
#define PF_BUFS (PF_ASYNC ? 2 : 1)
#ifndef PF_DYNAMIC_SHARED  // 1: the tiles in dynamic shared memory, PF_SHARED_BYTES (the host allows past 48 KiB)
#define PF_DYNAMIC_SHARED 0
#endif
#define PF_SHARED_BYTES (PF_BUFS * 2 * PF_KEYS * (128 + PF_PAD) * 4)
static_assert(PF_DYNAMIC_SHARED || PF_SHARED_BYTES <= 48 * 1024, "K and V tiles fit static shared memory");
#if defined(KV_F16) || defined(KV_BF16)
#define PF_KV_TF32 1  // K and V values are TF32 values: their split's remainder is 0
#else
#define PF_KV_TF32 0
#endif

#if PF_MMA
#ifndef PF_MMA_EMULATED
// d [16 x 8] += a [16 x 8] @ b [8 x 8] over the warp (as gemm.cu's gemm_mma: PTX mma.m16n8k8 .tf32, each operand's
// low 13 bits ignored; a (g, c), (g + 8, c), (g, c + 4), (g + 8, c + 4); b (c, g), (c + 4, g); d (g, 2c), (g, 2c + 1),
// (g + 8, 2c), (g + 8, 2c + 1)).
__device__ __forceinline__ void pf_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#if PF_ASYNC
// 16 bytes global -> shared, in flight until pf_wait_prior / the group after it is waited for.
__device__ __forceinline__ void pf_copy16(float* dst, const float* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void pf_wait_prior() { asm volatile("cp.async.wait_group 1;"); }
#endif
#endif

// hi, lo = v's TF32 split (gemm.cu's gemm_split): PF_MATH 3 hi = v (read truncated), lo = v - trunc(v); PF_MATH 1
// hi = v rounded to TF32, lo unused.
__device__ __forceinline__ void pf_split(float v, u32& hi, u32& lo) {
    hi = __float_as_uint(v) + (PF_MATH == 3 ? 0u : 0x1000u);
    lo = PF_MATH == 3 ? __float_as_uint(v - __uint_as_float(hi & 0xffffe000u)) : 0u;
}

// d[j] += a @ b[j] for the NJ n8 tiles j in PF_MATH's passes (3: a's lo x b's hi, then, b_split, a's hi x b's lo, then
// hi x hi; 1: hi x hi), a pass over all the tiles before the next, so that an accumulator's next mma waits behind the
// others' (mma.sync's latency; asm volatile keeps this order).
template <int NJ>
__device__ __forceinline__ void pf_products(float (&d)[NJ][4], const u32 (&ah)[4], const u32 (&al)[4],
                                            const u32 (&bh)[NJ][2], const u32 (&bl)[NJ][2], bool b_split) {
    if (PF_MATH == 3) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) pf_mma(d[j], al, bh[j]);
        if (b_split)
#pragma unroll
            for (int j = 0; j < NJ; ++j) pf_mma(d[j], ah, bl[j]);
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) pf_mma(d[j], ah, bh[j]);
}

// K and V of keys [k0, k0 + NK) widened into tile [K, V][NK][D + PF_PAD], keys at or past ke 0 (not read). PF_ASYNC:
// cp.async copies (f32 rows as they are) left in flight for pf_wait_prior.
template <int D>
__device__ __forceinline__ void pf_load_tile(const PagedKV& kv, int k0, int ke, float* tile) {
    const int KS = D + PF_PAD;
    for (int e = threadIdx.x; e < PF_KEYS * (D / 4); e += PF_THREADS) {
        int j = e / (D / 4), d0 = (e - j * (D / 4)) * 4;
        float* kd = tile + j * KS + d0;
        float* vd = kd + PF_KEYS * KS;
#if PF_ASYNC
        if (k0 + j < ke) {
            int p = k0 + j, b = p / kv.BT, pb = kv.table[b];
            bool pool = pb >= 0;
            i64 row = ((i64)(pool ? pb : b) * kv.BT + (p - b * kv.BT)) * kv.Hkv + kv.kvh;
            pf_copy16(kd, (pool ? kv.k_pool : kv.k_stage) + row * D + d0);
            pf_copy16(vd, (pool ? kv.v_pool : kv.v_stage) + row * D + d0);
        } else {
            *(float4*)kd = *(float4*)vd = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#else
        float kf[4] = {0.0f, 0.0f, 0.0f, 0.0f}, vf[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (k0 + j < ke) load_kv4(kv, k0 + j, d0, true, kf, vf);
        *(float4*)kd = make_float4(kf[0], kf[1], kf[2], kf[3]);
        *(float4*)vd = make_float4(vf[0], vf[1], vf[2], vf[3]);
#endif
    }
}

// The block's rows row0 .. row0 + PF_ROWS - 1 of kv head kv.kvh over keys [kb, ke) (each row's own range within it);
// writes as paged_attention. tiles: shared, PF_BUFS buffers of K and V [NK][D + PF_PAD].
template <int D>
__device__ __forceinline__ void prefill_rows(const float* q, const PagedKV& kv, float* out, float* lse, int want_lse,
                                             int T, int Hq, int row0, int start, int kb, int ke, int window,
                                             float scale, float* tiles) {
    const int KS = D + PF_PAD, NT = PF_KEYS / 8, DT = D / 8;
    int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, warp = threadIdx.x / 32;
    int G = Hq / kv.Hkv, num_rows = T * G;
    // the lane's rows g and g + 8 of the warp: their query values (A fragments by 8 dims), key ranges, softmax state
    float qf[DT][4];
    int kbeg[2], kend[2];
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // l: the lane's part of the row's sum
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int row = row0 + 16 * warp + g + 8 * h, t = row / G;
        bool real = row < num_rows;
        const float* qr = q + ((i64)t * Hq + kv.kvh * G + row % G) * D;
#pragma unroll
        for (int kk = 0; kk < DT; ++kk) {
            qf[kk][h] = real ? qr[8 * kk + c] : 0.0f;
            qf[kk][2 + h] = real ? qr[8 * kk + c + 4] : 0.0f;
        }
        kend[h] = real ? min(start + t + 1, ke) : 0;
        kbeg[h] = window > 0 ? max(kb, start + t + 1 - window) : kb;
    }
    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[j][i] = 0.0f;
    int first_t = row0 / G, k_first = window > 0 ? max(kb, start + first_t + 1 - window) : kb;
    int num_tiles = k_first < ke ? (ke - k_first + PF_KEYS - 1) / PF_KEYS : 0;
    const int TILE = 2 * PF_KEYS * KS;  // floats of a buffer: K then V [NK][D + PF_PAD]
#if PF_ASYNC
    if (num_tiles > 0) pf_load_tile<D>(kv, k_first, ke, tiles);
    pf_commit();
#endif
    for (int it = 0; it < num_tiles; ++it) {
        int k0 = k_first + it * PF_KEYS;
        __syncthreads();  // the last tile is read (PF_ASYNC: the buffer the next one fills)
#if PF_ASYNC
        const float* ks = tiles + (it & 1) * TILE;
        if (it + 1 < num_tiles) pf_load_tile<D>(kv, k0 + PF_KEYS, ke, tiles + ((it + 1) & 1) * TILE);
        pf_commit();
        pf_wait_prior();  // all but the copies of the next tile landed
#else
        const float* ks = tiles;
        pf_load_tile<D>(kv, k0, ke, tiles);
#endif
        const float* vs = ks + PF_KEYS * KS;
        __syncthreads();
        // S [16][NK] = Q K^T: n8 tile j holds keys 8 j .. 8 j + 7; lane (g, c) reads K[8 j + g][8 kk + c (+ 4)]
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[j][i] = 0.0f;
#pragma unroll
        for (int d0 = 0; d0 < DT; d0 += PF_DSTEP / 8) {
            float part[NT][4];
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[j][i] = 0.0f;
#pragma unroll
            for (int kk = d0; kk < d0 + PF_DSTEP / 8; ++kk) {
                u32 ah[4], al[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) pf_split(qf[kk][i], ah[i], al[i]);
                u32 bh[NT][2], bl[NT][2];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const float* kr = ks + (8 * j + g) * KS + 8 * kk + c;
                    pf_split(kr[0], bh[j][0], bl[j][0]);
                    pf_split(kr[4], bh[j][1], bl[j][1]);
                }
                pf_products<NT>(part, ah, al, bh, bl, !PF_KV_TF32);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[j][i] += part[j][i];
        }
        // online softmax of rows g (values 0, 1) and g + 8 (2, 3), keys k0 + 8 j + 2 c (+ 1); the quad's 4 lanes
        // hold a row's keys
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int key = k0 + 8 * j + 2 * c + e;
                    float v = key >= kbeg[h] && key < kend[h] ? s[j][2 * h + e] * scale : NEG_INF;
                    s[j][2 * h + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, SHFL_XOR(mx, 1, 32));
            mx = fmaxf(mx, SHFL_XOR(mx, 2, 32));
            float new_m = fmaxf(m[h], mx), sum = 0.0f;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float p = new_m == NEG_INF ? 0.0f : expf(s[j][2 * h + e] - new_m);
                    s[j][2 * h + e] = p;
                    sum += p;
                }
            corr[h] = m[h] == NEG_INF ? 0.0f : expf(m[h] - new_m);
            l[h] = l[h] * corr[h] + sum;
            m[h] = new_m;
        }
        // O [16][D] = O * corr + P V: P's k-step kk = keys 8 kk .. (lane (g, c) holds keys 2c, 2c + 1 of rows g,
        // g + 8: A columns c, c + 4), V's B fragment (c, g), (c + 4, g) = V[8 kk + 2c (+ 1)][8 j + g]
        u32 ph[NT][4], pl[NT][4];
#pragma unroll
        for (int kk = 0; kk < NT; ++kk) {
            pf_split(s[kk][0], ph[kk][0], pl[kk][0]);
            pf_split(s[kk][2], ph[kk][1], pl[kk][1]);
            pf_split(s[kk][1], ph[kk][2], pl[kk][2]);
            pf_split(s[kk][3], ph[kk][3], pl[kk][3]);
        }
        // by groups of PF_VGROUP n8 tiles of D, their accumulators fresh
#pragma unroll
        for (int j0 = 0; j0 < DT; j0 += PF_VGROUP) {
            float part[PF_VGROUP][4];
#pragma unroll
            for (int j = 0; j < PF_VGROUP; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[j][i] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < NT; ++kk) {
                u32 bh[PF_VGROUP][2], bl[PF_VGROUP][2];
#pragma unroll
                for (int j = 0; j < PF_VGROUP; ++j) {
                    const float* vr = vs + (8 * kk + 2 * c) * KS + 8 * (j0 + j) + g;
                    pf_split(vr[0], bh[j][0], bl[j][0]);
                    pf_split(vr[KS], bh[j][1], bl[j][1]);
                }
                pf_products<PF_VGROUP>(part, ph[kk], pl[kk], bh, bl, !PF_KV_TF32);
            }
#pragma unroll
            for (int j = 0; j < PF_VGROUP; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) o[j0 + j][i] = fmaf(o[j0 + j][i], corr[i / 2], part[j][i]);
        }
    }
    // the rows' sums over their quads; out and lse at the split's slice
    i64 split_rows = (i64)blockIdx.z * T * Hq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];
        sum += SHFL_XOR(sum, 1, 32);
        sum += SHFL_XOR(sum, 2, 32);
        int row = row0 + 16 * warp + g + 8 * h;
        if (row < num_rows) {
            i64 orow = split_rows + (i64)(row / G) * Hq + kv.kvh * G + row % G;
#pragma unroll
            for (int j = 0; j < DT; ++j) {
                float2 v;
                v.x = sum > 0.0f ? o[j][2 * h] / sum : 0.0f;
                v.y = sum > 0.0f ? o[j][2 * h + 1] / sum : 0.0f;
                *(float2*)(out + orow * D + 8 * j + 2 * c) = v;
            }
            if (want_lse && c == 0) lse[orow] = sum > 0.0f ? m[h] + logf(sum) : NEG_INF;
        }
    }
}
#endif

// paged_attention (kv.cu; the same arguments, R and NK unused: PF_ROWS and PF_KEYS) for prompt chunks of head dim 64
// or 128 on tensor cores. grid (ceil(T * G / PF_ROWS), Hkv, S), block PF_THREADS, static shared memory only.
extern "C" __global__ void __launch_bounds__(PF_THREADS, PF_MIN_BLOCKS)
paged_prefill(const float* q, const kv_t* k_pool, const kv_t* v_pool, const float* k_scale, const float* v_scale,
              const int* table, const kv_t* k_stage, const kv_t* v_stage, const float* k_stage_scale,
              const float* v_stage_scale, float* out, float* lse, int want_lse, int T, int Hq, int Hkv, int D, int BT,
              int start, int key_lo, float scale, int R, int NK, int split_keys, const i64* start_at, int window,
              int slot_table) {
#if PF_MMA
    if (start_at) start = (int)start_at[0];
    if (window > 0) key_lo = max(key_lo, start + 1 - window);  // the first row's window: the splits' base
    PagedKV kv = {k_pool, v_pool, k_scale, v_scale, k_stage, v_stage, k_stage_scale, v_stage_scale, table,
                  BT, Hkv, D, (int)blockIdx.y};
    // the last rows' tile first: the blocks of most keys start first, those of few fill in behind them
    int G = Hq / Hkv, row0 = (gridDim.x - 1 - blockIdx.x) * PF_ROWS, last = min(row0 + PF_ROWS, T * G) - 1;
    int kb = key_lo + blockIdx.z * split_keys, ke = min(kb + split_keys, start + last / G + 1);
#if PF_DYNAMIC_SHARED
    extern __shared__ float4 pf_tiles[];  // [PF_BUFS][K, V][NK][D + PF_PAD]
#else
    __shared__ float4 pf_tiles[PF_SHARED_BYTES / 16];  // [PF_BUFS][K, V][NK][D + PF_PAD]
#endif
    float* sh = (float*)pf_tiles;
    if (D == 128) prefill_rows<128>(q, kv, out, lse, want_lse, T, Hq, row0, start, kb, ke, window, scale, sh);
    else prefill_rows<64>(q, kv, out, lse, want_lse, T, Hq, row0, start, kb, ke, window, scale, sh);
#endif
}
