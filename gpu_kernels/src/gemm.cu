// Shared-memory tiled matmuls for prompt chunks, compiled into the matmul modules of gemm.py's GEMM_FORMATS after
// matmul.cu: they read the format's UNIT_WEIGHTS and unit_dequant (bit-exact with gguf).
// A block computes an output tile of GEMM_ROWS weight rows x TOKENS tokens (64: `gemm`, 32: `gemm32`). Its threads
// copy the raw bytes of a stage of GEMM_STAGE_COLS columns of its rows into shared memory (neighbouring threads,
// neighbouring words); then per step of K columns thread i dequantizes row i's step from there into the weight
// tile (shared memory), the x tile (loaded a step ahead) is stored beside it, and each thread accumulates its
// micro-tile of GEMM_TM rows x TOKENS / 8 tokens in float32.
// A weight is dequantized once per block, for all the block's tokens (the TILE_TOKENS kernels do it once per 8
// tokens). Threads whose tokens lie past the tile's count skip the products (a MoE tile holds its expert's pairs).
// gemm.py's gemm_defines sets, per format: GEMM_BLOCK_WEIGHTS and GEMM_BLOCK_BYTES (the format's block) and
// GEMM_STAGE_COLS (whole blocks, a multiple of 32; C must be a multiple). K is 16 where the format's units allow
// (GEMM_STEP), else 32; the three tiles fit 48 KiB of static shared memory.
//
// Products (GEMM_MATH): 3 (default) tensor cores in 3xTF32, each operand split into a TF32 high part and the TF32
// rounding of its remainder, three mma.sync (lo x hi, hi x lo, hi x hi) a product, near float32 accuracy; 1 (opt-in,
// "tf32") one mma.sync of the operands rounded to TF32 (10-bit mantissas); 0 ("fp32") float32 FMA. The tensor-core
// paths are CUDA sm_80+ only (GEMM_MMA); the HIP build and older targets take the FMA path whatever GEMM_MATH says.
// With mma.sync, warp w takes rows 32 w .. 32 w + 31 of the tile (two m16 tiles) and all its tokens (n8 tiles past
// the tile's count skipped); the weight and x tiles are stored as float4s of 4 columns, ws [K / 4][GEMM_ROWS][4] and
// xs [K / 4][TOKENS][4] (a thread's 16-byte stores; a fragment's lanes (g, c) read words 4 g + c: 32 banks).
//
// Shape legend: R output rows, C columns, B bytes per row, T tokens, N pair rows, W work tiles,
// n tokens of a tile (<= TOKENS).

#define GEMM_ROWS 128
#define GEMM_THREADS 128  // = GEMM_ROWS: thread i dequantizes row i of the tile
#define GEMM_TM 8         // rows a thread: two runs of 4, GEMM_ROWS / 2 apart (float4 reads without bank conflicts)
#define GEMM_RG (GEMM_ROWS / GEMM_TM)  // row groups: thread t takes row group t % GEMM_RG, token group t / GEMM_RG
#define GEMM_STAGE_BYTES (GEMM_STAGE_COLS / GEMM_BLOCK_WEIGHTS * GEMM_BLOCK_BYTES)  // a row's raw bytes a stage
#define GEMM_STAGE_WORDS (((GEMM_STAGE_BYTES + 3) / 4) | 1)  // a staged row's stride: odd, no bank conflicts
#define GEMM_SHARED(T, K) (4 * (K) * (GEMM_ROWS + (T)) + 4 * GEMM_ROWS * GEMM_STAGE_WORDS)  // bytes of the 3 tiles
// K of the TOKENS = T kernel: on the FMA path 16 wherever the format's units allow (GEMM_STEP_MAX 16: on an H100
// Q6_K's and F32's expert GEMMs ran 7-17 % faster than at 32, the others the same), else 32; on the mma path
// (GEMM_MMA) 32 wherever the tiles fit (GEMM_STEP_MAX 32: Q6_K's expert GEMMs 6-7 % faster, its dense 2048 x 4096 at
// 512 tokens 18 %, Q4_K the same). GEMM_STEP_MAX is a compile-time alternative for bench/gpu_gemm.py --variants.
#ifndef GEMM_STEP_MAX
#define GEMM_STEP_MAX (GEMM_MMA ? 32 : 16)
#endif
#define GEMM_STEP(T) (GEMM_SHARED(T, 32) <= 48 * 1024 && (GEMM_STEP_MAX >= 32 || UNIT_WEIGHTS > 16) ? 32 : 16)
#ifndef GEMM_MATH
#define GEMM_MATH 3
#endif
#ifndef GEMM_MMA  // the tensor-core path (tests/gpu_kernels/test_gemm_emulation.py sets it with its own gemm_mma)
#if GEMM_MATH != 0 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_AMD__) && \
    !defined(__HIPCC_RTC__)
