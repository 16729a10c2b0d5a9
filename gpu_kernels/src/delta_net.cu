// Gated DeltaNet (Qwen3-Next's linear attention) and the sigmoid output gates: causal depthwise conv + silu with
// its W-1 input state, the decay / beta gates, the gated delta rule over a float32 state (token by token for
// decode, by chunks of DN_CHUNK tokens for prompts), the gated RMSNorm. cpu_kernels/delta_net.py holds the same
// ops for the CPU (and says what they compute).
//
// The chunked form (the UT transform of the DeltaNet paper, as transformers' torch_chunk_gated_delta_rule) runs in
// four launches: delta_l2norm (q, k normed), delta_chunk_prep (per head and chunk, in parallel: the chunk's
// cumulative decay, its triangular system solved for u and w, its decayed q k^T), delta_chunk_state (per head and
// state column, the chunks in order: the new values u - w S and the state after each chunk), delta_chunk_out (per
// head, chunk and column, in parallel: out = exp(cum) q S_chunk + attn v_new). tests/delta_net_reference.py holds
// NumPy references of the four stages.
//
// Shape legend: T tokens, C conv channels, W conv width, Hk key heads, Hv value heads (value head h reads key
// head h / (Hv / Hk), or h % Hk where tiled), Dk / Dv key / value head dim, n values, L = DN_CHUNK, NC chunks.

#define DN_MAX_WIDTH 8   // conv taps held in registers
#define DN_MAX_DK 128    // key dims of a state column held in registers
#define DN_COLS 32       // state columns (value dims) a block of delta_rule
#define DN_CHUNK 64      // tokens a chunk of the chunked form

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

__device__ __forceinline__ int dn_key_head(int h, int Hk, int Hv, int tiled) {
    return tiled ? h % Hk : h / (Hv / Hk);
}

// out [rows, D] = x [rows, D] * scale / sqrt(sum(x^2) + 1e-6) per row (the delta rule's q and k). grid (rows);
// shared: blockDim floats.
extern "C" __global__ void delta_l2norm(const float* x, float* out, int D, float scale) {
    extern __shared__ float red[];
    const float* xr = x + (i64)blockIdx.x * D;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) sum_sq += xr[i] * xr[i];
    float inv = scale * rsqrtf(block_sum(sum_sq, red) + 1e-6f);
    for (int i = threadIdx.x; i < D; i += blockDim.x) out[(i64)blockIdx.x * D + i] = xr[i] * inv;
}

// Per value head h and chunk c (tokens t0 .. t0 + n - 1), from qn, kn [T, Hk, Dk] normed, v [T, Hv, Dv],
// g, beta [T, Hv]: cum [T, Hv] the decay summed from the chunk's start through t; attn [Hv, T, L]: attn[h, t, m] =
// (qn_t . kn_{t0+m}) exp(cum_t - cum_{t0+m}) for t0 + m <= t, else 0; A = the strictly lower beta_i (kn_i . kn_m)
// exp(cum_i - cum_m); u [T, Hv, Dv] = (I + A)^-1 beta v, w [T, Hv, Dk] = (I + A)^-1 beta exp(cum) kn (forward
// substitution, a thread per column). grid (Hv, NC); shared: L * L + 2 L floats.
extern "C" __global__ void delta_chunk_prep(const float* qn, const float* kn, const float* v, const float* g,
                                            const float* beta, float* cum, float* attn, float* u, float* w, int T,
                                            int Hk, int Hv, int Dk, int Dv, int tiled) {
    __shared__ float sys[DN_CHUNK * DN_CHUNK];
    __shared__ float cum_s[DN_CHUNK], beta_s[DN_CHUNK];
    int h = blockIdx.x, kh = dn_key_head(h, Hk, Hv, tiled), t0 = blockIdx.y * DN_CHUNK;
    int n = min(DN_CHUNK, T - t0);
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int i = 0; i < n; ++i) {
            total += g[(i64)(t0 + i) * Hv + h];
            cum_s[i] = total;
            beta_s[i] = beta[(i64)(t0 + i) * Hv + h];
            cum[(i64)(t0 + i) * Hv + h] = total;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n * DN_CHUNK; p += blockDim.x) {
        int i = p / DN_CHUNK, m = p % DN_CHUNK;
        float qk = 0.0f, kk = 0.0f;
        if (m <= i) {
            const float* qi = qn + ((i64)(t0 + i) * Hk + kh) * Dk;
            const float* ki = kn + ((i64)(t0 + i) * Hk + kh) * Dk;
            const float* km = kn + ((i64)(t0 + m) * Hk + kh) * Dk;
            for (int d = 0; d < Dk; ++d) {
                qk += qi[d] * km[d];
                kk += ki[d] * km[d];
            }
            float decay = expf(cum_s[i] - cum_s[m]);
            qk *= decay;
            kk *= beta_s[i] * decay;
        }
        attn[((i64)h * T + t0 + i) * DN_CHUNK + m] = qk;
        sys[i * DN_CHUNK + m] = m < i ? kk : 0.0f;
    }
    __syncthreads();
    for (int col = threadIdx.x; col < Dv + Dk; col += blockDim.x) {
        bool is_u = col < Dv;
        int d = is_u ? col : col - Dv;
        float* x = is_u ? u : w;
        int width = is_u ? Dv : Dk;
        for (int i = 0; i < n; ++i) {
            i64 t = t0 + i;
            float rhs = is_u ? beta_s[i] * v[(t * Hv + h) * Dv + d]
                             : beta_s[i] * expf(cum_s[i]) * kn[(t * Hk + kh) * Dk + d];
            for (int m = 0; m < i; ++m) rhs -= sys[i * DN_CHUNK + m] * x[((i64)(t0 + m) * Hv + h) * width + d];
            x[(t * Hv + h) * width + d] = rhs;
        }
    }
}

