"""The GPU backend's linear-attention ops (a mixin of GpuBackend): Gated DeltaNet through gpu_kernels' delta_net
module (gpu_kernels/delta_launch.py), the sigmoid gates and the splits hybrid/linear_attention.py needs, on the
backend's device arrays. The delta rule runs token by token on the device (a thread per state column) for
decode and prompt chunks alike.

Shape legend: T tokens, C conv channels, W conv width, Hk / Hv key / value heads, Dk / Dv their head dims,
G groups.
"""
import numpy as np

from ..weight_formats import dequantize


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
        self.kernels.delta_rule(q.reshape(num_tokens, part.num_k_heads, part.key_dim),
                                k.reshape(num_tokens, part.num_k_heads, part.key_dim),
                                v.reshape(num_tokens, part.num_v_heads, part.value_dim), g, beta, state, out,
                                part.tiled)

    def rmsnorm_gated(self, x, z, weight, eps):
        """weight * x / rms(x) * silu(z) per head: x, z [T, Hv, Dv] -> a new [T, Hv, Dv]."""
        out = self.rt.empty(x.shape, np.float32)
        self.kernels.rmsnorm_gated(x, self.rt.xp.ascontiguousarray(z), self._weight(weight), eps, out)
        return out

    def sigmoid_mul(self, x, gate):
        """x *= sigmoid(gate) in place: gate of x's shape, or [T, 1] per row of x [T, n]."""
        self.kernels.sigmoid_mul(x, gate)