#define GEMM_MMA 1
#else
#define GEMM_MMA 0
#endif
#endif
static_assert(GEMM_STEP(64) % UNIT_WEIGHTS == 0 && GEMM_STEP(32) % UNIT_WEIGHTS == 0, "a step holds whole units");
// Stages (GEMM_ASYNC) on the tensor-core path: 1 (default) double-buffered: the next stage's raw bytes go to the
// other of two staged buffers by cp.async while this stage's steps run: 4-byte words from the row's aligned word on
// (rows 2-byte aligned, as every GEMM format's are; `mine` then starts (address & 3) bytes into its row). The tiles
// live in dynamic shared memory of GEMM_ASYNC_SHARED bytes (gemm.py's gemm_dynamic_shared: past 48 KiB, the launcher
// raises the kernel's limit). On an H100 Q6_K's expert GEMMs ran 17-25 % faster than with one buffer copied through
// registers (its 210-byte stages in u16s), Q4_K's 0-5 %. 2 (a variant): one static staged buffer filled by the same
// cp.async words, the next stage's copy issued once the stage's last step is dequantized (during that step's
// products). 0: one buffer copied through registers (the FMA path and HIP always).
#ifndef GEMM_ASYNC
#define GEMM_ASYNC 1
#endif
#if GEMM_MMA && !defined(GEMM_MMA_EMULATED)  // cp.async: the real tensor-core path only
#define GEMM_PIPE GEMM_ASYNC
#else
#define GEMM_PIPE 0
#endif
#define GEMM_RAW_WORDS (((GEMM_STAGE_BYTES + 2 + 3) / 4) | 1)  // words from a 2-byte aligned row's aligned word: odd
static_assert(GEMM_PIPE != 2 || GEMM_RAW_WORDS == GEMM_STAGE_WORDS, "GEMM_ASYNC 2: the static tiles' size");
#define GEMM_ASYNC_SHARED(T, K) (4 * (K) * (GEMM_ROWS + (T)) + 2 * 4 * GEMM_ROWS * GEMM_RAW_WORDS)

// staged [GEMM_ROWS][GEMM_STAGE_WORDS] words = the stage's raw bytes (`offset` into each row) of rows r0 .. (clamped
// to R - 1), copied in T-sized pieces (u32 where rows and stages are 4-byte multiples, else u16).
template <class T>
__device__ __forceinline__ void gemm_copy_raw(const u8* __restrict__ raw, i64 row_bytes, int R, int r0, i64 offset,
                                              u32* staged) {
    const int per_row = GEMM_STAGE_BYTES / sizeof(T), batch = 8;  // loads in flight before their stores
    for (int i0 = threadIdx.x; i0 < GEMM_ROWS * per_row; i0 += batch * GEMM_THREADS) {
        T v[batch];
#pragma unroll
        for (int b = 0; b < batch; ++b) {
            int i = i0 + b * GEMM_THREADS, r = i / per_row;
            if (i < GEMM_ROWS * per_row)
                v[b] = ((const T*)(raw + (i64)min(r0 + r, R - 1) * row_bytes + offset))[i - r * per_row];
        }
#pragma unroll
        for (int b = 0; b < batch; ++b) {
            int i = i0 + b * GEMM_THREADS, r = i / per_row;
            if (i < GEMM_ROWS * per_row) ((T*)(staged + r * GEMM_STAGE_WORDS))[i - r * per_row] = v[b];
        }
    }
}