// Per value head h and state column j, the chunks in order: sc [NC, Hv, Dk, Dv] = the state at each chunk's start;
// u [T, Hv, Dv] becomes the new values u - w S; S = exp(cum_last) S + sum_i exp(cum_last - cum_i) kn_i u_i^T;
// state [Hv, Dk, Dv] the state after the last chunk. A thread a column, held in shared memory (as registers, with
// the loops unrolled, hipcc 15 crashed compiling it for gfx1100 now and then). grid (Hv, ceil(Dv / DN_COLS)),
// block DN_COLS.
extern "C" __global__ void delta_chunk_state(const float* kn, const float* cum, const float* w, float* u,
                                             float* state, float* sc, int T, int Hk, int Hv, int Dk, int Dv,
                                             int tiled) {
    __shared__ float columns[DN_MAX_DK * DN_COLS];
    int h = blockIdx.x, kh = dn_key_head(h, Hk, Hv, tiled), j = blockIdx.y * DN_COLS + threadIdx.x;
    if (j >= Dv) return;
    float* s = columns + threadIdx.x;  // s[d * DN_COLS]: this thread's column, S[d, j]
    float* sh_state = state + (i64)h * Dk * Dv;
    for (int d = 0; d < Dk; ++d) s[d * DN_COLS] = sh_state[(i64)d * Dv + j];
    for (int t0 = 0; t0 < T; t0 += DN_CHUNK) {
        int n = min(DN_CHUNK, T - t0);
        float* sc_c = sc + ((i64)(t0 / DN_CHUNK) * Hv + h) * Dk * Dv;
        for (int d = 0; d < Dk; ++d) sc_c[(i64)d * Dv + j] = s[d * DN_COLS];
        for (int i = 0; i < n; ++i) {
            i64 t = t0 + i;
            const float* wi = w + (t * Hv + h) * Dk;
            float ws = 0.0f;
            for (int d = 0; d < Dk; ++d) ws += wi[d] * s[d * DN_COLS];
            u[(t * Hv + h) * Dv + j] -= ws;
        }
        float last = cum[(i64)(t0 + n - 1) * Hv + h], end_decay = expf(last);
        for (int d = 0; d < Dk; ++d) s[d * DN_COLS] *= end_decay;
        for (int i = 0; i < n; ++i) {
            i64 t = t0 + i;
            float e = expf(last - cum[t * Hv + h]) * u[(t * Hv + h) * Dv + j];
            const float* ki = kn + (t * Hk + kh) * Dk;
            for (int d = 0; d < Dk; ++d) s[d * DN_COLS] += ki[d] * e;
        }
    }
    for (int d = 0; d < Dk; ++d) sh_state[(i64)d * Dv + j] = s[d * DN_COLS];
}

// Per value head h, chunk c and column j: out[t, h, j] = exp(cum_t) qn_t . sc[c, h, :, j] + sum_m attn[h, t, m]
// v_new[t0 + m, h, j] (v_new: u after delta_chunk_state). grid (Hv, NC, ceil(Dv / DN_COLS)), block DN_COLS.
extern "C" __global__ void delta_chunk_out(const float* qn, const float* cum, const float* attn, const float* v_new,
                                           const float* sc, float* out, int T, int Hk, int Hv, int Dk, int Dv,
                                           int tiled) {
    int h = blockIdx.x, kh = dn_key_head(h, Hk, Hv, tiled), t0 = blockIdx.y * DN_CHUNK;
    int j = blockIdx.z * DN_COLS + threadIdx.x;
    if (j >= Dv) return;
    int n = min(DN_CHUNK, T - t0);
    const float* sc_c = sc + ((i64)blockIdx.y * Hv + h) * Dk * Dv;
    float s[DN_MAX_DK];
#pragma unroll
    for (int d = 0; d < DN_MAX_DK; ++d) s[d] = d < Dk ? sc_c[(i64)d * Dv + j] : 0.0f;
    for (int i = 0; i < n; ++i) {
        i64 t = t0 + i;
        const float* qi = qn + (t * Hk + kh) * Dk;
        float qs = 0.0f;
#pragma unroll
        for (int d = 0; d < DN_MAX_DK; ++d) {
            if (d < Dk) qs += qi[d] * s[d];
        }
        const float* ai = attn + ((i64)h * T + t) * DN_CHUNK;
        float o = expf(cum[t * Hv + h]) * qs;
        for (int m = 0; m <= i; ++m) o += ai[m] * v_new[((i64)(t0 + m) * Hv + h) * Dv + j];
        out[(t * Hv + h) * Dv + j] = o;
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
