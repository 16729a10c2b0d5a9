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
#define MULTI_TOKENS 4  // tokens of a matmul_n / matmul_nq block (kernels.py MULTI_TOKENS)

struct FloatRows {
    const float* x;  // [n, C]
    int C, n;
};

template <int RPT, int TT>
__device__ __forceinline__ void slice_run(const Slice (&sl)[RPT], int s, const FloatRows& xs, float (&acc)[RPT][TT]) {
    slice_dot<RPT, TT>(sl, s, xs.x, xs.C, xs.n, acc);
}

#ifdef INT_DECODE
#if defined(XQ_HALVES) && !defined(XQ_HALVES_READ)
#error "XQ_HALVES: this format's slice_dot_q reads x in blocks of 32 (IQ3_S reads the halves' layout)"
#endif
template <int RPT>
__device__ __forceinline__ void slice_run(const Slice (&sl)[RPT], int s, const XQ& xq, float (&acc)[RPT][1]) {
    slice_dot_q<RPT>(sl, s, xq, acc);
}
#endif

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

// Every lane of a group of tpr lanes gets the group's sum of acc (the first n token columns), by shuffles.
template <int RPT, int TT>
__device__ __forceinline__ void group_sum(float (&acc)[RPT][TT], int n, int tpr) {
#pragma unroll
    for (int r = 0; r < RPT; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t)
            if (t < n)
                for (int m = tpr >> 1; m > 0; m >>= 1) acc[r][t] += SHFL_XOR(acc[r][t], m, tpr);
}

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
    group_sum<RPT, TT>(acc, n, tpr);
}

// A lane group's walk: `chunks` runs of RPT rows, `stride` rows apart, from row r0 (clamped to R - 1). A block
// takes several runs of its rows where its launch would not fit on the GPU at once (the host's row_chunks): it
// then stages its x once for all of them, and its loads run on from one chunk into the next.

// The group's first slices, loaded before a `_1q` block stages its x so that their reads overlap the staging.
template <int RPT>
__device__ __forceinline__ void first_slices(const u8* __restrict__ raw, i64 row_bytes, int R, int r0, int C, int tpr,
                                             Slice (&cur)[RPT]) {
    int lane = threadIdx.x & (tpr - 1);
    if (lane < C / SLICE_WEIGHTS) {
#pragma unroll
        for (int r = 0; r < RPT; ++r) cur[r] = load_slice(raw + (i64)min(r0 + r, R - 1) * row_bytes, lane);
    }
}

// Times a lane's slice loop is unrolled (a format's header may set it): 2 spares the copies of the loads in flight into
// the slices dotted next, at the cost of registers.
#ifndef SLICE_UNROLL
#define SLICE_UNROLL 1
#endif

// Slices a lane has in flight while it dots one (DECODE_PREFETCH - 1): 2 is the double buffer below; more take the
// ring of rows_dot_store_ring (the same products in the same order: the same sums), for launches too small to keep
// the memory busy otherwise.
#ifndef DECODE_PREFETCH
#define DECODE_PREFETCH 2
#endif

// PEEL_LAST_SLICE (0 or 1): rows_dot_store's loop without its last slices, which load the next chunk's first (the
// loop's loads then come from the chunk's rows alone, their addresses not picked a slice at a time).
#ifndef PEEL_LAST_SLICE
#define PEEL_LAST_SLICE 0
#endif

