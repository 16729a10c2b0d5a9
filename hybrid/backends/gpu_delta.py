"""The GPU backend's linear-attention ops (a mixin of GpuBackend): Gated DeltaNet through gpu_kernels' delta_net
module (gpu_kernels/delta_launch.py), the sigmoid gates and the splits hybrid/linear_attention.py needs, on the
backend's device arrays. The delta rule runs token by token (a thread per state column, the tokens in order) for
decode steps and short chunks, and in its chunked form (gpu_kernels/src/delta_net.cu: each 64-token chunk's
triangular system solved in parallel over chunks and heads, then one pass over the chunks for the state) from
CHUNKED_MIN_TOKENS tokens on, where that is set: on an H100 at Qwen3-Next-80B's shapes the chunked form took 1.25-1.96x
the token-by-token time for every chunk from 16 to 2,048 tokens (bench/results/qwen3next.md), so it is off.

Shape legend: T tokens, C conv channels, W conv width, Hk / Hv key / value heads, Dk / Dv their head dims,
G groups, L chunk tokens, NC chunks.
"""
import numpy as np

from gpu_kernels.delta_launch import DN_CHUNK

from ..weight_formats import dequantize

CHUNKED_MIN_TOKENS = None  # a chunk of this many tokens or more takes the chunked form (None: none does)


class GpuDeltaOps:
    """Linear-attention ops over the runtime's device arrays (uses GpuBackend's rt, kernels, _weight)."""

    _float_weights = None  # id(tensor): (tensor, device float32 copy)

    def state_zeros(self, shape):
        """A zeroed float32 recurrent-state array in VRAM (hybrid/recurrent_state.py)."""
        return self.rt.zeros(shape, np.float32)

    def state_to_host(self, x):
        """A host copy of a state array (waits for the queued work)."""
        return self.rt.to_host(x)

    def state_from_host(self, dst, host):
        """dst (a state array in VRAM) = host."""
        self.rt.copy_from_host(dst, np.ascontiguousarray(host))

    def float_weight(self, tensor):
        """A small weight (the conv's [C, W]) as float32 on the device, dequantized and uploaded once."""
        if self._float_weights is None:
            self._float_weights = {}
        found = self._float_weights.get(id(tensor))
        if found is None or found[0] is not tensor:
            host = np.ascontiguousarray(dequantize(tensor), np.float32)
            found = self._float_weights[id(tensor)] = (tensor, self.rt.to_device(host))
        return found[1]

    def split_pairs(self, x, groups, width):
        """x [T, G * 2 * width] (per group: a run of width values, then another) -> the two runs, [T, G, width] each."""
        pairs = x.reshape(x.shape[0], groups, 2, width)
        xp = self.rt.xp
        return xp.ascontiguousarray(pairs[:, :, 0]), xp.ascontiguousarray(pairs[:, :, 1])

    def delta_gates(self, a, b, ssm_a, dt_bias):
        """(g, beta) [T, Hv]: the log decay ssm_a * softplus(a + dt_bias) and sigmoid(b)."""
        g, beta = self.rt.empty(a.shape, np.float32), self.rt.empty(a.shape, np.float32)
        self.kernels.delta_gates(a, b, self._weight(ssm_a), self._weight(dt_bias), g, beta)
        return g, beta

    def delta_conv1d(self, x, weight, state, out):
        """out [T, C] = silu(causal conv of x [T, C]); state [W-1, C] advanced."""
        self.kernels.delta_conv1d_silu(x, weight, state, out)

    def delta_rule(self, mixed, g, beta, state, out, part):
        """The delta rule over the conv's output mixed [T, C] (q, k, v: the first Hk Dk, the next, the rest) -> out
        [T, Hv, Dv]; state [Hv, Dk, Dv] advanced."""
        num_tokens, qk, xp = len(mixed), part.num_k_heads * part.key_dim, self.rt.xp
        q, k, v = (xp.ascontiguousarray(mixed[:, lo:hi]) for lo, hi in ((0, qk), (qk, 2 * qk), (2 * qk, None)))
        q, k = (x.reshape(num_tokens, part.num_k_heads, part.key_dim) for x in (q, k))
        v = v.reshape(num_tokens, part.num_v_heads, part.value_dim)
        if CHUNKED_MIN_TOKENS is None or num_tokens < CHUNKED_MIN_TOKENS:
            self.kernels.delta_rule(q, k, v, g, beta, state, out, part.tiled)
        else:
            self._delta_rule_chunked(q, k, v, g, beta, state, out, part.tiled)

    def _delta_rule_chunked(self, q, k, v, g, beta, state, out, tiled):
        """The delta rule by chunks: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] (advanced)
        -> out [T, Hv, Dv]; the stages' work arrays live for this call."""
        rt, kernels = self.rt, self.kernels
        num_tokens, num_v_heads, dv = v.shape
        dk = q.shape[2]
        qn, kn = rt.empty(q.shape, np.float32), rt.empty(k.shape, np.float32)
        kernels.delta_l2norm(q, qn, dk ** -0.5)
        kernels.delta_l2norm(k, kn, 1.0)
        cum, attn = rt.empty(g.shape, np.float32), rt.empty((num_v_heads, num_tokens, DN_CHUNK), np.float32)
        u, w = rt.empty(v.shape, np.float32), rt.empty((num_tokens, num_v_heads, dk), np.float32)
        kernels.delta_chunk_prep(qn, kn, v, g, beta, cum, attn, u, w, tiled)
        sc = rt.empty((-(-num_tokens // DN_CHUNK), num_v_heads, dk, dv), np.float32)  # [NC, Hv, Dk, Dv]
        kernels.delta_chunk_state(kn, cum, w, u, state, sc, tiled)  # u becomes the new values
        kernels.delta_chunk_out(qn, cum, attn, u, sc, out, tiled)

    def rmsnorm_gated(self, x, z, weight, eps):
        """weight * x / rms(x) * silu(z) per head: x, z [T, Hv, Dv] -> a new [T, Hv, Dv]."""
        out = self.rt.empty(x.shape, np.float32)
        self.kernels.rmsnorm_gated(x, self.rt.xp.ascontiguousarray(z), self._weight(weight), eps, out)
        return out

    def sigmoid_mul(self, x, gate):
        """x *= sigmoid(gate) in place: gate of x's shape, or [T, 1] per row of x [T, n]."""
        self.kernels.sigmoid_mul(x, gate)
