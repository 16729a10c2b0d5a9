// The short-context one-token attention, appended to kv.cu in each kv module (gpu_kernels/sources.py):
// kv.cu's definitions (kv_t, kv_widen, kv_widen4, PagedKV, PA_THREADS) are in scope.

// The short-context one-token kernel (paged_attention_1s): one query head a block, few keys (the host keeps
// split_keys <= its shared memory's), rolled loops (little code to fetch at each launch). Groups of PS_LANES lanes
// score PS_KEYS keys a pass, a key's values spread over the lanes 4 at a time; the softmax goes through shared memory;
// then each thread sums the probabilities times V of every (blockDim / columns)-th key over 4 columns (D / 4 of
// them, a power of two of lanes; value by value where D % 4 != 0), and the column groups are added in order.
#define PS_LANES 8
#define PS_SPANS 8  // float4s a lane of a key's group holds: D <= 4 * PS_LANES * PS_SPANS
#define PS_KEYS 2   // keys a lane group scores a pass (their loads in flight together)

// Where position p's K (or V) row of kv head kv.kvh lives, and (int8) its scale in *mul (else 1); tb: the table's
// entries from logical block b0 on (a copy in shared memory).
__device__ __forceinline__ const kv_t* kv_row(const PagedKV& kv, const int* tb, int b0, int p, bool value,
                                             float* mul) {
    int b = p / kv.BT, pb = tb[b - b0];
    bool pool = pb >= 0;
    i64 row = ((i64)(pool ? pb : b) * kv.BT + (p - b * kv.BT)) * kv.Hkv + kv.kvh;
#if defined(KV_INT8)
    *mul = (pool ? (value ? kv.v_scale : kv.k_scale) : (value ? kv.v_stage_scale : kv.k_stage_scale))[row];
#else
    *mul = 1.0f;
#endif
    return (pool ? (value ? kv.v_pool : kv.k_pool) : (value ? kv.v_stage : kv.k_stage)) + row * kv.D;
}

// The block's max (is_max) or sum of v, in a fixed order: shuffles in groups of 32 lanes, then every thread reads
// the groups' results from red [blockDim / 32] in order. Syncs before it returns (red may be used again).
__device__ __forceinline__ float block_reduce(float v, bool is_max, float* red) {
    for (int m = 16; m > 0; m >>= 1) {
        float o = SHFL_XOR(v, m, 32);
        v = is_max ? fmaxf(v, o) : v + o;
    }
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int g = 1; g < (int)(blockDim.x >> 5); ++g) r = is_max ? fmaxf(r, red[g]) : r + red[g];
    __syncthreads();
    return r;
}

