// Quantized matmuls over GGUF rows, compiled once per format: the format's header comes before this
// file. For the matmuls it defines SLICE_WEIGHTS, a Slice (the raw bytes of a run of weights, in
// registers), load_slice (slice s of a row; slices s and s + 1 lie side by side, so neighbouring lanes
// read neighbouring bytes) and slice_dot (a thread's RPT rows' slices dotted with a tile of tokens).
// For dequant_rows: UNIT_WEIGHTS and unit_dequant, bit-exact with gguf.
//
// Shape legend: R output rows, C columns, B bytes per row, T tokens, TT tokens per tile,
// S expert slots, N (token, expert) pair rows sorted by expert, W work tiles.
// A group of `tpr` lanes (a power of two, at most the wave size) works on RPT rows: each lane takes
// every tpr-th slice of them, and the group sums its lanes with shuffles. Each kernel comes twice:
// tiles of TILE_TOKENS tokens, one row a group, and `_1` (decode: one token, DECODE_ROWS rows a group,
// fewer registers, so more groups in flight).

// acc [RPT, TT] = rows r0 .. r0 + RPT - 1 (clamped to R - 1) of `raw` dotted with x [n, C].
template <int RPT, int TT>
__device__ __forceinline__ void group_rows_dot(const u8* __restrict__ raw, i64 row_bytes, int R, int r0,
                                               const float* __restrict__ x, int C, int n, int tpr,
                                               float (&acc)[RPT][TT]) {
    const u8* row[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        row[r] = raw + (i64)min(r0 + r, R - 1) * row_bytes;
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
    }
    int lane = threadIdx.x & (tpr - 1), num_slices = C / SLICE_WEIGHTS;
    Slice cur[RPT], next[RPT];
    if (lane < num_slices) {
#pragma unroll
        for (int r = 0; r < RPT; ++r) cur[r] = load_slice(row[r], lane);
    }
    for (int s = lane; s < num_slices; s += tpr) {
        if (s + tpr < num_slices) {  // the next slices' loads are in flight while these are dotted
#pragma unroll
            for (int r = 0; r < RPT; ++r) next[r] = load_slice(row[r], s + tpr);
        }
        slice_dot<RPT, TT>(cur, s, x, C, n, acc);
#pragma unroll
        for (int r = 0; r < RPT; ++r) cur[r] = next[r];
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
            if (t < n)
                for (int m = tpr >> 1; m > 0; m >>= 1) acc[r][t] += SHFL_XOR(acc[r][t], m, tpr);
}

// group_rows_dot over rows in shared memory (one token): near loads, so no slices held in flight.
template <int RPT>
__device__ __forceinline__ void group_rows_dot_near(const u8* rows, i64 row_bytes, int R, int r0, const float* x,
                                                    int C, int tpr, float (&acc)[RPT][1]) {
    const u8* row[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        row[r] = rows + (i64)min(r0 + r, R - 1) * row_bytes;
        acc[r][0] = 0.0f;
    }
    int num_slices = C / SLICE_WEIGHTS;
    for (int s = threadIdx.x & (tpr - 1); s < num_slices; s += tpr) {
        Slice cur[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) cur[r] = load_slice(row[r], s);
        slice_dot<RPT, 1>(cur, s, x, C, 1, acc);
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r)
        for (int m = tpr >> 1; m > 0; m >>= 1) acc[r][0] += SHFL_XOR(acc[r][0], m, tpr);
}

// out [n, R] rows t of `out` (R apart) = acc, by the group's first lane.
template <int RPT, int TT>
__device__ __forceinline__ void store_rows(float* out, int R, int r0, int n, int tpr, const float (&acc)[RPT][TT]) {
    if ((threadIdx.x & (tpr - 1)) != 0) return;
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
            if (t < n && r0 + r < R) out[(i64)t * R + r0 + r] = acc[r][t];
}

// out [T, R] = x [T, C] @ dequant(raw [R, B]).T; grid (ceil(R / (RPT * blockDim / tpr)), ceil(T / TT)).
template <int RPT, int TT>
__device__ __forceinline__ void matmul_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                            float* __restrict__ out, int T, int R, int C, i64 row_bytes, int tpr) {
    int r0 = (blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr) * RPT, t0 = blockIdx.y * TT;
    int n = min(TT, T - t0);
    float acc[RPT][TT];
    group_rows_dot<RPT, TT>(raw, row_bytes, R, r0, x + (i64)t0 * C, C, n, tpr, acc);
    store_rows<RPT, TT>(out + (i64)t0 * R, R, r0, n, tpr, acc);
}

// Every resident expert of a layer in one launch. Work tile w covers pair rows
// [tile_row[w], tile_row[w] + tile_count[w]) of x [N, C] (tile_count <= TT), all of expert slot
// tile_slot[w]; out [N, R] = x @ dequant(raw [S, R, B][slot]).T. grid (ceil(R / (RPT * blockDim / tpr)), W).
template <int RPT, int TT>
__device__ __forceinline__ void moe_matmul_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                                float* __restrict__ out, const int* tile_slot, const int* tile_row,
                                                const int* tile_count, int R, int C, i64 row_bytes, int tpr) {
    int r0 = (blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr) * RPT, w = blockIdx.y;
    int row0 = tile_row[w], n = tile_count[w];
    if (n <= 0) return;  // a decode pair whose expert is not resident (decode_tiles): nothing to read
    float acc[RPT][TT];
    group_rows_dot<RPT, TT>(raw + (i64)tile_slot[w] * R * row_bytes, row_bytes, R, r0, x + (i64)row0 * C, C, n,
                            tpr, acc);
    store_rows<RPT, TT>(out + (i64)row0 * R, R, r0, n, tpr, acc);
}

