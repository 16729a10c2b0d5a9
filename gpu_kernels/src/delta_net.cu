// Gated DeltaNet (Qwen3-Next's linear attention) and the sigmoid output gates: causal depthwise conv + silu with
// its W-1 input state, the decay / beta gates, the gated delta rule token by token over a float32 state, the
// gated RMSNorm. cpu_kernels/delta_net.py holds the same ops for the CPU (and says what they compute).
//
// Shape legend: T tokens, C conv channels, W conv width, Hk key heads, Hv value heads (value head h reads key
// head h / (Hv / Hk), or h % Hk where tiled), Dk / Dv key / value head dim, n values.

#define DN_MAX_WIDTH 8   // conv taps held in registers
#define DN_MAX_DK 128    // key dims of a state column held in registers
#define DN_COLS 32       // state columns (value dims) a block of delta_rule

// out [T, C] = silu(causal conv of x [T, C] with w [C, W]); state [W-1, C]: the W-1 inputs before x, replaced by
// the last W-1 of state ++ x. One thread a channel. grid (ceil(C / blockDim)).
extern "C" __global__ void delta_conv1d_silu(const float* x, const float* w, float* state, float* out, int T, int C,
                                             int W) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float taps[DN_MAX_WIDTH], hist[DN_MAX_WIDTH];
#pragma unroll
    for (int i = 0; i < DN_MAX_WIDTH; ++i) {
        taps[i] = i < W ? w[(i64)c * W + i] : 0.0f;
        hist[i] = i < W - 1 ? state[(i64)i * C + c] : 0.0f;  // hist[W-1] takes the current input
    }
    for (int t = 0; t < T; ++t) {
        float xt = x[(i64)t * C + c], acc = 0.0f;
#pragma unroll
        for (int i = 0; i < DN_MAX_WIDTH; ++i) {
            if (i < W - 1) acc += taps[i] * hist[i];
        }
        acc += taps[W - 1] * xt;
#pragma unroll
        for (int i = 0; i + 1 < DN_MAX_WIDTH; ++i) {
            if (i < W - 2) hist[i] = hist[i + 1];
        }
        if (W > 1) hist[W - 2] = xt;
        out[(i64)t * C + c] = acc / (1.0f + expf(-acc));
    }
#pragma unroll
    for (int i = 0; i < DN_MAX_WIDTH; ++i) {
        if (i < W - 1) state[(i64)i * C + c] = hist[i];
    }
}

// g [n] = ssm_a[h] * softplus(a + dt_bias[h]) (the log decay), beta [n] = sigmoid(b), over a, b [T, Hv] (n = T Hv).
extern "C" __global__ void delta_gates(const float* a, const float* b, const float* ssm_a, const float* dt_bias,
                                       float* g, float* beta, i64 n, int Hv) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int h = (int)(i % Hv);
    float z = a[i] + dt_bias[h];
    g[i] = ssm_a[h] * (z > 20.0f ? z : log1pf(expf(z)));
    beta[i] = 1.0f / (1.0f + expf(-b[i]));
}

// The gated delta rule over T tokens: q, k [T, Hk, Dk] (L2-normed here, q also by Dk^-0.5), v [T, Hv, Dv],
// g, beta [T, Hv], state [Hv, Dk, Dv] float32 (updated) -> out [T, Hv, Dv]. Per token and head:
// S *= exp(g); S += k (beta (v - S^T k))^T; out = S^T q. A block takes DN_COLS columns of one head's state, a
// thread one column (Dk <= DN_MAX_DK values in registers); the tokens run in order.
// grid (Hv, ceil(Dv / DN_COLS)), block DN_COLS; shared: 2 Dk + blockDim floats.
extern "C" __global__ void delta_rule(const float* q, const float* k, const float* v, const float* g,
                                      const float* beta, float* state, float* out, int T, int Hk, int Hv, int Dk,
                                      int Dv, int tiled) {
    extern __shared__ float sh[];
    float *qn = sh, *kn = sh + Dk, *red = sh + 2 * Dk;
    int h = blockIdx.x, kh = tiled ? h % Hk : h / (Hv / Hk), j = blockIdx.y * DN_COLS + threadIdx.x;
    bool live = j < Dv;
    float* sh_state = state + (i64)h * Dk * Dv;
    float s[DN_MAX_DK];
#pragma unroll
    for (int i = 0; i < DN_MAX_DK; ++i) s[i] = live && i < Dk ? sh_state[(i64)i * Dv + j] : 0.0f;
    float q_scale = rsqrtf((float)Dk);
    for (int t = 0; t < T; ++t) {
        const float* qt = q + ((i64)t * Hk + kh) * Dk;
        const float* kt = k + ((i64)t * Hk + kh) * Dk;
        float qq = 0.0f, kk = 0.0f;
        for (int i = threadIdx.x; i < Dk; i += blockDim.x) {
            qn[i] = qt[i];
            kn[i] = kt[i];
            qq += qt[i] * qt[i];
            kk += kt[i] * kt[i];
        }
        float q_inv = q_scale * rsqrtf(block_sum(qq, red) + 1e-6f), k_inv = rsqrtf(block_sum(kk, red) + 1e-6f);
        float decay = expf(g[(i64)t * Hv + h]), b = beta[(i64)t * Hv + h];
        float kv_mem = 0.0f;
#pragma unroll
        for (int i = 0; i < DN_MAX_DK; ++i) {
            if (i < Dk) {
                s[i] *= decay;
                kv_mem += s[i] * kn[i];
            }
        }
        float delta = live ? (v[((i64)t * Hv + h) * Dv + j] - kv_mem * k_inv) * b * k_inv : 0.0f;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DN_MAX_DK; ++i) {
            if (i < Dk) {
                s[i] += kn[i] * delta;
                o += s[i] * qn[i];
            }
        }
        if (live) out[((i64)t * Hv + h) * Dv + j] = o * q_inv;
        __syncthreads();  // qn, kn are rewritten by the next token
    }
#pragma unroll
    for (int i = 0; i < DN_MAX_DK; ++i) {
        if (live && i < Dk) sh_state[(i64)i * Dv + j] = s[i];
    }
}

// Per row of D: out = w * x / rms(x) * silu(z); x, z, out [rows, D]; out may be x. grid (rows); shared: blockDim floats.
extern "C" __global__ void rmsnorm_gated(const float* x, const float* z, const float* w, float* out, int D,
                                         float eps) {
    extern __shared__ float red[];
    const float* xr = x + (i64)blockIdx.x * D;
    const float* zr = z + (i64)blockIdx.x * D;
    float* orow = out + (i64)blockIdx.x * D;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) sum_sq += xr[i] * xr[i];
    float inv_rms = (float)(1.0 / sqrt((double)block_sum(sum_sq, red) / D + (double)eps));
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float gate = zr[i];
        orow[i] = w[i] * (xr[i] * inv_rms) * (gate / (1.0f + expf(-gate)));
    }
}

// x [n] *= sigmoid(gate [n]): gated attention's output gate, the shared expert's gate (gate [T] with per_row).
extern "C" __global__ void sigmoid_mul(float* x, const float* gate, i64 n, int per_row) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = gate[per_row > 0 ? i / per_row : i];
    x[i] *= 1.0f / (1.0f + expf(-gv));
}
