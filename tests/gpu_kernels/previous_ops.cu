// The decode ops as they were before the block-shape rewrite (ops.cu rmsnorm, add_rmsnorm, combine_rows; routing.cu
// route_topk with a scan of the held slots a pick), kept for tests/gpu_kernels/test_decode_ops.py (the new kernels'
// results against these) and bench/gpu_decode_ops.py (their times). Compiled after common.cuh alone.

// out [T, H] = w * x * rsqrt(mean(x^2) + eps); out may be x. grid (T); shared: blockDim floats.
extern "C" __global__ void prev_rmsnorm(const float* x, const float* w, float* out, int H, float eps) {
    extern __shared__ float red[];
    const float* xr = x + (i64)blockIdx.x * H;
    float* orow = out + (i64)blockIdx.x * H;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) sum_sq += xr[i] * xr[i];
    float total = block_sum(sum_sq, red);
    float inv_rms = (float)(1.0 / sqrt((double)total / H + (double)eps));
    for (int i = threadIdx.x; i < H; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv_rms);
}

// x [T, H] += y [T, H], then out [T, H] = rmsnorm(x) with weight w [H] (a residual add and the next norm in one
// launch; the same sums as add_into then rmsnorm at one blockDim). grid (T); shared: blockDim floats.
extern "C" __global__ void prev_add_rmsnorm(float* x, const float* y, const float* w, float* out, int H, float eps) {
    extern __shared__ float red[];
    float* xr = x + (i64)blockIdx.x * H;
    const float* yr = y + (i64)blockIdx.x * H;
    float* orow = out + (i64)blockIdx.x * H;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float v = xr[i] + yr[i];
        xr[i] = v;
        sum_sq += v * v;
    }
    float total = block_sum(sum_sq, red);
    float inv_rms = (float)(1.0 / sqrt((double)total / H + (double)eps));
    for (int i = threadIdx.x; i < H; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv_rms);
}

// out [T, H] = sum over slots j of weights[t*K + j] * expert_out[row_of_pair[t*K + j]], skipping
// pairs not held here (row -1); expert_out [N, H]. Slot order is fixed, so the sum is too. grid (T).
extern "C" __global__ void prev_combine_rows(const float* expert_out, const int* row_of_pair, const float* weights,
                                        float* out, int K, int H) {
    int t = blockIdx.x;
    for (int d = threadIdx.x; d < H; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            int i = row_of_pair[t * K + j];
            if (i >= 0) acc += weights[t * K + j] * expert_out[(i64)i * H + d];
        }
        out[(i64)t * H + d] = acc;
    }
}

#define ROUTE_LANES 32
#define ROUTE_HELD 16  // experts a lane holds: E <= 512
#define ROUTE_NO_ID 0x7fffffff
#define ROUTE_LOWEST (-3.0e38f)  // below any score (cpu_kernels/routing.py's LOWEST)

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC_RTC__)
#define ROUTE_SHFL(v, lane) __shfl((v), (lane), ROUTE_LANES)
#else
#define ROUTE_SHFL(v, lane) __shfl_sync(0xffffffffu, (v), (lane), ROUTE_LANES)
#endif

__device__ __forceinline__ float sigmoid_of(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float z = expf(x);
    return z / (1.0f + z);
}

// Whether (v, id) ranks before (v2, id2): a higher value, or an equal one with a lower id.
__device__ __forceinline__ bool ranks_before(float v, int id, float v2, int id2) {
    return v > v2 || (v == v2 && id < id2);
}

// The group's first (v, id) in ranks_before's order; every lane gets it.
__device__ __forceinline__ void group_first(float& v, int& id) {
    for (int m = ROUTE_LANES / 2; m > 0; m >>= 1) {
        float v2 = SHFL_XOR(v, m, ROUTE_LANES);
        int id2 = SHFL_XOR(id, m, ROUTE_LANES);
        if (ranks_before(v2, id2, v, id)) {
            v = v2;
            id = id2;
        }
    }
}

