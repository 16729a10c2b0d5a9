// The routers as one thread a token computes them (the kernels before routing.cu's lane groups): the GPU tests'
// reference for the same ids and weights (tests/gpu_kernels/test_routing_kernels.py). Compiled after common.cuh.

#define SERIAL_LOWEST (-3.0e38f)

__device__ __forceinline__ float serial_sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float z = expf(x);
    return z / (1.0f + z);
}

// Router: softmax over logits [T, E], the K largest (ties to the lower id, highest first) ->
// ids [T, K] int32, weights [T, K] (renormalized over the K when normalize). One thread a token.
extern "C" __global__ void serial_route_topk(const float* logits, int* ids, float* weights, int T, int E, int K,
                                      int normalize) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* lt = logits + (i64)t * E;
    int* it = ids + (i64)t * K;
    float* wt = weights + (i64)t * K;
    float best = lt[0];
    for (int e = 1; e < E; ++e) best = fmaxf(best, lt[e]);
    double total = 0.0;
    for (int e = 0; e < E; ++e) total += (double)expf(lt[e] - best);
    float inv_total = (float)(1.0 / total);
    int kept = 0;
    for (int e = 0; e < E; ++e) {
        float pe = expf(lt[e] - best) * inv_total;
        if (kept == K && pe <= wt[K - 1]) continue;
        int slot = min(kept, K - 1);
        while (slot > 0 && wt[slot - 1] < pe) {
            wt[slot] = wt[slot - 1];
            it[slot] = it[slot - 1];
            --slot;
        }
        wt[slot] = pe;
        it[slot] = e;
        kept = min(kept + 1, K);
    }
    if (normalize) {
        float sum = 0.0f;
        for (int j = 0; j < K; ++j) sum += wt[j];
        for (int j = 0; j < K; ++j) wt[j] /= sum;
    }
}

// Router (gpt-oss): the K largest of logits [T, E] (ties to the lower id, highest first) -> ids [T, K] int32,
// then the softmax over those K -> weights [T, K]. One thread a token.
extern "C" __global__ void serial_route_topk_softmax(const float* logits, int* ids, float* weights, int T, int E, int K) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* lt = logits + (i64)t * E;
    int* it = ids + (i64)t * K;
    float* wt = weights + (i64)t * K;
    int kept = 0;
    for (int e = 0; e < E; ++e) {
        float v = lt[e];
        if (kept == K && v <= wt[K - 1]) continue;
        int slot = min(kept, K - 1);
        while (slot > 0 && wt[slot - 1] < v) {
            wt[slot] = wt[slot - 1];
            it[slot] = it[slot - 1];
            --slot;
        }
        wt[slot] = v;
        it[slot] = e;
        kept = min(kept + 1, K);
    }
    float best = wt[0], total = 0.0f;
    for (int j = 0; j < K; ++j) {
        wt[j] = expf(wt[j] - best);
        total += wt[j];
    }
    for (int j = 0; j < K; ++j) wt[j] /= total;
}

// Router: scores s = sigmoid(logits [T, E]); the choice ranks s + bias [E] among the experts of the topk_groups
// groups (G equal runs of ids) whose two best choice values sum highest (ties to the lower group), the K best (ties
// to the lower id, best first) -> ids [T, K] int32; weights [T, K] = their s, over their sum (+1e-20) where
// normalize, times scale (the weights row holds the choice values while choosing). One thread a token.
extern "C" __global__ void serial_route_sigmoid(const float* logits, const float* bias, int* ids, float* weights, int T,
                                         int E, int K, int G, int topk_groups, int normalize, float scale) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* lt = logits + (i64)t * E;
    int* it = ids + (i64)t * K;
    float* wt = weights + (i64)t * K;
    int size = E / G;
    unsigned long long allowed = G >= 64 ? ~0ull : (1ull << G) - 1ull;
    if (topk_groups < G) {
        allowed = 0ull;
        for (int n = 0; n < topk_groups; ++n) {
            int best = -1;
            float best_score = 0.0f;
            for (int g = 0; g < G; ++g) {
                if ((allowed >> g) & 1ull) continue;
                float first = SERIAL_LOWEST, second = SERIAL_LOWEST;
                for (int e = g * size; e < (g + 1) * size; ++e) {
                    float c = serial_sigmoid(lt[e]) + bias[e];
                    if (c > first) {
                        second = first;
                        first = c;
                    } else if (c > second) {
                        second = c;
                    }
                }
                float score = first + second;
                if (best < 0 || score > best_score) {
                    best = g;
                    best_score = score;
                }
            }
            allowed |= 1ull << best;
        }
    }
    int kept = 0;
    for (int e = 0; e < E; ++e) {
        if (!((allowed >> (e / size)) & 1ull)) continue;
        float c = serial_sigmoid(lt[e]) + bias[e];
        if (kept == K && c <= wt[K - 1]) continue;
        int slot = min(kept, K - 1);
        while (slot > 0 && wt[slot - 1] < c) {
            wt[slot] = wt[slot - 1];
            it[slot] = it[slot - 1];
            --slot;
        }
        wt[slot] = c;
        it[slot] = e;
        kept = min(kept + 1, K);
    }
    float sum = 0.0f;
    for (int j = 0; j < K; ++j) {
        wt[j] = serial_sigmoid(lt[it[j]]);
        sum += wt[j];
    }
    float factor = normalize ? scale / (sum + 1e-20f) : scale;
    for (int j = 0; j < K; ++j) wt[j] *= factor;
}