// out [n, R] (rows t R apart), rows of each chunk = those rows of `raw` dotted with the n token rows of xs;
// cur: first_slices' loads. The group sums its lanes with shuffles and its first lane stores.
template <int RPT, int TT, class X>
__device__ __forceinline__ void rows_dot_store(const u8* __restrict__ raw, i64 row_bytes, int R, int r0, int stride,
                                               int chunks, const X& xs, int C, int n, int tpr, Slice (&cur)[RPT],
                                               float* out) {
    int lane = threadIdx.x & (tpr - 1), num_slices = C / SLICE_WEIGHTS;
    int per_lane = lane < num_slices ? (num_slices - 1 - lane) / tpr + 1 : 0;  // slices lane, lane + tpr, ...
    Slice next[RPT];
    for (int c = 0; c < chunks; ++c) {
        int rc = r0 + c * stride;
        const u8* row[RPT];
        float acc[RPT][TT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            row[r] = raw + (i64)min(rc + r, R - 1) * row_bytes;
#pragma unroll
            for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
        }
#if PEEL_LAST_SLICE
        // the chunk's last slices apart: the loop's loads come from the chunk's own rows alone
#pragma unroll SLICE_UNROLL
        for (int i = 0; i + 1 < per_lane; ++i) {  // the next slices' loads are in flight while these are dotted
            int s = lane + i * tpr;
#pragma unroll
            for (int r = 0; r < RPT; ++r) next[r] = load_slice(row[r], s + tpr);
            slice_run(cur, s, xs, acc);
#pragma unroll
            for (int r = 0; r < RPT; ++r) cur[r] = next[r];
        }
        if (per_lane > 0) {
            if (c + 1 < chunks) {  // after a chunk's last slices: the next chunk's first
#pragma unroll
                for (int r = 0; r < RPT; ++r)
                    next[r] = load_slice(raw + (i64)min(rc + stride + r, R - 1) * row_bytes, lane);
            }
            slice_run(cur, lane + (per_lane - 1) * tpr, xs, acc);
#pragma unroll
            for (int r = 0; r < RPT; ++r) cur[r] = next[r];
        }
#else
#pragma unroll SLICE_UNROLL
        for (int i = 0; i < per_lane; ++i) {  // the next slices' loads are in flight while these are dotted
            int s = lane + i * tpr;
            bool last = i + 1 == per_lane;
            if (!last || c + 1 < chunks) {  // after a chunk's last slices: the next chunk's first
#pragma unroll
                for (int r = 0; r < RPT; ++r)
                    next[r] = load_slice(last ? raw + (i64)min(rc + stride + r, R - 1) * row_bytes : row[r],
                                         last ? lane : s + tpr);
            }
            slice_run(cur, s, xs, acc);
#pragma unroll
            for (int r = 0; r < RPT; ++r) cur[r] = next[r];
        }
#endif
        group_sum<RPT, TT>(acc, n, tpr);
        store_rows<RPT, TT>(out, R, rc, n, tpr, acc);
    }
}

#if DECODE_PREFETCH > 2
// rows_dot_store with DECODE_PREFETCH slices in a ring: the lane's slices of every chunk in one sequence g = chunk *
// per_lane + i (every lane of a group the same count; those past the row's slices load and dot nothing), slice g +
// DECODE_PREFETCH loaded as soon as slice g is dotted.
template <int RPT, int TT, class X>
__device__ __forceinline__ void rows_dot_store_ring(const u8* __restrict__ raw, i64 row_bytes, int R, int r0,
                                                    int stride, int chunks, const X& xs, int C, int n, int tpr,
                                                    Slice (&cur)[RPT], float* out) {
    int lane = threadIdx.x & (tpr - 1), num_slices = C / SLICE_WEIGHTS;
    int per_lane = (num_slices + tpr - 1) / tpr, total = chunks * per_lane;
    Slice ring[DECODE_PREFETCH][RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r) ring[0][r] = cur[r];
    int lc = 0, li = 0;  // chunk and index of the next slice to load
#pragma unroll
    for (int u = 1; u < DECODE_PREFETCH; ++u) {
        if (++li == per_lane) {
            li = 0;
            ++lc;
        }
        int s = lane + li * tpr;
        if (u < total && s < num_slices) {
#pragma unroll
            for (int r = 0; r < RPT; ++r)
                ring[u][r] = load_slice(raw + (i64)min(r0 + lc * stride + r, R - 1) * row_bytes, s);
        }
    }
    int c = 0, i = 0;  // chunk and index of the slice dotted
    float acc[RPT][TT];
    for (int g0 = 0; g0 < total; g0 += DECODE_PREFETCH) {
#pragma unroll
        for (int u = 0; u < DECODE_PREFETCH; ++u) {
            if (g0 + u < total) {  // the same in the whole group
                if (i == 0) {
#pragma unroll
                    for (int r = 0; r < RPT; ++r)
#pragma unroll
                        for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
                }
                int s = lane + i * tpr;
                if (s < num_slices) slice_run(ring[u], s, xs, acc);
                if (++li == per_lane) {
                    li = 0;
                    ++lc;
                }
                int sn = lane + li * tpr;
                if (g0 + u + DECODE_PREFETCH < total && sn < num_slices) {
#pragma unroll
                    for (int r = 0; r < RPT; ++r)
                        ring[u][r] = load_slice(raw + (i64)min(r0 + lc * stride + r, R - 1) * row_bytes, sn);
                }
                if (++i == per_lane) {
                    group_sum<RPT, TT>(acc, n, tpr);
                    store_rows<RPT, TT>(out, R, r0 + c * stride, n, tpr, acc);
                    i = 0;
                    ++c;
                }
            }
        }
    }
}
#define ROWS_DOT_STORE rows_dot_store_ring
#else
#define ROWS_DOT_STORE rows_dot_store
#endif