// paged_attention_1's arguments (R and LG unused); grid (G, n * Hkv, 1) (kv.cu slot_of_block: n slots, no key
// splits), blockDim a power of two >= 32; shared: D + split_keys + blockDim / 32 + 4 * blockDim floats, then
// split_keys + 2 ints (the table entries of its keys).
extern "C" __global__ void __launch_bounds__(PA_THREADS) paged_attention_1s(PA1_ARGS) {
    int2 slot = slot_of_block(q, table, start, start_at, Hq, Hkv, D, slot_table);
    if (window > 0) key_lo = max(key_lo, start + 1 - window);
    extern __shared__ float sh[];
    float* qs = sh;                                    // [D]
    float* sc = qs + D;                                // [split_keys] scores, then probabilities
    float* red = sc + split_keys;                      // [blockDim / 32]
    float* part = red + (blockDim.x >> 5);             // [column groups][D]
    int* tb = (int*)(part + 4 * blockDim.x);           // [blocks of the keys] table entries
    PagedKV kv = {k_pool, v_pool, k_scale, v_scale, k_stage, v_stage, k_stage_scale, v_stage_scale, table,
                  BT, Hkv, D, slot.y};
    int G = Hq / Hkv, head = kv.kvh * G + blockIdx.x;
    int kb = key_lo + blockIdx.z * split_keys, ke = min(kb + split_keys, start + 1), n = max(ke - kb, 0);
    int b0 = kb / BT, nb = n > 0 ? (ke - 1) / BT - b0 + 1 : 0;
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = q[(i64)head * D + d];
    for (int i = threadIdx.x; i < nb; i += blockDim.x) tb[i] = table[b0 + i];
    __syncthreads();
    bool vec = D % 4 == 0;
    int lane = threadIdx.x & (PS_LANES - 1);
    int per_pass = blockDim.x / PS_LANES;
    for (int j0 = 0; j0 < n; j0 += PS_KEYS * per_pass) {  // a lane group PS_KEYS keys a pass; whole warps together
        float s[PS_KEYS], mul[PS_KEYS];
        float f[PS_KEYS][PS_SPANS][4];
#pragma unroll
        for (int u = 0; u < PS_KEYS; ++u) {  // every key's loads first: they are in flight together
            int j = j0 + u * per_pass + threadIdx.x / PS_LANES;
            s[u] = 0.0f;
            mul[u] = 1.0f;
            if (j < n) {
                const kv_t* kr = kv_row(kv, tb, b0, kb + j, false, &mul[u]);
                if (vec) {
#pragma unroll
                    for (int i = 0; i < PS_SPANS; ++i)
                        if (4 * (lane + PS_LANES * i) < D) kv_widen4(kr + 4 * (lane + PS_LANES * i), f[u][i]);
                } else {
                    for (int d = lane; d < D; d += PS_LANES) s[u] = fmaf(qs[d], kv_widen(kr[d]), s[u]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < PS_KEYS; ++u) {
            int j = j0 + u * per_pass + threadIdx.x / PS_LANES;
            if (vec && j < n) {
#pragma unroll
                for (int i = 0; i < PS_SPANS; ++i) {
                    int d = 4 * (lane + PS_LANES * i);
                    if (d < D)
                        s[u] = fmaf(qs[d + 3], f[u][i][3],
                                    fmaf(qs[d + 2], f[u][i][2],
                                         fmaf(qs[d + 1], f[u][i][1], fmaf(qs[d], f[u][i][0], s[u]))));
                }
            }
            for (int m = PS_LANES / 2; m > 0; m >>= 1) s[u] += SHFL_XOR(s[u], m, PS_LANES);
            if (lane == 0 && j < n) sc[j] = s[u] * mul[u] * scale;
        }
    }
    __syncthreads();
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_reduce(m, true, red);
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float p = expf(sc[j] - m);
        sc[j] = p;
        l += p;
    }
    l = block_reduce(l, false, red);  // its syncs also order sc's probabilities before the reads below
    int cols = vec ? D / 4 : D, width = 1;
    while (width < cols) width <<= 1;
    int col = threadIdx.x & (width - 1), grp = threadIdx.x / width, groups = max((int)blockDim.x / width, 1);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) {
#pragma unroll 8
        for (int j = grp; j < n; j += groups) {  // unrolled: several keys' V loads in flight
            float mul, f[4];
            const kv_t* vr = kv_row(kv, tb, b0, kb + j, true, &mul);
            float p = sc[j] * mul;
            if (vec) {
                kv_widen4(vr + 4 * col, f);
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] = fmaf(p, f[i], acc[i]);
            } else {
                acc[0] = fmaf(p, kv_widen(vr[col]), acc[0]);
            }
        }
    }
    if (col < cols && grp < groups) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (vec || i == 0) part[grp * D + (vec ? 4 * col + i : col)] = acc[i];
    }
    __syncthreads();
    i64 o = (i64)slot.x * Hq + head;  // this slot's row
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int g = 0; g < groups; ++g) a += part[g * D + d];
        out[o * D + d] = l > 0.0f ? a / l : 0.0f;
    }
    if (want_lse && threadIdx.x == 0) lse[o] = l > 0.0f ? m + logf(l) : NEG_INF;
}
