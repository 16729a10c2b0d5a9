// Quantized matmuls over GGUF rows, compiled once per format: the format's header (UNIT_WEIGHTS,
// unit_dequant) comes before this file. A unit is the format's smallest independently scaled run of
// weights; each thread dequantizes whole units into registers and dots them with a tile of tokens.
//
// Shape legend: R output rows, C columns, B bytes per row, T tokens, TT tokens per tile,
// S expert slots, N (token, expert) pair rows sorted by expert, W work tiles.
// Dynamic shared memory: TILE_TOKENS * blockDim.x floats (blockDim.x a power of two).

#define TILE_TOKENS 8

// A block works on blockDim / tpr rows at once: threads [r * tpr, (r + 1) * tpr) on its row r.
// acc[t] = row . x[t] for t < n; x: [n, C] with rows C apart. Every thread of the block must call
// this (it synchronizes); a thread whose row is past the end passes valid = false.
__device__ void rows_dot(const u8* row, bool valid, const float* x, int C, int n, int tpr, float* acc, float* red) {
    float w[UNIT_WEIGHTS];
    float part[TILE_TOKENS];
#pragma unroll
    for (int t = 0; t < TILE_TOKENS; ++t) part[t] = 0.0f;
    int lane = threadIdx.x % tpr, num_units = valid ? C / UNIT_WEIGHTS : 0;
    for (int u = lane; u < num_units; u += tpr) {
        unit_dequant(row, u, w);
#pragma unroll
        for (int t = 0; t < TILE_TOKENS; ++t) {
            if (t < n) {
                const float* xs = x + (i64)t * C + (i64)u * UNIT_WEIGHTS;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < UNIT_WEIGHTS; ++i) s += w[i] * xs[i];
                part[t] += s;
            }
        }
    }
    for (int t = 0; t < n; ++t) red[t * blockDim.x + threadIdx.x] = part[t];
    __syncthreads();
    for (int s = tpr / 2; s > 0; s >>= 1) {
        if (lane < s)
            for (int t = 0; t < n; ++t) red[t * blockDim.x + threadIdx.x] += red[t * blockDim.x + threadIdx.x + s];
        __syncthreads();
    }
    for (int t = 0; t < n; ++t) acc[t] = red[t * blockDim.x + threadIdx.x - lane];
}

// out [T, R] = x [T, C] @ dequant(raw [R, B]).T; grid (ceil(R / (blockDim / tpr)), ceil(T / TILE_TOKENS)).
extern "C" __global__ void matmul(const u8* raw, const float* x, float* out, int T, int R, int C, i64 row_bytes,
                                  int tpr) {
    extern __shared__ float red[];
    int r = blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr, t0 = blockIdx.y * TILE_TOKENS;
    int n = min(TILE_TOKENS, T - t0);
    float acc[TILE_TOKENS];
    rows_dot(raw + (i64)min(r, R - 1) * row_bytes, r < R, x + (i64)t0 * C, C, n, tpr, acc, red);
    if (r < R && threadIdx.x % tpr == 0)
        for (int t = 0; t < n; ++t) out[(i64)(t0 + t) * R + r] = acc[t];
}

// Every resident expert of a layer in one launch. Work tile w covers pair rows
// [tile_row[w], tile_row[w] + tile_count[w]) of x [N, C], all of expert slot tile_slot[w];
// out [N, R] = x @ dequant(raw [S, R, B][slot]).T. grid (ceil(R / (blockDim / tpr)), W).
extern "C" __global__ void moe_matmul(const u8* raw, const float* x, float* out, const int* tile_slot,
                                      const int* tile_row, const int* tile_count, int R, int C, i64 row_bytes,
                                      int tpr) {
    extern __shared__ float red[];
    int r = blockIdx.x * (blockDim.x / tpr) + threadIdx.x / tpr, w = blockIdx.y;
    int row0 = tile_row[w], n = tile_count[w];
    float acc[TILE_TOKENS];
    rows_dot(raw + ((i64)tile_slot[w] * R + min(r, R - 1)) * row_bytes, r < R, x + (i64)row0 * C, C, n, tpr,
             acc, red);
    if (r < R && threadIdx.x % tpr == 0)
        for (int t = 0; t < n; ++t) out[(i64)(row0 + t) * R + r] = acc[t];
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