// A lane group's rows in a grid of blocks over R rows: block b takes `chunks` runs of blockDim / tpr groups of
// RPT rows (those of them that start below R).
struct Walk {
    int r0, stride, chunks;
};

template <int RPT>
__device__ __forceinline__ Walk block_walk(int R, int tpr, int chunks) {
    Walk w;
    w.stride = (int)(blockDim.x / tpr) * RPT;
    int first = blockIdx.x * chunks * w.stride;
    w.r0 = first + (int)(threadIdx.x / tpr) * RPT;
    w.chunks = min(chunks, (R - first + w.stride - 1) / w.stride);
    return w;
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

// The one-token kernels walk runs of rows (block_walk; instanced with TT = 1): out [1, R] = x [1, C] @
// dequant(raw [R, B]).T; grid (ceil(R / (RPT * blockDim / tpr * chunks)), 1).
template <int RPT, int TT>
__device__ __forceinline__ void walk_matmul_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                                 float* __restrict__ out, int T, int R, int C, i64 row_bytes, int tpr,
                                                 int chunks) {
    Walk wk = block_walk<RPT>(R, tpr, chunks);
    int t0 = blockIdx.y * TT, n = min(TT, T - t0);
    Slice cur[RPT];
    first_slices<RPT>(raw, row_bytes, R, wk.r0, C, tpr, cur);
    ROWS_DOT_STORE<RPT, TT>(raw, row_bytes, R, wk.r0, wk.stride, wk.chunks, FloatRows{x + (i64)t0 * C, C, n}, C, n,
                            tpr, cur, out + (i64)t0 * R);
}

// moe_matmul_body's one-token twin on the walk: grid (ceil(R / (RPT * blockDim / tpr * chunks)), W).
// w: the block's work tile (blockIdx.y, or of the pair kernels' half).
template <int RPT, int TT>
__device__ __forceinline__ void walk_moe_matmul_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                                     float* __restrict__ out, const int* tile_slot, const int* tile_row,
                                                     const int* tile_count, int R, int C, i64 row_bytes, int tpr,
                                                     int chunks, int w) {
    int row0 = tile_row[w], n = tile_count[w];
    if (n <= 0) return;  // a decode pair whose expert is not resident (decode_tiles): nothing to read
    const u8* expert = raw + (i64)tile_slot[w] * R * row_bytes;
    Walk wk = block_walk<RPT>(R, tpr, chunks);
    Slice cur[RPT];
    first_slices<RPT>(expert, row_bytes, R, wk.r0, C, tpr, cur);
    ROWS_DOT_STORE<RPT, TT>(expert, row_bytes, R, wk.r0, wk.stride, wk.chunks, FloatRows{x + (i64)row0 * C, C, n}, C,
                            n, tpr, cur, out + (i64)row0 * R);
}

#define MATMUL_ARGS const u8 *raw, const float *x, float *out, int T, int R, int C, i64 row_bytes, int tpr, int chunks
#define MOE_ARGS                                                                                        \
    const u8 *raw, const float *x, float *out, const int *tile_slot, const int *tile_row, const int *tile_count, \
        int R, int C, i64 row_bytes, int tpr, int chunks
// The pair kernels: two weights of one format and shape (an expert's gate and up) over the same rows x in one launch,
// grid (.., 2W): blocks of y < W multiply raw into out with tile y, the others raw2 into out2 with tile y - W.
#define MOE2_ARGS                                                                                                 \
    const u8 *raw, const u8 *raw2, const float *x, float *out, float *out2, const int *tile_slot, const int *tile_row, \
        const int *tile_count, int R, int C, i64 row_bytes, int tpr, int chunks
