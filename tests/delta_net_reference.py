"""NumPy references of Gated DeltaNet's ops (Qwen3-Next's linear attention), float64 inside, as transformers'
modeling_qwen3_next computes them (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule,
causal_conv1d_update / causal_conv1d_fn with silu, Qwen3NextRMSNormGated). The tests hold the CPU kernels
(cpu_kernels/delta_net.py) and the GPU stand-in to these, and these to the torch functions.

Shape legend: T tokens, C conv channels, W conv width, Hk key heads, Hv value heads, Dk / Dv key / value head dim.
"""
import numpy as np


def silu(x):
    return x / (1.0 + np.exp(-x))


def softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def conv1d(x, weight, state):
    """Causal depthwise conv + silu: x [T, C], weight [C, W], state [W-1, C] (the inputs before x) ->
    (out [T, C], new state [W-1, C])."""
    width = weight.shape[1]
    full = np.concatenate([state, x]).astype(np.float64)  # [W-1+T, C]
    out = np.stack([(full[t:t + width] * weight.T).sum(axis=0) for t in range(len(x))])
    return silu(out), full[len(full) - (width - 1):]


def gates(a, b, ssm_a, dt_bias):
    """a, b [T, Hv], ssm_a [Hv] (-exp(A_log)), dt_bias [Hv] -> (g [T, Hv] log decay, beta [T, Hv])."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return ssm_a * softplus(a + dt_bias), 1.0 / (1.0 + np.exp(-b))


def _prepare(q, k, g, beta, num_v_heads, tiled=False):
    """q, k L2-normed (q also by Dk^-0.5) and repeated to Hv heads (each key head's value heads together, or
    `tiled`: key head h % Hk serves value head h), float64 [T, Hv, Dk]."""
    rep = num_v_heads // q.shape[1]
    if tiled:
        q, k = (np.tile(x.astype(np.float64), (1, rep, 1)) for x in (q, k))
    else:
        q, k = (np.repeat(x.astype(np.float64), rep, axis=1) for x in (q, k))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return q, k, g.astype(np.float64), beta.astype(np.float64)


def delta_rule_recurrent(q, k, v, g, beta, state, tiled=False):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] -> (out [T, Hv, Dv], new state)."""
    q, k, g, beta = _prepare(q, k, g, beta, v.shape[1], tiled)
    s = state.astype(np.float64).copy()
    out = np.empty(v.shape, np.float64)
    for t in range(len(v)):
        s *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hij,hi->hj", s, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s += k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hij,hi->hj", s, q[t])
    return out, s


def delta_rule_chunked(q, k, v, g, beta, state, chunk=64):
    """The same by chunks (transformers' torch_chunk_gated_delta_rule's algebra, the last chunk not padded)."""
    q, k, g, beta = _prepare(q, k, g, beta, v.shape[1])
    v = v.astype(np.float64)
    s = state.astype(np.float64).copy()  # [Hv, Dk, Dv]
    out = np.empty(v.shape, np.float64)
    for lo in range(0, len(v), chunk):
        sl = slice(lo, min(lo + chunk, len(v)))
        qc, kc, vc = (x[sl].transpose(1, 0, 2) for x in (q, k, v))  # [Hv, L, D]
        cum = np.cumsum(g[sl].T, axis=1)  # [Hv, L]
        n = cum.shape[1]
        lower = np.tril(np.ones((n, n), bool))
        decay = np.where(lower, np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)  # [Hv, L, L]
        b = beta[sl].T[:, :, None]  # [Hv, L, 1]
        system = np.tril((kc * b) @ kc.transpose(0, 2, 1) * decay, -1) + np.eye(n)
        u = np.linalg.solve(system, vc * b)  # [Hv, L, Dv]
        w = np.linalg.solve(system, kc * b * np.exp(cum)[:, :, None])  # [Hv, L, Dk]
        v_new = u - w @ s
        attn = (qc @ kc.transpose(0, 2, 1)) * decay
        out[sl] = ((qc * np.exp(cum)[:, :, None]) @ s + attn @ v_new).transpose(1, 0, 2)
        last = cum[:, -1:]
        s = s * np.exp(last)[:, :, None] + (kc * np.exp(last - cum)[:, :, None]).transpose(0, 2, 1) @ v_new
    return out, s


def rmsnorm_gated(x, z, weight, eps):
    """x, z [T, Hv, Dv], weight [Dv] -> weight * x / rms(x) * silu(z) per head."""
    x, z = x.astype(np.float64), z.astype(np.float64)
    return weight * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * silu(z)


