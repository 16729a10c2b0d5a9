// The MoE routers (part of the "ops" module): softmax top-k (Qwen3-MoE), top-k then softmax (gpt-oss), sigmoid with
// a choice bias and group-limited top-k (GLM-4.5, DeepSeek-V3).
//
// Shape legend: T tokens, E experts (at most ROUTE_LANES * ROUTE_HELD), K top-k (at most ROUTE_LANES), G expert
// groups (at most 64).
//
// A group of ROUTE_LANES lanes routes a token (blockDim a multiple of it; grid covers T tokens at blockDim /
// ROUTE_LANES a block): lane l holds experts l, l + 32, ... in registers, and each of the K picks is a shuffle
// arg-max over the lanes in the order (value high first, then id low), of the values ranked after the last pick.
// That order is the serial insertion's (cpu_kernels/routing.py keep_top): the same ids, ties to the lower id.
// Shuffles of width 32 work on waves of 32 and 64.

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
// lane j < K gets pick j in (v, id); the others keep (ROUTE_LOWEST, ROUTE_NO_ID). N: the slots that can hold an
// expert (a power of two, 32 N >= E). Each lane sorts its slots once (those not in the mask last, as (-inf,
// ROUTE_NO_ID), which ranks after every expert); each pick is the group's first of the lanes' heads, and the lane it
// came from drops its head. A pick past the experts there are is (-inf, ROUTE_NO_ID).
template <int N>
__device__ __forceinline__ void group_topk_sorted(const float* vals, unsigned mask, int K, int lane, float& v,
                                                  int& id) {
    float sv[N];
    int si[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
        bool held = (mask >> i) & 1u;
        sv[i] = held ? vals[i] : NEG_INF;
        si[i] = held ? lane + ROUTE_LANES * i : ROUTE_NO_ID;
    }
#pragma unroll
    for (int a = 0; a < N - 1; ++a)
#pragma unroll
        for (int b = N - 1; b > a; --b)
            if (ranks_before(sv[b], si[b], sv[b - 1], si[b - 1])) {
                float tv = sv[b];
                int ti = si[b];
                sv[b] = sv[b - 1];
                si[b] = si[b - 1];
                sv[b - 1] = tv;
                si[b - 1] = ti;
            }
    v = ROUTE_LOWEST;
    id = ROUTE_NO_ID;
    for (int j = 0; j < K; ++j) {
        float bv = sv[0];
        int bid = si[0];
        group_first(bv, bid);
        if (lane == j) {
            v = bv;
            id = bid;
        }
        if (bid == si[0]) {  // this lane's head was picked (or nothing is left anywhere)
#pragma unroll
            for (int i = 0; i < N - 1; ++i) {
                sv[i] = sv[i + 1];
                si[i] = si[i + 1];
            }
            sv[N - 1] = NEG_INF;
            si[N - 1] = ROUTE_NO_ID;
        }
    }
}

