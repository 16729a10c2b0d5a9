"""Gated DeltaNet (Qwen3-Next's linear attention) as Numba kernels, float32 state.

A linear-attention layer keeps, per sequence, the last W-1 inputs of its causal depthwise conv (the conv
state) and one [Dk, Dv] matrix per value head (the delta-rule state). Per token t and value head h, with q, k
L2-normed (q also scaled by Dk^-0.5), decay exp(g) and write strength beta:
    S *= exp(g);  S += k (beta (v - S^T k))^T;  out = S^T q
`delta_rule_recurrent` runs that token by token (one read and one write of the state a token);
`delta_rule_chunked` runs it by chunks of tokens, each chunk's updates condensed into small matrix products (the
UT transform of the DeltaNet paper, as transformers' torch_chunk_gated_delta_rule), the state read and written
once a chunk: the parallel-in-chunk form, for hardware with fast small matrix products (without a BLAS it does
more work than the loop here: the CPU backend reads prompts token by token, bench/results/delta_net_cpu.md).

Shape legend: T tokens, C conv channels (2 Hk Dk + Hv Dv), W conv width, Hk key heads, Hv value heads
(a multiple of Hk: key head h // (Hv / Hk) serves value head h, or h % Hk where `tiled`, as llama.cpp's
qwen35moe files order them), Dk / Dv key / value head dim, L chunk tokens.
"""
import numpy as np
from numba import njit, prange

from .activation import EXACT_DIVISION, silu
from .twins import serial_twin

CHUNK_TOKENS = 64  # tokens a chunk of the chunked form
L2_EPS = 1e-6  # as transformers' l2norm (and FLA's)
CONV_BLOCK = 512  # channels a parallel iteration of the conv (fewer: the per-token calls cost more than the work)
CONV_FEW_TOKENS = 8  # calls of fewer tokens (decode) take blocks this many times larger, for the same reason


@njit(fastmath=EXACT_DIVISION, nogil=True, cache=True, error_model="numpy")
def _conv4_silu(x0, x1, x2, x3, w0, w1, w2, w3, out):
    """out [n] = silu(w0 x0 + w1 x1 + w2 x2 + w3 x3), all [n] contiguous: a loop the compiler vectorizes."""
    for c in range(out.shape[0]):
        out[c] = silu(w0[c] * x0[c] + w1[c] * x1[c] + w2[c] * x2[c] + w3[c] * x3[c])