// Staged one-token kernels: a block walks chunks of consecutive rows (one contiguous byte range); its
// threads first copy a chunk into shared memory with aligned 16-byte loads, whatever the format's
// block size, then the lane groups dot the chunk's rows from there, RPT rows a group.
// stage: the chunk's 16-byte words, from the word that holds its first byte.
template <int RPT>
__device__ __forceinline__ void staged_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                            float* __restrict__ out, int R, int C, i64 row_bytes, int tpr,
                                            int chunk_rows) {
    extern __shared__ uint4 stage[];
    int groups = blockDim.x / tpr, g = threadIdx.x / tpr;
    for (int c0 = blockIdx.x * chunk_rows; c0 < R; c0 += gridDim.x * chunk_rows) {
        int rows = min(chunk_rows, R - c0);
        size_t lo = (size_t)(raw + (i64)c0 * row_bytes), hi = lo + (size_t)rows * row_bytes;
        const uint4* src = (const uint4*)(lo & ~(size_t)15);
        int words = (int)((hi - (lo & ~(size_t)15) + 15) >> 4), i = threadIdx.x, step = blockDim.x;
        for (; i + 3 * step < words; i += 4 * step) {  // four loads in flight before their stores
            uint4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
            stage[i] = a;
            stage[i + step] = b;
            stage[i + 2 * step] = c;
            stage[i + 3 * step] = d;
        }
        for (; i < words; i += step) stage[i] = src[i];
        __syncthreads();
        const u8* chunk = (const u8*)stage + (lo & 15);
        for (int r0 = g * RPT; r0 < rows; r0 += groups * RPT) {
            float acc[RPT][1];
            group_rows_dot_near<RPT>(chunk, row_bytes, rows, r0, x, C, tpr, acc);
            if ((threadIdx.x & (tpr - 1)) == 0) {
#pragma unroll
                for (int r = 0; r < RPT; ++r)
                    if (r0 + r < rows) out[c0 + r0 + r] = acc[r][0];
            }
        }
        __syncthreads();
    }
}

#define MATMUL_ARGS const u8 *raw, const float *x, float *out, int T, int R, int C, i64 row_bytes, int tpr
#define MOE_ARGS                                                                                        \
    const u8 *raw, const float *x, float *out, const int *tile_slot, const int *tile_row, const int *tile_count, \
        int R, int C, i64 row_bytes, int tpr

extern "C" __global__ void matmul(MATMUL_ARGS) { matmul_body<1, TILE_TOKENS>(raw, x, out, T, R, C, row_bytes, tpr); }

extern "C" __global__ void matmul_1(MATMUL_ARGS) { matmul_body<DECODE_ROWS, 1>(raw, x, out, T, R, C, row_bytes, tpr); }

// out [1, R] = x [1, C] @ dequant(raw [R, B]).T; grid (blocks over chunks); shared: a chunk's words.
#ifndef STAGED_MIN_BLOCKS
#define STAGED_MIN_BLOCKS 1
#endif

extern "C" __global__ void __launch_bounds__(256, STAGED_MIN_BLOCKS) matmul_1s(const u8* raw, const float* x, float* out, int R, int C, i64 row_bytes, int tpr,
                                    int chunk_rows) {
    staged_body<DECODE_ROWS>(raw, x, out, R, C, row_bytes, tpr, chunk_rows);
}

extern "C" __global__ void moe_matmul(MOE_ARGS) {
    moe_matmul_body<1, TILE_TOKENS>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr);
}

extern "C" __global__ void moe_matmul_1(MOE_ARGS) {
    moe_matmul_body<DECODE_ROWS, 1>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr);
}

// moe_matmul_1 staged: tiles of one row; grid (blocks over chunks, W); shared: a chunk's words.
extern "C" __global__ void __launch_bounds__(256, STAGED_MIN_BLOCKS) moe_matmul_1s(MOE_ARGS, int chunk_rows) {
    int w = blockIdx.y, row0 = tile_row[w];
    if (tile_count[w] <= 0) return;
    staged_body<DECODE_ROWS>(raw + (i64)tile_slot[w] * R * row_bytes, x + (i64)row0 * C, out + (i64)row0 * R, R, C,
                             row_bytes, tpr, chunk_rows);
}

// out [M, C] = dequant(raw [rows][row_ids]) (embedding lookup and the dequantize test); grid (M).
extern "C" __global__ void dequant_rows(const u8* raw, const i64* row_ids, float* out, int C, i64 row_bytes) {
    const u8* row = raw + row_ids[blockIdx.x] * row_bytes;
    float* dst = out + (i64)blockIdx.x * C;
    float w[UNIT_WEIGHTS];
    for (int u = threadIdx.x; u < C / UNIT_WEIGHTS; u += blockDim.x) {
        unit_dequant(row, u, w);
        for (int i = 0; i < UNIT_WEIGHTS; ++i) dst[(i64)u * UNIT_WEIGHTS + i] = w[i];
    }
}