#if GEMM_PIPE
// staged [GEMM_ROWS][GEMM_RAW_WORDS] words: each row's stage bytes (`offset` into rows r0 .., clamped to R - 1) from
// their aligned word on, as many words as cover them, by cp.async (4 bytes each; committed as one group).
__device__ __forceinline__ void gemm_copy_async(const u8* __restrict__ raw, i64 row_bytes, int R, int r0, i64 offset,
                                                u32* staged) {
    for (int i = threadIdx.x; i < GEMM_ROWS * GEMM_RAW_WORDS; i += GEMM_THREADS) {
        int r = i / GEMM_RAW_WORDS, word = i - r * GEMM_RAW_WORDS;
        const u8* src = raw + (i64)min(r0 + r, R - 1) * row_bytes + offset;
        int shift = (int)((size_t)src & 3);
        if (4 * word < shift + GEMM_STAGE_BYTES) {
            u32 dst = (u32)__cvta_generic_to_shared(staged + i);
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src - shift + 4 * word));
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif

// GEMM_DEQUANT 1 (default): Q6_K's and Q4_K's stages (the formats of 256-weight blocks of 210 and 144 bytes)
// dequantized a word at a time, without integer-to-float conversions (gemm_q6_k_unit, gemm_q4_k_unit), bit for bit
// unit_dequant; other formats by unit_dequant (0: all). With GEMM_ASYNC 1 on an H100: Q4_K's GEMMs 2-5 % faster,
// Q6_K's -5 .. +1 %.
#ifndef GEMM_DEQUANT
#define GEMM_DEQUANT 1
#endif
#define GEMM_Q6_K_WORDS (GEMM_DEQUANT && GEMM_BLOCK_BYTES == 210 && GEMM_BLOCK_WEIGHTS == 256)
#define GEMM_Q4_K_WORDS (GEMM_DEQUANT && GEMM_BLOCK_BYTES == 144 && GEMM_BLOCK_WEIGHTS == 256)

// The float of byte i of v (0 .. 255) plus 2^23: the byte beside 0x4B000000's bytes (__byte_perm).
__device__ __forceinline__ float gemm_byte_float(u32 v, int i) {
    return __uint_as_float(__byte_perm(v, 0x4b00u, 0x5440u | i));
}

#if GEMM_Q6_K_WORDS
// The 4 bytes at p (2-byte aligned at least) as a word, from the aligned words around them.
__device__ __forceinline__ u32 gemm_word_at(const u8* p) {
    const u32* a = (const u32*)((size_t)p & ~(size_t)3);
    return (u32)((((unsigned long long)a[1] << 32) | a[0]) >> (8 * ((size_t)p & 3)));
}

// unit_dequant of Q6_K (q6_k.cuh) four weights at a time, bit for bit: the 6-bit codes v of 4 neighbouring weights
// assembled in a word's bytes (ql's nibbles | qh's 2 bits << 4), each byte made the float 2^23 + v by __byte_perm
// beside 0x4B000000's bytes, less 2^23 + 32: v - 32 exactly, times ds (__fmul_rn as unit_dequant).
__device__ __forceinline__ void gemm_q6_k_unit(const u8* row, int u, float* w) {
    const u8* b = row + 210 * (u >> 4);
    int s = u & 15, h = s >> 3, p = (s & 7) >> 1, l0 = 16 * (s & 1);
    float ds = __fmul_rn(load_half(b + 208), (float)(i8)b[192 + s]);
    const u8* ql = b + 64 * h + 32 * (p & 1) + l0;
    const u8* qh = b + 128 + 32 * h + l0;
    int shift = 4 * (p >> 1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 v = ((gemm_word_at(ql + 4 * j) >> shift) & 0x0f0f0f0fu) |
                (((gemm_word_at(qh + 4 * j) >> (2 * p)) & 0x03030303u) << 4);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[4 * j + i] = __fmul_rn(ds, __fadd_rn(gemm_byte_float(v, i), -8388640.0f));
    }
}
#endif

#if GEMM_Q4_K_WORDS
// unit_dequant of Q4_K (q4_k.cuh), bit for bit: each word's 4 nibbles masked into bytes, made floats as in
// gemm_q6_k_unit (2^23 + q, less 2^23: q exactly), then ds q - dm rounded twice as unit_dequant does.
__device__ __forceinline__ void gemm_q4_k_unit(const u8* row, int u, float* w) {
    const u8* b = row + 144 * (u >> 3);
    int j = u & 7, sc, m;
    scale_min_k4(b + 4, j, &sc, &m);
    float ds = __fmul_rn(load_half(b), (float)sc);
    float dm = __fmul_rn(load_half(b + 2), (float)m);
    const u32* q = (const u32*)(b + 16 + 32 * (j >> 1));  // a staged row's bytes start word-aligned
    int shift = 4 * (j & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 v = (q[i] >> shift) & 0x0f0f0f0fu;
#pragma unroll
        for (int c = 0; c < 4; ++c)
            w[4 * i + c] = __fsub_rn(__fmul_rn(ds, __fadd_rn(gemm_byte_float(v, c), -8388608.0f)), dm);
    }
}
#endif

// w [K] = columns k0 .. k0 + K - 1 of a stage whose bytes start at `row`, by the format's unit_dequant.
template <int K>
__device__ __forceinline__ void gemm_dequant(const u8* row, int k0, float (&w)[K]) {
#pragma unroll
#if GEMM_Q6_K_WORDS
    for (int u = 0; u < K / UNIT_WEIGHTS; ++u) gemm_q6_k_unit(row, k0 / UNIT_WEIGHTS + u, w + u * UNIT_WEIGHTS);
#elif GEMM_Q4_K_WORDS
    for (int u = 0; u < K / UNIT_WEIGHTS; ++u) gemm_q4_k_unit(row, k0 / UNIT_WEIGHTS + u, w + u * UNIT_WEIGHTS);
#else
    for (int u = 0; u < K / UNIT_WEIGHTS; ++u) unit_dequant(row, k0 / UNIT_WEIGHTS + u, w + u * UNIT_WEIGHTS);
#endif
}

// A thread's part of the x tile of a step: X_LOADS float4s of x [n, C] (tokens past n: zeros), loaded a step ahead
// (gemm_load_x) so that their reads are in flight during the products, and stored into the tile transposed
// (gemm_store_x): xs [K][TOKENS]. Neighbouring threads take neighbouring tokens (no bank conflicts).
template <int TOKENS>
struct GemmShape {
    static const int TN = TOKENS / 8;  // tokens a thread, side by side (a multiple of 4)
    static const int K = GEMM_STEP(TOKENS);  // columns a step
    static const int X_LOADS = TOKENS * K / 4 / GEMM_THREADS;
};

template <int TOKENS>
__device__ __forceinline__ void gemm_load_x(const float* __restrict__ x, int C, int n, int k0,
                                            float4 (&v)[GemmShape<TOKENS>::X_LOADS]) {
#pragma unroll
    for (int l = 0; l < GemmShape<TOKENS>::X_LOADS; ++l) {
        int i = threadIdx.x + l * GEMM_THREADS, t = i % TOKENS, q = i / TOKENS;
        v[l] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < n) v[l] = *(const float4*)(x + (i64)t * C + k0 + 4 * q);
    }
}