__device__ __forceinline__ float group_max(float v) {
    for (int m = ROUTE_LANES / 2; m > 0; m >>= 1) v = fmaxf(v, SHFL_XOR(v, m, ROUTE_LANES));
    return v;
}

__device__ __forceinline__ double group_sum(double v) {
    for (int m = ROUTE_LANES / 2; m > 0; m >>= 1) v += SHFL_XOR(v, m, ROUTE_LANES);
    return v;
}

// Bit i set where the lane's held slot i (expert lane + 32 i) is below E and in an allowed group (bit e / size of
// `allowed`).
__device__ __forceinline__ unsigned held_mask(int lane, int E, unsigned long long allowed, int size) {
    unsigned mask = 0u;
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) {
        int e = lane + ROUTE_LANES * i;
        if (e < E && ((allowed >> (e / size)) & 1ull)) mask |= 1u << i;
    }
    return mask;
}

// The K best of the lane's held values vals [ROUTE_HELD] (slots in held_mask's `mask`), in ranks_before's order:
// lane j < K gets pick j in (v, id); the others keep (ROUTE_LOWEST, ROUTE_NO_ID).
__device__ __forceinline__ void group_topk(const float* vals, unsigned mask, int K, int lane, float& v, int& id) {
    float last_v = 0.0f;
    int last_id = -1;  // none picked yet
    v = ROUTE_LOWEST;
    id = ROUTE_NO_ID;
    for (int j = 0; j < K; ++j) {
        float bv = NEG_INF;
        int bid = ROUTE_NO_ID;
#pragma unroll
        for (int i = 0; i < ROUTE_HELD; ++i) {
            int e = lane + ROUTE_LANES * i;
            if (((mask >> i) & 1u) && (last_id < 0 || ranks_before(last_v, last_id, vals[i], e))
                && ranks_before(vals[i], e, bv, bid)) {
                bv = vals[i];
                bid = e;
            }
        }
        group_first(bv, bid);
        if (lane == j) {
            v = bv;
            id = bid;
        }
        last_v = bv;
        last_id = bid;
    }
}

// The sum over lanes j < K of x (lane j's), added in j order as a serial loop adds (every lane gets it).
__device__ __forceinline__ float serial_sum(float x, int K) {
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) sum += ROUTE_SHFL(x, j);
    return sum;
}

// The calling lane's token, or -1 past T.
__device__ __forceinline__ int route_token(int T) {
    int t = blockIdx.x * (blockDim.x / ROUTE_LANES) + threadIdx.x / ROUTE_LANES;
    return t < T ? t : -1;
}

// Router: softmax over logits [T, E], the K largest (ties to the lower id, highest first) -> ids [T, K] int32,
// weights [T, K] (renormalized over the K, summed in order, when normalize).
extern "C" __global__ void prev_route_topk(const float* logits, int* ids, float* weights, int T, int E, int K,
                                      int normalize) {
    int t = route_token(T), lane = threadIdx.x % ROUTE_LANES;
    if (t < 0) return;
    const float* lt = logits + (i64)t * E;
    float vals[ROUTE_HELD];
    float best = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) {
        int e = lane + ROUTE_LANES * i;
        vals[i] = e < E ? lt[e] : NEG_INF;
        best = fmaxf(best, vals[i]);
    }
    best = group_max(best);
    double total = 0.0;
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) {
        if (lane + ROUTE_LANES * i < E) {
            vals[i] = expf(vals[i] - best);
            total += (double)vals[i];
        }
    }
    float inv_total = (float)(1.0 / group_sum(total));
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) vals[i] *= inv_total;
    float v;
    int id;
    group_topk(vals, held_mask(lane, E, ~0ull, E), K, lane, v, id);
    if (normalize) v /= serial_sum(v, K);
    if (lane < K) {
        ids[(i64)t * K + lane] = id;
        weights[(i64)t * K + lane] = v;
    }
}