def key_heads(num_k_heads, num_v_heads, tiled=False):
    """[Hv]: the key head each value head reads."""
    h = np.arange(num_v_heads)
    return h % num_k_heads if tiled else h // (num_v_heads // num_k_heads)


def l2_normed(x, scale=1.0):
    """x [..., D] * scale / sqrt(sum(x^2) + 1e-6) per row (the GPU's delta_l2norm)."""
    x = x.astype(np.float64)
    return x * scale / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def chunk_prep(qn, kn, v, g, beta, tiled=False, chunk=64):
    """The GPU chunked form's first stage (delta_chunk_prep), per value head and chunk: qn, kn [T, Hk, Dk] normed,
    v [T, Hv, Dv], g, beta [T, Hv] -> cum [T, Hv] (g summed from the chunk's start), attn [Hv, T, chunk] (the
    decayed qn kn^T over the chunk's tokens, 0 past the diagonal), u [T, Hv, Dv], w [T, Hv, Dk] (the chunk's
    triangular system solved for beta v and beta exp(cum) kn)."""
    num_tokens, num_v_heads = g.shape
    heads = key_heads(qn.shape[1], num_v_heads, tiled)
    q, k = qn[:, heads].astype(np.float64), kn[:, heads].astype(np.float64)  # [T, Hv, Dk]
    cum, attn = np.empty(g.shape), np.zeros((num_v_heads, num_tokens, chunk))
    u, w = np.empty(v.shape), np.empty(k.shape)
    for lo in range(0, num_tokens, chunk):
        sl = slice(lo, min(lo + chunk, num_tokens))
        c = cum[sl] = np.cumsum(g[sl].astype(np.float64), axis=0)  # [L, Hv]
        n = c.shape[0]
        lower = np.tril(np.ones((n, n), bool))
        decay = np.where(lower, np.exp(np.where(lower, c.T[:, :, None] - c.T[:, None, :], 0.0)), 0.0)  # [Hv, L, L]
        qc, kc = q[sl].transpose(1, 0, 2), k[sl].transpose(1, 0, 2)  # [Hv, L, Dk]
        attn[:, sl, :n] = qc @ kc.transpose(0, 2, 1) * decay
        b = beta[sl].T.astype(np.float64)[:, :, None]  # [Hv, L, 1]
        system = np.tril(b * (kc @ kc.transpose(0, 2, 1)) * decay, -1) + np.eye(n)
        u[sl] = np.linalg.solve(system, b * v[sl].transpose(1, 0, 2)).transpose(1, 0, 2)
        w[sl] = np.linalg.solve(system, b * np.exp(c.T)[:, :, None] * kc).transpose(1, 0, 2)
    return cum, attn, u, w


def chunk_state(kn, cum, u, w, state, tiled=False, chunk=64):
    """The second stage (delta_chunk_state), chunks in order: -> v_new [T, Hv, Dv] (u - w S), sc [NC, Hv, Dk, Dv]
    (the state at each chunk's start), the state after the last chunk."""
    num_tokens, num_v_heads = cum.shape
    k = kn[:, key_heads(kn.shape[1], num_v_heads, tiled)].astype(np.float64)  # [T, Hv, Dk]
    s = state.astype(np.float64).copy()
    v_new, starts = np.empty(u.shape), []
    for lo in range(0, num_tokens, chunk):
        sl = slice(lo, min(lo + chunk, num_tokens))
        starts.append(s.copy())
        v_new[sl] = u[sl] - np.einsum("thd,hdj->thj", w[sl], s)
        last = cum[sl][-1]  # [Hv]
        s = s * np.exp(last)[:, None, None] + np.einsum("thd,th,thj->hdj", k[sl], np.exp(last - cum[sl]), v_new[sl])
    return v_new, np.stack(starts), s


def chunk_out(qn, cum, attn, v_new, sc, tiled=False, chunk=64):
    """The third stage (delta_chunk_out): out [T, Hv, Dv] = exp(cum) qn S_chunk + attn v_new, per chunk."""
    num_tokens, num_v_heads = cum.shape
    q = qn[:, key_heads(qn.shape[1], num_v_heads, tiled)].astype(np.float64)
    out = np.empty(v_new.shape)
    for c, lo in enumerate(range(0, num_tokens, chunk)):
        sl = slice(lo, min(lo + chunk, num_tokens))
        n = sl.stop - lo
        out[sl] = (np.exp(cum[sl])[:, :, None] * np.einsum("thd,hdj->thj", q[sl], sc[c])
                   + np.einsum("htm,mhj->thj", attn[:, sl, :n], v_new[sl]))
    return out
