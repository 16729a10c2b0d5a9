// Quantized matmuls over GGUF rows, compiled once per format: the format's header comes before this
// file. For the matmuls it defines SLICE_WEIGHTS, a Slice (the raw bytes of a run of weights, in
// registers), load_slice (slice s of a row; slices s and s + 1 lie side by side, so neighbouring lanes
// read neighbouring bytes) and slice_dot (a thread's RPT rows' slices dotted with a tile of tokens).
// For dequant_rows: UNIT_WEIGHTS and unit_dequant, bit-exact with gguf.
// A format that defines INT_DECODE also has slice_dot_q (one token, x as int16 in shared memory: XQ)
// and gets the `_1q` kernels.
//
// Shape legend: R output rows, C columns, B bytes per row, T tokens, TT tokens per tile,
// S expert slots, N (token, expert) pair rows sorted by expert, W work tiles.
// A group of `tpr` lanes (a power of two, at most the wave size) works on RPT rows: each lane takes
// every tpr-th slice of them, and the group sums its lanes with shuffles. Each kernel comes twice:
// tiles of TILE_TOKENS tokens, one row a group, and `_1` (decode: one token, DECODE_ROWS rows a group,
// fewer registers, so more groups in flight).

// Where a slice_dot reads the activations: float rows of x, or (the `_1q` kernels) one token's x rounded
// to int16 in shared memory (common.cuh's XQ, formats that define INT_DECODE).
struct FloatRows {
    const float* x;  // [n, C]
    int C, n;
};

template <int RPT, int TT>
__device__ __forceinline__ void slice_run(const Slice (&sl)[RPT], int s, const FloatRows& xs, float (&acc)[RPT][TT]) {
    slice_dot<RPT, TT>(sl, s, xs.x, xs.C, xs.n, acc);
}

#ifdef INT_DECODE
template <int RPT>
__device__ __forceinline__ void slice_run(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    slice_dot_q<RPT>(sl, s, xq, acc);
}
#endif

// acc [RPT, TT] = rows r0 .. r0 + RPT - 1 (clamped to R - 1) of `raw` dotted with the n token rows of xs.
template <int RPT, int TT, class X>
__device__ __forceinline__ void group_rows_dot(const u8* __restrict__ raw, i64 row_bytes, int R, int r0, const X& xs,
                                               int C, int n, int tpr, float (&acc)[RPT][TT]) {
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
        slice_run(cur, s, xs, acc);
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
    group_rows_dot<RPT, TT>(raw, row_bytes, R, r0, FloatRows{x + (i64)t0 * C, C, n}, C, n, tpr, acc);
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
    group_rows_dot<RPT, TT>(raw + (i64)tile_slot[w] * R * row_bytes, row_bytes, R, r0,
                            FloatRows{x + (i64)row0 * C, C, n}, C, n, tpr, acc);
    store_rows<RPT, TT>(out + (i64)row0 * R, R, r0, n, tpr, acc);
}

#define MATMUL_ARGS const u8 *raw, const float *x, float *out, int T, int R, int C, i64 row_bytes, int tpr
#define MOE_ARGS                                                                                        \
    const u8 *raw, const float *x, float *out, const int *tile_slot, const int *tile_row, const int *tile_count, \
        int R, int C, i64 row_bytes, int tpr

extern "C" __global__ void matmul(MATMUL_ARGS) { matmul_body<1, TILE_TOKENS>(raw, x, out, T, R, C, row_bytes, tpr); }

extern "C" __global__ void DECODE_BOUNDS matmul_1(MATMUL_ARGS) {
    matmul_body<DECODE_ROWS, 1>(raw, x, out, T, R, C, row_bytes, tpr);
}

extern "C" __global__ void moe_matmul(MOE_ARGS) {
    moe_matmul_body<1, TILE_TOKENS>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul_1(MOE_ARGS) {
    moe_matmul_body<DECODE_ROWS, 1>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr);
}

#ifdef INT_DECODE
// The one-token kernels with x rounded to int16 once per block (XQ_SHARED_BYTES(C) of dynamic shared memory):
// the same grids, lane groups and rows as matmul_1 and moe_matmul_1.
extern "C" __global__ void DECODE_BOUNDS matmul_1q(MATMUL_ARGS) {
    extern __shared__ float4 xq_smem[];
    XQ xq = stage_xq(x, C, (unsigned char*)xq_smem);
    int r0 = (blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr) * DECODE_ROWS;
    float acc[DECODE_ROWS][1];
    group_rows_dot<DECODE_ROWS, 1>(raw, row_bytes, R, r0, xq, C, 1, tpr, acc);
    store_rows<DECODE_ROWS, 1>(out, R, r0, 1, tpr, acc);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul_1q(MOE_ARGS) {
    int r0 = (blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr) * DECODE_ROWS, w = blockIdx.y;
    int row0 = tile_row[w];
    if (tile_count[w] <= 0) return;  // the whole block: a pair whose expert is not resident
    extern __shared__ float4 xq_smem[];
    XQ xq = stage_xq(x + (i64)row0 * C, C, (unsigned char*)xq_smem);
    float acc[DECODE_ROWS][1];
    group_rows_dot<DECODE_ROWS, 1>(raw + (i64)tile_slot[w] * R * row_bytes, row_bytes, R, r0, xq, C, 1, tpr, acc);
    store_rows<DECODE_ROWS, 1>(out + (i64)row0 * R, R, r0, 1, tpr, acc);
}
#endif

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
