"""Qwen3-Next's mixers as backend ops: Gated DeltaNet linear attention over each sequence's recurrent state
(hybrid/recurrent_state.py) and the gated full attention's projections. hybrid/blocks.py makes their steps.

Linear attention, per token (as transformers' Qwen3NextGatedDeltaNet):
  qkv = causal_conv(h @ ssm_qkv.T) then silu (the conv reads the sequence's last W-1 inputs: its conv state)
  g = ssm_a * softplus(alpha + dt_bias), beta = sigmoid(beta_in)   (alpha, beta_in: projections of h)
  o = delta rule over the sequence's delta state (q, k L2-normed)
  y = ssm_out(rmsnorm(o) * ssm_norm * silu(h @ ssm_z.T))
Shape legend: T tokens, H hidden, C conv channels, Hk / Hv key / value heads, Dk / Dv their head dims,
Hq query heads, D head dim, R rotated dims.

The projections before the gated norm (qkv, z, beta and alpha) take float32-accurate activations (`exact`) whatever
act_quant says: a head whose delta-rule output is far smaller than its inputs (its rms below the gated norm's
sqrt(eps)) carries the rounding of its inputs into the normed output almost undamped (int16 x moved a token's logits
by up to 6e-3 of their range on the tiny test models, 3e-2 after a 600-token prompt; exact: 4e-4). The output
projection, after the norm, rounds as act_quant says (its rounding is not amplified: 7e-4 at 600 tokens). On the
CPU, decode-sized exact calls take x as int16 hi + lo (cpu_kernels/exact_dot.py: ~1.25x the int16 dots' time, float
x ~2x); prompts multiply float x, ~1.6x the int16 prefill (Q4_K, one thread; bench/results/qwen3next.md)."""


def beta_alpha(be, part, layer, h):
    """(beta_in, alpha) [T, Hv]: from qwen3next's joint projection (per key head: its value heads' beta inputs,
    then their alphas) or from two."""
    if not part.joint_ba:
        return be.linear(layer.ssm_beta, h, exact=True), be.linear(layer.ssm_alpha, h, exact=True)
    ba = be.linear(layer.ssm_ba, h, exact=True)  # [T, 2 Hv]
    b, a = be.split_pairs(ba, part.num_k_heads, part.num_v_heads // part.num_k_heads)  # [T, Hk, Hv / Hk] x2
    return b.reshape(h.shape[0], -1), a.reshape(h.shape[0], -1)


def linear_attention(be, part, layer, s):
    """h [T, H] -> s["y"] [T, H]; each chunk reads and advances its sequence's state of this layer."""
    h, batch = s["h"], s["batch"]
    num_tokens = h.shape[0]
    hv, dv = part.num_v_heads, part.value_dim
    qkv = be.linear(layer.ssm_qkv, h, exact=True)  # [T, C]
    z = be.linear(layer.ssm_z, h, exact=True)  # [T, Hv Dv]
    b, a = beta_alpha(be, part, layer, h)
    g, beta = be.delta_gates(a, b, layer.ssm_a, layer.ssm_dt_bias)  # [T, Hv] x2
    conv_weight = be.float_weight(layer.ssm_conv1d)  # [C, W]
    mixed, out = be.empty(qkv.shape), be.empty((num_tokens, hv, dv))
    for chunk, (lo, hi) in zip(batch.chunks, batch.row_ranges):
        state = chunk.kv.recurrent
        state.begin_chunk(layer.index, chunk.start, hi - lo)
        for first, last in state.spans(chunk.start, hi - lo):  # cut at the state's checkpoint positions
            rows = slice(lo + first, lo + last)
            be.delta_conv1d(qkv[rows], conv_weight, state.conv(layer.index), mixed[rows])
            be.delta_rule(mixed[rows], g[rows], beta[rows], state.delta(layer.index), out[rows], part)
            state.reached(layer.index, chunk.start + last)
    y = be.rmsnorm_gated(out, z.reshape(num_tokens, hv, dv), layer.ssm_norm, layer.eps)  # [T, Hv, Dv]
    s["y"] = be.linear(layer.ssm_out, y.reshape(num_tokens, hv * dv))


def gated_attention_inputs(be, layer, h, positions):
    """h [T, H] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], gate [T, Hq, D]): q and its gate from the doubled
    q projection, q and k head-normed and roped over their first R dims."""
    num_tokens, d = h.shape[0], layer.head_dim
    q, gate = be.split_pairs(be.linear(layer.attn_q, h), layer.num_heads, d)  # [T, Hq, D] x2
    k = be.linear(layer.attn_k, h).reshape(num_tokens, layer.num_kv_heads, d)
    v = be.linear(layer.attn_v, h).reshape(num_tokens, layer.num_kv_heads, d)
    be.rmsnorm_heads(q, layer.attn_q_norm, layer.eps)
    be.rmsnorm_heads(k, layer.attn_k_norm, layer.eps)
    for x in (q, k):
        be.rope(x, positions, layer.rope_freqs, layer.rope_scale)  # the first 2 * len(rope_freqs) dims
    return q, k, v, gate
