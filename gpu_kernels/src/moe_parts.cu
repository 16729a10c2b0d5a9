// The MoE parts beside the softmax router (part of the "ops" module): the sigmoid router with a choice bias and
// group-limited top-k (GLM-4.5, DeepSeek-V3), and a bias added to every row (the q/k/v projections' biases).
//
// Shape legend: T tokens, E experts, K top-k, G expert groups (at most 64), R row width, n values.

#define ROUTE_LOWEST (-3.0e38f)  // below any score (cpu_kernels/routing.py's LOWEST)

__device__ __forceinline__ float sigmoid_of(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float z = expf(x);
    return z / (1.0f + z);
}

// x [n / R, R] += bias [R] elementwise. grid (ceil(n / blockDim)).
extern "C" __global__ void add_bias(float* x, const float* bias, i64 n, int R) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += bias[i % R];
}

// Router: scores s = sigmoid(logits [T, E]); the choice ranks s + bias [E] among the experts of the topk_groups
// groups (G equal runs of ids) whose two best choice values sum highest (ties to the lower group), the K best (ties
// to the lower id, best first) -> ids [T, K] int32; weights [T, K] = their s, over their sum (+1e-20) where
// normalize, times scale (the weights row holds the choice values while choosing). One thread a token.
extern "C" __global__ void route_sigmoid(const float* logits, const float* bias, int* ids, float* weights, int T,
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
                float first = ROUTE_LOWEST, second = ROUTE_LOWEST;
                for (int e = g * size; e < (g + 1) * size; ++e) {
                    float c = sigmoid_of(lt[e]) + bias[e];
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
        float c = sigmoid_of(lt[e]) + bias[e];
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
        wt[j] = sigmoid_of(lt[it[j]]);
        sum += wt[j];
    }
    float factor = normalize ? scale / (sum + 1e-20f) : scale;
    for (int j = 0; j < K; ++j) wt[j] *= factor;
}