@njit(parallel=True, fastmath=EXACT_DIVISION, nogil=True, cache=True, error_model="numpy")
def conv1d_silu(x, taps, state, out):
    """Causal depthwise conv then silu: x [T, C], taps [W, C] (the conv weight [C, W] transposed: each tap a
    contiguous row), state [W-1, C] (the W-1 inputs before x, replaced by the last W-1 of state ++ x) -> out [T, C];
    out must not be x."""
    num_tokens, channels = x.shape
    width = taps.shape[0]
    size = CONV_BLOCK if num_tokens >= CONV_FEW_TOKENS else CONV_BLOCK * CONV_FEW_TOKENS  # channels a block
    for block in prange((channels + size - 1) // size):
        lo, hi = block * size, min(channels, (block + 1) * size)
        acc = np.empty(0 if width == 4 else hi - lo, np.float32)
        for t in range(num_tokens):
            if width == 4:  # Qwen3-Next's width: one vectorized pass over the inputs, from x or the state
                _conv4_silu(x[t - 3][lo:hi] if t >= 3 else state[t][lo:hi],
                            x[t - 2][lo:hi] if t >= 2 else state[t + 1][lo:hi],
                            x[t - 1][lo:hi] if t >= 1 else state[t + 2][lo:hi], x[t][lo:hi], taps[0][lo:hi],
                            taps[1][lo:hi], taps[2][lo:hi], taps[3][lo:hi], out[t][lo:hi])
                continue
            acc[:] = 0.0
            for i in range(width):
                j = t - (width - 1) + i  # input position; < 0: in the state
                row = x[j] if j >= 0 else state[width - 1 + j]
                for c in range(lo, hi):
                    acc[c - lo] += taps[i, c] * row[c]
            for c in range(hi - lo):
                out[t, lo + c] = silu(acc[c])  # [T, C]
        for i in range(width - 1):  # ascending: reads state[T + i] before it is written
            j = num_tokens - (width - 1) + i
            source = x[j] if j >= 0 else state[num_tokens + i]
            for c in range(lo, hi):
                state[i, c] = source[c]


@njit(fastmath=True, nogil=True, cache=True)
def delta_gates(a, b, ssm_a, dt_bias, g, beta):
    """a, b [T, Hv], ssm_a [Hv] (-exp(A_log), as GGUF stores it), dt_bias [Hv] -> g [T, Hv] = ssm_a *
    softplus(a + dt_bias) (the log decay), beta [T, Hv] = sigmoid(b)."""
    num_tokens, num_heads = a.shape
    for t in range(num_tokens):
        for h in range(num_heads):
            z = a[t, h] + dt_bias[h]
            softplus = z if z > 20.0 else np.log1p(np.exp(z))
            g[t, h] = ssm_a[h] * softplus
            beta[t, h] = 1.0 / (1.0 + np.exp(-b[t, h]))


@njit(fastmath=True, nogil=True, cache=True)
def _l2_normed(x, scale, out):
    """out [D] = x [D] * rsqrt(sum(x^2) + L2_EPS) * scale."""
    sum_sq = 0.0
    for i in range(x.shape[0]):
        sum_sq += np.float64(x[i]) * x[i]
    inv = np.float32(scale / np.sqrt(sum_sq + L2_EPS))
    for i in range(x.shape[0]):
        out[i] = x[i] * inv


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def delta_rule_recurrent(q, k, v, g, beta, state, out, tiled=False):
    """Token by token: q, k [T, Hk, Dk] (raw: normed here), v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv]
    float32 (updated in place) -> out [T, Hv, Dv]; one value head a parallel iteration (_delta_head)."""
    num_tokens, num_v_heads = v.shape[0], v.shape[1]
    num_k_heads = q.shape[1]
    group = num_v_heads // num_k_heads
    if num_tokens == 0:
        return
    for h in prange(num_v_heads):
        kh = h % num_k_heads if tiled else h // group
        _delta_head(q, k, v, g, beta, state[h], out, h, kh)


@njit(fastmath=True, nogil=True, cache=True)
def _delta_head(q, k, v, g, beta, s, out, h, kh):
    """Value head h (key head kh) of delta_rule_recurrent, its state s [Dk, Dv]. A token needs s^T k and s^T q of
    the state before its update (kv_mem, sq): the first token's come from one read of the state, each later
    token's from the pass that writes the token before's update, so a token costs one read and write of the state
    (it was two passes), four state rows a pass over the columns (a quarter of the accumulators' loads and stores
    of one row a pass): 512 tokens of one Qwen3-Next layer on one core 58 -> 35 ms (bench/results/qwen3next.md).
    The passes are written out here: Numba's parallel lowering of the same loops inside the prange ran 2-4x slower."""
    num_tokens, dv = v.shape[0], v.shape[2]
    dk = q.shape[2]
    top = dk - dk % 4  # rows below taken four at a time (as range(0, dk - 3, 4): range(0, top, 4) ran 4x slower)
    qn, kn = np.empty(dk, np.float32), np.empty(dk, np.float32)  # this token's, normed
    q_next, k_next = np.empty(dk, np.float32), np.empty(dk, np.float32)  # the next token's
    kv_mem, sq = np.zeros(dv, np.float32), np.zeros(dv, np.float32)  # s^T k, s^T q before this token's update
    kv_next, sq_next = np.zeros(dv, np.float32), np.zeros(dv, np.float32)
    delta = np.empty(dv, np.float32)
    _l2_normed(q[0, kh], 1.0 / np.sqrt(dk), qn)
    _l2_normed(k[0, kh], 1.0, kn)
    for i in range(0, dk - 3, 4):  # the first token's s^T k, s^T q
        k0, k1, k2, k3 = kn[i], kn[i + 1], kn[i + 2], kn[i + 3]
        q0, q1, q2, q3 = qn[i], qn[i + 1], qn[i + 2], qn[i + 3]
        for j in range(dv):
            s0, s1, s2, s3 = s[i, j], s[i + 1, j], s[i + 2, j], s[i + 3, j]
            kv_mem[j] += s0 * k0 + s1 * k1 + s2 * k2 + s3 * k3
            sq[j] += s0 * q0 + s1 * q1 + s2 * q2 + s3 * q3
    for i in range(top, dk):
        for j in range(dv):
            kv_mem[j] += s[i, j] * kn[i]
            sq[j] += s[i, j] * qn[i]
    for t in range(num_tokens):
        decay = np.float32(np.exp(g[t, h]))
        kq = np.float32(0.0)
        for i in range(dk):
            kq += kn[i] * qn[i]
        for j in range(dv):
            delta[j] = (v[t, h, j] - decay * kv_mem[j]) * beta[t, h]
            out[t, h, j] = decay * sq[j] + delta[j] * kq  # (decay s + k delta^T)^T q  [T, Hv, Dv]
        if t + 1 == num_tokens:  # the last token: the update alone
            for i in range(dk):
                for j in range(dv):
                    s[i, j] = decay * s[i, j] + kn[i] * delta[j]
            break
        _l2_normed(q[t + 1, kh], 1.0 / np.sqrt(dk), q_next)
        _l2_normed(k[t + 1, kh], 1.0, k_next)
        kv_next[:] = 0.0
        sq_next[:] = 0.0
        for i in range(0, dk - 3, 4):  # s = decay s + k delta^T, and the next token's s^T k, s^T q from it
            a0, a1, a2, a3 = kn[i], kn[i + 1], kn[i + 2], kn[i + 3]
            k0, k1, k2, k3 = k_next[i], k_next[i + 1], k_next[i + 2], k_next[i + 3]
            q0, q1, q2, q3 = q_next[i], q_next[i + 1], q_next[i + 2], q_next[i + 3]
            for j in range(dv):
                d = delta[j]
                s0 = decay * s[i, j] + a0 * d
                s1 = decay * s[i + 1, j] + a1 * d
                s2 = decay * s[i + 2, j] + a2 * d
                s3 = decay * s[i + 3, j] + a3 * d
                s[i, j], s[i + 1, j], s[i + 2, j], s[i + 3, j] = s0, s1, s2, s3
                kv_next[j] += s0 * k0 + s1 * k1 + s2 * k2 + s3 * k3
                sq_next[j] += s0 * q0 + s1 * q1 + s2 * q2 + s3 * q3
        for i in range(top, dk):
            for j in range(dv):
                s[i, j] = decay * s[i, j] + kn[i] * delta[j]
                kv_next[j] += s[i, j] * k_next[i]
                sq_next[j] += s[i, j] * q_next[i]
        kv_mem, kv_next, sq, sq_next = kv_next, kv_mem, sq_next, sq
        qn, q_next, kn, k_next = q_next, qn, k_next, kn


@njit(fastmath=True, nogil=True, cache=True)
def _chunk(qn, kn, vb, cum, beta, s, system, u, w, out):
    """One chunk of one head: qn, kn [L, Dk] normed, vb [L, Dv] = beta v, cum [L] cumulative log decay,
    beta [L], s [Dk, Dv] (updated), work system [L, L], u [L, Dv], w [L, Dk] -> out [L, Dv]."""
    n, dk = kn.shape
    dv = vb.shape[1]
    for i in range(n):  # strictly lower: beta_i (k_i . k_j) exp(cum_i - cum_j)
        for j in range(i):
            dot = np.float32(0.0)
            for d in range(dk):
                dot += kn[i, d] * kn[j, d]
            system[i, j] = beta[i] * dot * np.exp(cum[i] - cum[j])
    for i in range(n):  # (I + system)^-1 [beta v, beta exp(cum) k], by forward substitution
        u[i] = vb[i]
        scale = beta[i] * np.exp(cum[i])
        for d in range(dk):
            w[i, d] = kn[i, d] * scale
        for j in range(i):
            a = system[i, j]
            for d in range(dv):
                u[i, d] -= a * u[j, d]
            for d in range(dk):
                w[i, d] -= a * w[j, d]
    for i in range(n):  # u becomes the new values: u - w s
        for d in range(dk):
            wd = w[i, d]
            for j in range(dv):
                u[i, j] -= wd * s[d, j]
    for i in range(n):  # out_i = exp(cum_i) q_i s + sum_{j <= i} (q_i . k_j) exp(cum_i - cum_j) u_j
        out[i] = 0.0
        decay = np.exp(cum[i])
        for d in range(dk):
            qd = qn[i, d] * decay
            for j in range(dv):
                out[i, j] += qd * s[d, j]
        for j in range(i + 1):
            dot = np.float32(0.0)
            for d in range(dk):
                dot += qn[i, d] * kn[j, d]
            a = dot * np.exp(cum[i] - cum[j])
            for d in range(dv):
                out[i, d] += a * u[j, d]
    last = cum[n - 1]
    end_decay = np.exp(last)
    for d in range(dk):
        for j in range(dv):
            s[d, j] *= end_decay
    for i in range(n):  # s += sum_i exp(last - cum_i) k_i^T u_i
        for d in range(dk):
            kd = kn[i, d] * np.exp(last - cum[i])
            for j in range(dv):
                s[d, j] += kd * u[i, j]


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def delta_rule_chunked(q, k, v, g, beta, state, out, tiled=False):
    """The recurrence of delta_rule_recurrent (same arguments) by chunks of CHUNK_TOKENS tokens."""
    num_tokens, num_v_heads, dv = v.shape
    num_k_heads, dk = q.shape[1], q.shape[2]
    group = num_v_heads // num_k_heads
    chunk = CHUNK_TOKENS
    for h in prange(num_v_heads):
        kh = h % num_k_heads if tiled else h // group
        qn, kn = np.empty((chunk, dk), np.float32), np.empty((chunk, dk), np.float32)
        vb, u = np.empty((chunk, dv), np.float32), np.empty((chunk, dv), np.float32)
        o = np.empty((chunk, dv), np.float32)
        w, system = np.empty((chunk, dk), np.float32), np.empty((chunk, chunk), np.float32)
        cum, bt = np.empty(chunk, np.float32), np.empty(chunk, np.float32)
        for lo in range(0, num_tokens, chunk):
            n = min(chunk, num_tokens - lo)
            total = np.float32(0.0)
            for i in range(n):
                t = lo + i
                _l2_normed(q[t, kh], 1.0 / np.sqrt(dk), qn[i])
                _l2_normed(k[t, kh], 1.0, kn[i])
                total += g[t, h]
                cum[i], bt[i] = total, beta[t, h]
                for j in range(dv):
                    vb[i, j] = v[t, h, j] * beta[t, h]
            _chunk(qn[:n], kn[:n], vb[:n], cum[:n], bt[:n], state[h], system, u[:n], w[:n], o[:n])
            for i in range(n):
                out[lo + i, h] = o[i]  # [T, Hv, Dv]


@njit(parallel=True, fastmath=EXACT_DIVISION, nogil=True, cache=True, error_model="numpy")
def rmsnorm_gated(x, z, weight, eps, out):
    """Per head: out = weight * x / rms(x) * silu(z); x, z, out [T, Hv, Dv], weight [Dv]; out may be x."""
    num_tokens, num_heads, dv = x.shape
    for r in prange(num_tokens * num_heads):
        t, h = r // num_heads, r % num_heads
        sum_sq = 0.0
        for i in range(dv):
            sum_sq += np.float64(x[t, h, i]) * x[t, h, i]
        inv_rms = np.float32(1.0 / np.sqrt(sum_sq / dv + eps))
        for i in range(dv):
            out[t, h, i] = weight[i] * (x[t, h, i] * inv_rms) * silu(z[t, h, i])


conv1d_silu_serial = serial_twin(conv1d_silu)
delta_rule_recurrent_serial = serial_twin(delta_rule_recurrent)
rmsnorm_gated_serial = serial_twin(rmsnorm_gated)
