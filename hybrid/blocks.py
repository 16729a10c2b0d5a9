"""The attention block, written once for every family (variants come from its AttentionSpec).

Shape legend: T tokens in the batch, H hidden, Hq / Hkv query / kv heads, D head dim.
"""
import numpy as np


def separate_projections(backend, layer, h):
    """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], None): a backend's project_qkv as three matmuls."""
    num_tokens, hq, hkv, d = h.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = backend.linear(layer.attn_q, h).reshape(num_tokens, hq, d)
    k = backend.linear(layer.attn_k, h).reshape(num_tokens, hkv, d)
    v = backend.linear(layer.attn_v, h).reshape(num_tokens, hkv, d)
    return q, k, v, None


def attention_inputs(backend, spec, layer, h, positions):
    """h [T, H] (normed hidden) -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]): projected, head-normed, roped."""
    q, k, v, qk = backend.project_qkv(layer, h)  # qk: q and k as one view, or None
    if spec.qk_norm:
        backend.rmsnorm_heads(q, layer.attn_q_norm, layer.eps)
        backend.rmsnorm_heads(k, layer.attn_k_norm, layer.eps)
    for x in (q, k) if qk is None else (qk,):
        backend.rope(x, positions, layer.rope_theta)
    return q, k, v


def attend(backend, layer, q, k, v, batch, out):
    """Appends k, v to each chunk's cache and writes q's attention over it into out [T, Hq, D]."""
    scale = 1.0 / np.sqrt(layer.head_dim)
    for chunk, (lo, hi) in zip(batch.chunks, batch.row_ranges):
        chunk.kv.write(layer.index, chunk.start, k[lo:hi], v[lo:hi])
        backend.attention(q[lo:hi], chunk.kv, layer.index, chunk.start, scale, out[lo:hi])


def attention_block(backend, spec, layer, h, batch):
    """h [T, H] (normed hidden) -> attention output [T, H]; appends this step's K/V to each chunk's cache."""
    q, k, v = attention_inputs(backend, spec, layer, h, batch.positions)
    out = np.empty_like(q)  # [T, Hq, D]
    attend(backend, layer, q, k, v, batch, out)
    return backend.linear(layer.attn_output, out.reshape(h.shape[0], -1))  # [T, H]