#define MOE2_PICK                                        \
    int half = gridDim.y / 2, w = blockIdx.y % half;     \
    if (blockIdx.y >= half) {                            \
        raw = raw2;                                      \
        out = out2;                                      \
    }

// The tiled kernels take one run of rows a block: `chunks` is there for the common argument list (the host passes 1).
extern "C" __global__ void matmul(MATMUL_ARGS) { matmul_body<1, TILE_TOKENS>(raw, x, out, T, R, C, row_bytes, tpr); }

extern "C" __global__ void DECODE_BOUNDS matmul_1(MATMUL_ARGS) {
    walk_matmul_body<DECODE_ROWS, 1>(raw, x, out, T, R, C, row_bytes, tpr, chunks);
}

// matmul_1 over T <= MULTI_TOKENS * gridDim.y tokens (a decode step of several users): each block's lane groups read
// their rows once for the MULTI_TOKENS tokens of blockIdx.y; grid (ceil(R / (RPT * blockDim / tpr * chunks)),
// ceil(T / MULTI_TOKENS)).
extern "C" __global__ void matmul_n(MATMUL_ARGS) {
    walk_matmul_body<DECODE_ROWS, MULTI_TOKENS>(raw, x, out, T, R, C, row_bytes, tpr, chunks);
}

extern "C" __global__ void moe_matmul(MOE_ARGS) {
    moe_matmul_body<1, TILE_TOKENS>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul_1(MOE_ARGS) {
    walk_moe_matmul_body<DECODE_ROWS, 1>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks,
                                         blockIdx.y);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul2_1(MOE2_ARGS) {
    MOE2_PICK
    walk_moe_matmul_body<DECODE_ROWS, 1>(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, w);
}

#ifdef INT_DECODE
// A format's tables that its slice_dot_q reads from shared memory, copied there by the whole block before stage_xq
// (whose sync publishes them); none by default.
#ifndef STAGE_TABLES
#define STAGE_TABLES()
#define TABLES_SYNC()
#else
#define TABLES_SYNC() __syncthreads()  // the `_qx` kernels stage no x: the tables' own sync
#endif

// The one-token kernels with x rounded to int16 once per block (XQ_SHARED_BYTES(C) of dynamic shared memory):
// the same grids, lane groups and rows as matmul_1 and moe_matmul_1.
extern "C" __global__ void DECODE_BOUNDS matmul_1q(MATMUL_ARGS) {
    extern __shared__ float4 xq_smem[];
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(raw, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    XQ xq = stage_xq(x, C, (unsigned char*)xq_smem);
    ROWS_DOT_STORE<DECODE_ROWS, 1>(raw, row_bytes, R, wk.r0, wk.stride, wk.chunks, xq, C, 1, tpr, cur, out);
}

// A few tokens' x rounded to int16, each in its own XQ (the `_nq` kernel): slice_run dots a lane's slices, loaded
// once, with each token's x in turn (the one-token kernel's products and sums, token by token).
struct XQn {
    XQ t[MULTI_TOKENS];
    int n;
};

template <int RPT, int TT>
__device__ __forceinline__ void slice_run(const Slice (&sl)[RPT], int s, const XQn& xs, float (&acc)[RPT][TT]) {
#pragma unroll
    for (int t = 0; t < TT; ++t) {
        if (t < xs.n) {
            float a[RPT][1];
#pragma unroll
            for (int r = 0; r < RPT; ++r) a[r][0] = acc[r][t];
            slice_dot_q<RPT>(sl, s, xs.t[t], a);
#pragma unroll
            for (int r = 0; r < RPT; ++r) acc[r][t] = a[r][0];
        }
    }
}

// matmul_1q over T <= MULTI_TOKENS * gridDim.y tokens: each block's lane groups read their rows once for the
// MULTI_TOKENS tokens of blockIdx.y, whose x it rounds to int16 (each at a multiple of 16 bytes of XQ_SHARED_BYTES(C)
// in dynamic shared memory); out [T, R]. grid (ceil(R / (RPT * blockDim / tpr * chunks)), ceil(T / MULTI_TOKENS)).
extern "C" __global__ void matmul_nq(MATMUL_ARGS) {
    extern __shared__ float4 xq_smem[];
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    int t0 = blockIdx.y * MULTI_TOKENS, n = min(MULTI_TOKENS, T - t0), step = (XQ_SHARED_BYTES(C) + 15) & ~15;
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(raw, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    XQn xs;
    xs.n = n;
#pragma unroll
    for (int t = 0; t < MULTI_TOKENS; ++t)
        if (t < n) xs.t[t] = stage_xq(x + (i64)(t0 + t) * C, C, (unsigned char*)xq_smem + t * step);
    ROWS_DOT_STORE<DECODE_ROWS, MULTI_TOKENS>(raw, row_bytes, R, wk.r0, wk.stride, wk.chunks, xs, C, n, tpr, cur,
                                              out + (i64)t0 * R);
}

// up: where given, x is the gate and the rows multiplied are silu_mul(x, up) (stage_xq).
__device__ __forceinline__ void moe_1q_body(const u8* __restrict__ raw, const float* __restrict__ x,
                                            float* __restrict__ out, const int* tile_slot, const int* tile_row,
                                            const int* tile_count, int R, int C, i64 row_bytes, int tpr, int chunks,
                                            int w, const float* __restrict__ up = nullptr) {
    int row0 = tile_row[w];
    if (tile_count[w] <= 0) return;  // the whole block: a pair whose expert is not resident
    extern __shared__ float4 xq_smem[];
    const u8* expert = raw + (i64)tile_slot[w] * R * row_bytes;
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(expert, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    XQ xq = stage_xq(x + (i64)row0 * C, C, (unsigned char*)xq_smem, up ? up + (i64)row0 * C : nullptr);
    ROWS_DOT_STORE<DECODE_ROWS, 1>(expert, row_bytes, R, wk.r0, wk.stride, wk.chunks, xq, C, 1, tpr, cur,
                                   out + (i64)row0 * R);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul_1q(MOE_ARGS) {
    moe_1q_body(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, blockIdx.y);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul2_1q(MOE2_ARGS) {
    MOE2_PICK
    moe_1q_body(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, w);
}

// moe_matmul_1q of the experts' SwiGLU: the rows multiplied are silu_mul(x, up) of x [N, C] (the gate) and up [N, C].
extern "C" __global__ void DECODE_BOUNDS moe_matmul_glu_1q(const u8* raw, const float* x, const float* up, float* out,
                                                           const int* tile_slot, const int* tile_row,
                                                           const int* tile_count, int R, int C, i64 row_bytes, int tpr,
                                                           int chunks) {
    moe_1q_body(raw, x, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, blockIdx.y, up);
}

// ---- x rounded to int16 once per launch (the `_qx` kernels; Kernels.xq_per_launch): quantize_xq rounds every row of x
// into global memory, each row's XQ (stage_xq's layout) XQ_STEP(C) bytes apart, and the kernels' blocks read it there
// instead of each rounding its rows' x into shared memory.
#define XQ_STEP(C) ((XQ_SHARED_BYTES(C) + 15) & ~15)

// The XQ of one row of x at `at` (XQ_STEP(C) bytes, quantize_xq's).
__device__ __forceinline__ XQ xq_at(const unsigned char* __restrict__ at, int C) {
    XQ xq;
    xq.hi = (const i8*)at;
    xq.lo = xq.hi + C;
    xq.scale = (const float*)(at + 2 * C);
    xq.sum = xq.scale + C / XQ_BLOCK;
    return xq;
}

// xq [N, XQ_STEP(C)] = x [N, C] (silu_mul(x, up) where up is given: the experts' SwiGLU) rounded as stage_xq rounds
// it: a warp a 32-value block. grid (ceil(C / blockDim), N).
extern "C" __global__ void quantize_xq(const float* __restrict__ x, const float* __restrict__ up, int has_up,
                                       unsigned char* __restrict__ xq, int C) {
    int lane = threadIdx.x & 31, b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= C / XQ_BLOCK) return;  // the whole warp
    i64 row = blockIdx.y;
    int i = XQ_BLOCK * b + lane;
    float v = has_up ? silu_mul(x[row * C + i], up[row * C + i]) : x[row * C + i];
    float amax = fabsf(v), total = v;
    for (int m = 16; m > 0; m >>= 1) {
        amax = fmaxf(amax, SHFL_XOR(amax, m, 32));
        total += SHFL_XOR(total, m, 32);
    }
    float inv = amax > 0.0f ? XQ_LEVELS / amax : 0.0f;
    int q = __float2int_rn(v * inv);
    int h = (q + 128) >> 8;
    unsigned char* at = xq + row * XQ_STEP(C);
    at[XQ_INDEX(b, lane, C)] = (unsigned char)(i8)h;
    at[C + XQ_INDEX(b, lane, C)] = (unsigned char)(i8)(q - 256 * h);
    if (lane == 0) {
        ((float*)(at + 2 * C))[b] = amax / XQ_LEVELS;
        ((float*)(at + 2 * C))[C / XQ_BLOCK + b] = total;
    }
}

#define XQ_ARGS \
    const u8 *raw, const unsigned char *xq, float *out, int T, int R, int C, i64 row_bytes, int tpr, int chunks
#define MOE_XQ_ARGS                                                                                          \
    const u8 *raw, const unsigned char *xq, float *out, const int *tile_slot, const int *tile_row,           \
        const int *tile_count, int R, int C, i64 row_bytes, int tpr, int chunks
#define MOE2_XQ_ARGS                                                                                         \
    const u8 *raw, const u8 *raw2, const unsigned char *xq, float *out, float *out2, const int *tile_slot,    \
        const int *tile_row, const int *tile_count, int R, int C, i64 row_bytes, int tpr, int chunks

// matmul_1q over quantize_xq's x [1, XQ_STEP(C)]: the same grid, rows and sums.
extern "C" __global__ void DECODE_BOUNDS matmul_1qx(XQ_ARGS) {
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(raw, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    TABLES_SYNC();
    ROWS_DOT_STORE<DECODE_ROWS, 1>(raw, row_bytes, R, wk.r0, wk.stride, wk.chunks, xq_at(xq, C), C, 1, tpr, cur, out);
}

// matmul_nq over quantize_xq's x [T, XQ_STEP(C)]: the same grid, rows and sums.
extern "C" __global__ void matmul_nqx(XQ_ARGS) {
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    int t0 = blockIdx.y * MULTI_TOKENS, n = min(MULTI_TOKENS, T - t0);
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(raw, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    TABLES_SYNC();
    XQn xs;
    xs.n = n;
#pragma unroll
    for (int t = 0; t < MULTI_TOKENS; ++t)
        if (t < n) xs.t[t] = xq_at(xq + (i64)(t0 + t) * XQ_STEP(C), C);
    ROWS_DOT_STORE<DECODE_ROWS, MULTI_TOKENS>(raw, row_bytes, R, wk.r0, wk.stride, wk.chunks, xs, C, n, tpr, cur,
                                              out + (i64)t0 * R);
}

// moe_1q_body over quantize_xq's rows xq [N, XQ_STEP(C)].
__device__ __forceinline__ void moe_1qx_body(const u8* __restrict__ raw, const unsigned char* __restrict__ xq,
                                             float* __restrict__ out, const int* tile_slot, const int* tile_row,
                                             const int* tile_count, int R, int C, i64 row_bytes, int tpr, int chunks,
                                             int w) {
    int row0 = tile_row[w];
    if (tile_count[w] <= 0) return;  // the whole block: a pair whose expert is not resident
    const u8* expert = raw + (i64)tile_slot[w] * R * row_bytes;
    Walk wk = block_walk<DECODE_ROWS>(R, tpr, chunks);
    Slice cur[DECODE_ROWS];
    first_slices<DECODE_ROWS>(expert, row_bytes, R, wk.r0, C, tpr, cur);
    STAGE_TABLES();
    TABLES_SYNC();
    ROWS_DOT_STORE<DECODE_ROWS, 1>(expert, row_bytes, R, wk.r0, wk.stride, wk.chunks,
                                   xq_at(xq + (i64)row0 * XQ_STEP(C), C), C, 1, tpr, cur, out + (i64)row0 * R);
}

// moe_matmul_1q and moe_matmul2_1q over quantize_xq's rows (with up, moe_matmul_glu_1q's).
extern "C" __global__ void DECODE_BOUNDS moe_matmul_1qx(MOE_XQ_ARGS) {
    moe_1qx_body(raw, xq, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, blockIdx.y);
}

extern "C" __global__ void DECODE_BOUNDS moe_matmul2_1qx(MOE2_XQ_ARGS) {
    MOE2_PICK
    moe_1qx_body(raw, xq, out, tile_slot, tile_row, tile_count, R, C, row_bytes, tpr, chunks, w);
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