template <int TOKENS>
__device__ __forceinline__ void gemm_store_x(const float4 (&v)[GemmShape<TOKENS>::X_LOADS], float* xs) {
#pragma unroll
    for (int l = 0; l < GemmShape<TOKENS>::X_LOADS; ++l) {
        int i = threadIdx.x + l * GEMM_THREADS, t = i % TOKENS, q = i / TOKENS;
#if GEMM_MMA
        ((float4*)xs)[q * TOKENS + t] = v[l];
#else
        xs[(4 * q + 0) * TOKENS + t] = v[l].x;
        xs[(4 * q + 1) * TOKENS + t] = v[l].y;
        xs[(4 * q + 2) * TOKENS + t] = v[l].z;
        xs[(4 * q + 3) * TOKENS + t] = v[l].w;
#endif
    }
}

// acc [GEMM_TM][TN] += the thread's rows of ws [K][GEMM_ROWS] times its tokens of xs [K][TOKENS].
template <int TOKENS, int TN, int K>
__device__ __forceinline__ void gemm_products(const float4* ws, const float4* xs, int rg, int tg,
                                              float (&acc)[GEMM_TM][TN]) {
#pragma unroll 8
    for (int k = 0; k < K; ++k) {
        float4 a0 = ws[k * (GEMM_ROWS / 4) + rg], a1 = ws[k * (GEMM_ROWS / 4) + GEMM_RG + rg];
        float a[GEMM_TM] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        float b[TN];
#pragma unroll
        for (int q = 0; q < TN / 4; ++q) {
            float4 bq = xs[k * (TOKENS / 4) + (TN / 4) * tg + q];
            b[4 * q] = bq.x, b[4 * q + 1] = bq.y, b[4 * q + 2] = bq.z, b[4 * q + 3] = bq.w;
        }
#pragma unroll
        for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

#if GEMM_MMA
#ifndef GEMM_MMA_EMULATED
// d [16 x 8] += a [16 x 8] @ b [8 x 8] over the warp (PTX mma.m16n8k8 .tf32, each operand's low 13 bits ignored;
// lane = 4 g + c: a holds (g, c), (g + 8, c), (g, c + 4), (g + 8, c + 4); b (k c, token g), (c + 4, g); d (g, tokens
// 2 c, 2 c + 1), (g + 8, ..)).
__device__ __forceinline__ void gemm_mma(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// hi, lo = v's TF32 split as the mma reads them (their low 13 bits dropped). GEMM_MATH 3: hi = v (the mma's hi is v
// truncated), lo = v - hi truncated, exact, read truncated to its top 11 bits: v within 2^-21 of it. GEMM_MATH 1:
// hi = v rounded to TF32 (half an ulp added: ties away from zero), lo unused. v finite.
__device__ __forceinline__ void gemm_split(float v, u32& hi, u32& lo) {
    hi = __float_as_uint(v) + (GEMM_MATH == 3 ? 0u : 0x1000u);
    lo = GEMM_MATH == 3 ? __float_as_uint(v - __uint_as_float(hi & 0xffffe000u)) : 0u;
}

// acc [2][TOKENS / 8][4] (m16 tile, n8 tile, fragment) += the warp's rows 32 warp .. + 31 of ws [K / 4][GEMM_ROWS][4]
// times the tile's tokens (n8 tiles from n on skipped) of xs [K / 4][TOKENS][4]. The mma sum into fresh
// accumulators, added to acc in float32 once a step: the tensor cores' accumulation truncates, and over a whole row
// (2048 columns: 768 mma into one accumulator) that drifted 1-3e-5 of the result on an H100. By groups of
// GEMM_NT_GROUP n8 tiles (their accumulators in registers beside acc), the A fragments loaded again for each. Lane
// (g, c) reads columns k0 + c and k0 + 4 + c, the words 4 row + c of float4 rows k0 / 4 and k0 / 4 + 1: one address
// a lane, the rest constants of the unrolled loops.
#ifndef GEMM_NT_GROUP
#define GEMM_NT_GROUP 4
#endif
template <int TOKENS, int K>
__device__ __forceinline__ void gemm_products_mma(const float* ws, const float* xs, int n,
                                                  float (&acc)[2][TOKENS / 8][4]) {
    int lane = threadIdx.x % 32, c = lane % 4, g = lane / 4;
    const float* w = ws + 4 * (32 * (threadIdx.x / 32) + g) + c;  // row 32 warp + g, column c
    const float* xc = xs + 4 * g + c;  // token g, column c
#pragma unroll
    for (int j0 = 0; j0 < TOKENS / 8; j0 += GEMM_NT_GROUP) {
        if (8 * j0 >= n) break;  // the same for the whole warp
        float part[2][GEMM_NT_GROUP][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int j = 0; j < GEMM_NT_GROUP; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[mt][j][i] = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += 8) {
            u32 ah[2][4], al[2][4], bh[GEMM_NT_GROUP][2], bl[GEMM_NT_GROUP][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const float* r0 = w + k0 * GEMM_ROWS + 4 * 16 * mt;  // float4 row k0 / 4, row 16 mt + g
                gemm_split(r0[0], ah[mt][0], al[mt][0]);
                gemm_split(r0[4 * 8], ah[mt][1], al[mt][1]);
                gemm_split(r0[4 * GEMM_ROWS], ah[mt][2], al[mt][2]);
                gemm_split(r0[4 * GEMM_ROWS + 4 * 8], ah[mt][3], al[mt][3]);
            }
#pragma unroll
            for (int j = 0; j < GEMM_NT_GROUP; ++j) {
                const float* t0 = xc + k0 * TOKENS + 4 * 8 * (j0 + j);  // float4 row k0 / 4, token 8 j + g
                gemm_split(t0[0], bh[j][0], bl[j][0]);
                gemm_split(t0[4 * TOKENS], bh[j][1], bl[j][1]);
            }
            // the three products' passes over the tiles, so that an accumulator's next mma waits behind the others'
#pragma unroll
            for (int pass = GEMM_MATH == 3 ? 0 : 2; pass < 3; ++pass)
#pragma unroll
                for (int j = 0; j < GEMM_NT_GROUP; ++j)
                    if (8 * (j0 + j) < n)  // the same for the whole warp
#pragma unroll
                        for (int mt = 0; mt < 2; ++mt)
                            gemm_mma(part[mt][j], pass == 1 ? ah[mt] : pass == 0 ? al[mt] : ah[mt],
                                     pass == 1 ? bl[j] : bh[j]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int j = 0; j < GEMM_NT_GROUP; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[mt][j0 + j][i] += part[mt][j][i];
    }
}

// out [n, R] (rows t R apart): the warp's fragments of acc at rows r0 + 32 warp + .., within R and n.
template <int TOKENS>
__device__ __forceinline__ void gemm_store_mma(float* __restrict__ out, int R, int r0, int n,
                                               const float (&acc)[2][TOKENS / 8][4]) {
    int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4, m0 = r0 + 32 * (threadIdx.x / 32);
#pragma unroll
    for (int j = 0; j < TOKENS / 8; ++j)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int r = m0 + 16 * mt + g + 8 * (i / 2), t = 8 * j + 2 * c + i % 2;
                if (r < R && t < n) out[(i64)t * R + r] = acc[mt][j][i];
            }
}
#endif

// out [n, R] (rows t R apart): the thread's micro-tile of rows r0 + .. and tokens TN tg + .., within R and n.
template <int TN>
__device__ __forceinline__ void gemm_store(float* __restrict__ out, int R, int r0, int n, int rg, int tg,
                                           const float (&acc)[GEMM_TM][TN]) {
#pragma unroll
    for (int j = 0; j < TN; ++j) {
        int t = TN * tg + j;
        if (t >= n) break;
        float* dst = out + (i64)t * R;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = r0 + h * (GEMM_ROWS / 2) + 4 * rg;
            if ((R & 3) == 0 && r + 3 < R) {
                *(float4*)(dst + r) =
                    make_float4(acc[4 * h][j], acc[4 * h + 1][j], acc[4 * h + 2][j], acc[4 * h + 3][j]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    if (r + i < R) dst[r + i] = acc[4 * h + i][j];
            }
        }
    }
}

// out [n, R] = x [n, :cols] @ dequant(raw [R, B])[:, :cols].T for the block's GEMM_ROWS rows from r0 (rows past R:
// clamped reads, no stores); x's rows are C apart.
template <int TOKENS>
__device__ __forceinline__ void gemm_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                          float* __restrict__ out, int n, int R, int C, int cols, i64 row_bytes,
                                          int r0) {
    const int TN = GemmShape<TOKENS>::TN, K = GemmShape<TOKENS>::K;
#if GEMM_PIPE == 1
    extern __shared__ float4 gemm_shared[];
    float4* ws = gemm_shared;                               // [K][GEMM_ROWS]
    float4* xs = ws + K * GEMM_ROWS / 4;                    // [K][TOKENS]
    u32* staged = (u32*)(xs + K * TOKENS / 4);              // [2][GEMM_ROWS][GEMM_RAW_WORDS]
#elif GEMM_PIPE == 2
    __shared__ float4 ws[K * GEMM_ROWS / 4];                // [K][GEMM_ROWS]
    __shared__ float4 xs[K * TOKENS / 4];                   // [K][TOKENS]
    __shared__ u32 staged[GEMM_ROWS * GEMM_RAW_WORDS];     // [GEMM_ROWS][GEMM_RAW_WORDS]
#else
    __shared__ float4 ws[K * GEMM_ROWS / 4];                // [K][GEMM_ROWS]
    __shared__ float4 xs[K * TOKENS / 4];                   // [K][TOKENS]
    __shared__ u32 staged[GEMM_ROWS * GEMM_STAGE_WORDS];   // [GEMM_ROWS][GEMM_STAGE_WORDS]
#endif
    float* wsf = (float*)ws;
#if GEMM_MMA
    float acc[2][TOKENS / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int j = 0; j < TOKENS / 8; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][j][i] = 0.0f;
#else
    int rg = threadIdx.x % GEMM_RG, tg = threadIdx.x / GEMM_RG;
    bool active = TN * tg < n;
    float acc[GEMM_TM][TN];
#pragma unroll
    for (int i = 0; i < GEMM_TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
#endif
    float4 xv[GemmShape<TOKENS>::X_LOADS];
    gemm_load_x<TOKENS>(x, C, n, 0, xv);
#if GEMM_PIPE == 2
    const u8* row = raw + (i64)min(r0 + (int)threadIdx.x, R - 1) * row_bytes;
    gemm_copy_async(raw, row_bytes, R, r0, 0, staged);
    for (int s0 = 0; s0 < cols; s0 += GEMM_STAGE_COLS) {
        i64 offset = (i64)(s0 / GEMM_BLOCK_WEIGHTS) * GEMM_BLOCK_BYTES;
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        const u8* mine = (const u8*)(staged + threadIdx.x * GEMM_RAW_WORDS) + ((size_t)(row + offset) & 3);
#elif GEMM_PIPE
    const u8* row = raw + (i64)min(r0 + (int)threadIdx.x, R - 1) * row_bytes;
    gemm_copy_async(raw, row_bytes, R, r0, 0, staged);
    for (int s0 = 0, buffer = 0; s0 < cols; s0 += GEMM_STAGE_COLS, buffer ^= 1) {
        i64 offset = (i64)(s0 / GEMM_BLOCK_WEIGHTS) * GEMM_BLOCK_BYTES;
        // the other buffer's last reads (the previous stage's) lie behind that stage's barriers
        if (s0 + GEMM_STAGE_COLS < cols) {
            gemm_copy_async(raw, row_bytes, R, r0, offset + GEMM_STAGE_COLS / GEMM_BLOCK_WEIGHTS * GEMM_BLOCK_BYTES,
                            staged + (buffer ^ 1) * GEMM_ROWS * GEMM_RAW_WORDS);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();
        const u8* mine = (const u8*)(staged + (buffer * GEMM_ROWS + threadIdx.x) * GEMM_RAW_WORDS) +
                         ((size_t)(row + offset) & 3);
#else
    bool words = ((row_bytes | GEMM_STAGE_BYTES) & 3) == 0;
    const u8* mine = (const u8*)(staged + threadIdx.x * GEMM_STAGE_WORDS);
    for (int s0 = 0; s0 < cols; s0 += GEMM_STAGE_COLS) {
        i64 offset = (i64)(s0 / GEMM_BLOCK_WEIGHTS) * GEMM_BLOCK_BYTES;
        if (words) gemm_copy_raw<u32>(raw, row_bytes, R, r0, offset, staged);
        else gemm_copy_raw<u16>(raw, row_bytes, R, r0, offset, staged);
        __syncthreads();
#endif
        for (int k0 = 0; k0 < GEMM_STAGE_COLS; k0 += K) {
            float w[K];
            gemm_dequant<K>(mine, k0, w);
#pragma unroll
#if GEMM_MMA
            for (int q = 0; q < K / 4; ++q)
                ws[q * GEMM_ROWS + threadIdx.x] = make_float4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
#else
            for (int k = 0; k < K; ++k) wsf[k * GEMM_ROWS + threadIdx.x] = w[k];
#endif
            gemm_store_x<TOKENS>(xv, (float*)xs);
            __syncthreads();
#if GEMM_PIPE == 2
            // the stage's last reads lie behind this barrier: the next stage's copy runs during these products
            if (k0 + K == GEMM_STAGE_COLS && s0 + GEMM_STAGE_COLS < cols)
                gemm_copy_async(raw, row_bytes, R, r0, offset + GEMM_STAGE_BYTES, staged);
#endif
            if (s0 + k0 + K < cols) gemm_load_x<TOKENS>(x, C, n, s0 + k0 + K, xv);
#if GEMM_MMA
            gemm_products_mma<TOKENS, K>(wsf, (const float*)xs, n, acc);
#else
            if (active) gemm_products<TOKENS, TN, K>(ws, xs, rg, tg, acc);
#endif
            __syncthreads();
        }
    }
#if GEMM_MMA
    gemm_store_mma<TOKENS>(out, R, r0, n, acc);
#else
    if (active) gemm_store<TN>(out, R, r0, n, rg, tg, acc);
#endif
}

// out [N, R] = x [N, C] @ dequant(raw).T by work tiles of up to TOKENS rows. With tiles (tile_slot not null,
// moe_matmul's): tile w covers rows [tile_row[w], + tile_count[w]) of x, all of expert slot tile_slot[w] of
// raw [S, R, B]. Without (a dense matmul): raw [R, B], tile w rows [w TOKENS, + TOKENS) of N = T; split over
// gridDim.z runs of C / gridDim.z columns (whole stages), run z writing its partial sums to out [z] of
// out [gridDim.z, T, R] (gemm_reduce adds them up). grid (ceil(R / GEMM_ROWS), W or ceil(T / TOKENS), splits),
// GEMM_THREADS.
template <int TOKENS>
__device__ __forceinline__ void gemm_tile(const u8* raw, const float* x, float* out, const int* tile_slot,
                                          const int* tile_row, const int* tile_count, int T, int R, int C,
                                          i64 row_bytes) {
    int w = blockIdx.y, row0 = w * TOKENS, n = min(TOKENS, T - row0), cols = C / gridDim.z;
    if (tile_slot) {
        row0 = tile_row[w];
        n = tile_count[w];
        raw += (i64)tile_slot[w] * R * row_bytes;
    }
    if (n <= 0) return;
    raw += (i64)(blockIdx.z * cols / GEMM_BLOCK_WEIGHTS) * GEMM_BLOCK_BYTES;
    gemm_body<TOKENS>(raw, x + (i64)row0 * C + blockIdx.z * cols, out + (i64)blockIdx.z * T * R + (i64)row0 * R, n,
                      R, C, cols, row_bytes, blockIdx.x * GEMM_ROWS);
}

#define GEMM_ARGS                                                                                                  \
    const u8 *raw, const float *x, float *out, const int *tile_slot, const int *tile_row, const int *tile_count, \
        int T, int R, int C, i64 row_bytes
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm(GEMM_ARGS) {
    gemm_tile<64>(raw, x, out, tile_slot, tile_row, tile_count, T, R, C, row_bytes);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm32(GEMM_ARGS) {
    gemm_tile<32>(raw, x, out, tile_slot, tile_row, tile_count, T, R, C, row_bytes);
}

// out [n] = the sum of partial [splits, n] over its splits, in order; grid (ceil(n / blockDim)).
extern "C" __global__ void gemm_reduce(const float* partial, float* out, i64 n, int splits) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float sum = partial[i];
    for (int z = 1; z < splits; ++z) sum += partial[z * n + i];
    out[i] = sum;
}