// group_topk_sorted over the slots E experts need.
__device__ __forceinline__ void group_topk(const float* vals, unsigned mask, int K, int lane, int E, float& v,
                                           int& id) {
    int n = (E + ROUTE_LANES - 1) / ROUTE_LANES;
    if (n <= 1) group_topk_sorted<1>(vals, mask, K, lane, v, id);
    else if (n <= 2) group_topk_sorted<2>(vals, mask, K, lane, v, id);
    else if (n <= 4) group_topk_sorted<4>(vals, mask, K, lane, v, id);
    else if (n <= 8) group_topk_sorted<8>(vals, mask, K, lane, v, id);
    else group_topk_sorted<ROUTE_HELD>(vals, mask, K, lane, v, id);
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
extern "C" __global__ void route_topk(const float* logits, int* ids, float* weights, int T, int E, int K,
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
        if (ROUTE_LANES * i >= E) break;  // the same in the whole group
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
    group_topk(vals, held_mask(lane, E, ~0ull, E), K, lane, E, v, id);
    if (normalize) v /= serial_sum(v, K);
    if (lane < K) {
        ids[(i64)t * K + lane] = id;
        weights[(i64)t * K + lane] = v;
    }
}

// Router (gpt-oss): the K largest of logits [T, E] (ties to the lower id, highest first) -> ids [T, K] int32,
// then the softmax over those K (float, summed in order) -> weights [T, K].
extern "C" __global__ void route_topk_softmax(const float* logits, int* ids, float* weights, int T, int E, int K) {
    int t = route_token(T), lane = threadIdx.x % ROUTE_LANES;
    if (t < 0) return;
    const float* lt = logits + (i64)t * E;
    float vals[ROUTE_HELD];
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) {
        int e = lane + ROUTE_LANES * i;
        vals[i] = e < E ? lt[e] : NEG_INF;
    }
    float v;
    int id;
    group_topk(vals, held_mask(lane, E, ~0ull, E), K, lane, E, v, id);
    float best = ROUTE_SHFL(v, 0);
    v = lane < K ? expf(v - best) : 0.0f;
    v /= serial_sum(v, K);
    if (lane < K) {
        ids[(i64)t * K + lane] = id;
        weights[(i64)t * K + lane] = v;
    }
}

// Router: scores s = sigmoid(logits [T, E]); the choice ranks s + bias [E] among the experts of the topk_groups
// groups (G equal runs of ids) whose two best choice values sum highest (ties to the lower group), the K best (ties
// to the lower id, best first) -> ids [T, K] int32; weights [T, K] = their s, over their sum (+1e-20, summed in
// order) where normalize, times scale.
extern "C" __global__ void route_sigmoid(const float* logits, const float* bias, int* ids, float* weights, int T,
                                         int E, int K, int G, int topk_groups, int normalize, float scale) {
    int t = route_token(T), lane = threadIdx.x % ROUTE_LANES;
    if (t < 0) return;
    const float* lt = logits + (i64)t * E;
    int size = E / G;
    float vals[ROUTE_HELD];
#pragma unroll
    for (int i = 0; i < ROUTE_HELD; ++i) {
        int e = lane + ROUTE_LANES * i;
        vals[i] = e < E ? sigmoid_of(lt[e]) + bias[e] : NEG_INF;
    }
    unsigned long long allowed = G >= 64 ? ~0ull : (1ull << G) - 1ull;
    if (topk_groups < G) {
        float score[2];  // groups lane and lane + 32
        for (int h = 0; h < 2; ++h) {
            int g = lane + ROUTE_LANES * h;
            float first = ROUTE_LOWEST, second = ROUTE_LOWEST;
            for (int e = g * size; g < G && e < (g + 1) * size; ++e) {
                float c = sigmoid_of(lt[e]) + bias[e];
                if (c > first) {
                    second = first;
                    first = c;
                } else if (c > second) {
                    second = c;
                }
            }
            score[h] = first + second;
        }
        allowed = 0ull;
        for (int n = 0; n < topk_groups; ++n) {
            float bv = NEG_INF;
            int bg = ROUTE_NO_ID;
            for (int h = 0; h < 2; ++h) {
                int g = lane + ROUTE_LANES * h;
                if (g < G && !((allowed >> g) & 1ull) && ranks_before(score[h], g, bv, bg)) {
                    bv = score[h];
                    bg = g;
                }
            }
            group_first(bv, bg);
            allowed |= 1ull << bg;
        }
    }
    float v;
    int id;
    group_topk(vals, held_mask(lane, E, allowed, size), K, lane, E, v, id);
    v = lane < K && id != ROUTE_NO_ID ? sigmoid_of(lt[id]) : 0.0f;
    float sum = serial_sum(v, K);
    v *= normalize ? scale / (sum + 1e-20f) : scale;
    if (lane < K) {
        ids[(i64)t * K + lane] = id;
        weights[(i64)t * K + lane] = v;
    }
}
