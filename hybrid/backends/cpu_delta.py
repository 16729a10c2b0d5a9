"""The CPU backend's linear-attention ops (a mixin of CpuBackend): Gated DeltaNet through cpu_kernels/delta_net.py,
the sigmoid gates and the splits hybrid/linear_attention.py needs. Prompt chunks and decode steps alike run the
delta rule token by token: the chunked form (cpu_kernels/delta_net.py delta_rule_chunked) does more arithmetic
without a BLAS to make it cheaper, and took 134 ms against 86 ms for a 512-token chunk of one Qwen3-Next layer on
one core (bench/results/delta_net_cpu.md).

Shape legend: T tokens, C conv channels, W conv width, Hk / Hv key / value heads, Dk / Dv their head dims,
G groups, n values.
"""
import numba
import numpy as np

from cpu_kernels import delta_net, exact_dot
from cpu_kernels.act_quant import FLOAT
from cpu_kernels.tiles import DECODE_MAX_TOKENS

from ..weight_formats import dequantize
from .cpu_thresholds import SERIAL_MAX_ELEMENTS, TINY_MAX_ELEMENTS


class CpuDeltaOps:
    """Linear-attention ops over NumPy arrays."""

    _float_weights = None  # id(tensor): (tensor, float32 copy)
    _conv_taps = None  # id(conv weight [C, W]): (that array, its transpose [W, C])

    def state_zeros(self, shape):
        """A zeroed float32 recurrent-state array (hybrid/recurrent_state.py)."""
        return np.zeros(shape, np.float32)

    def state_to_host(self, x):
        """A host copy of a state array."""
        return np.array(x)

    def state_from_host(self, dst, host):
        """dst (a state array) = host."""
        np.copyto(dst, host)

    def float_weight(self, tensor):
        """A small weight (the conv's [C, W]) as float32, dequantized once."""
        if self._float_weights is None:
            self._float_weights = {}
        found = self._float_weights.get(id(tensor))
        if found is None or found[0] is not tensor:
            found = self._float_weights[id(tensor)] = (tensor, np.ascontiguousarray(dequantize(tensor), np.float32))
        return found[1]

    def _exact_dot(self, weight, num_tokens):
        """The hi + lo int16 dot (cpu_kernels/exact_dot.py) that multiplies num_tokens tokens' x by `weight` as
        accurately as float x, or None (float x then): decode-sized calls of formats that have one, where the
        integer dots run (act_quant not float)."""
        if self.act_quant == FLOAT or num_tokens > DECODE_MAX_TOKENS or weight.raw.ndim != 2:
            return None
        return exact_dot.split_dot(weight.qtype)

    def split_pairs(self, x, groups, width):
        """x [T, G * 2 * width] (per group: a run of width values, then another) -> the two runs, [T, G, width] each."""
        pairs = x.reshape(x.shape[0], groups, 2, width)
        return np.ascontiguousarray(pairs[:, :, 0]), np.ascontiguousarray(pairs[:, :, 1])

    def delta_gates(self, a, b, ssm_a, dt_bias):
        """(g, beta) [T, Hv]: the log decay ssm_a * softplus(a + dt_bias) and sigmoid(b)."""
        g, beta = np.empty_like(a), np.empty_like(a)
        delta_net.delta_gates(a, b, ssm_a, dt_bias, g, beta)
        return g, beta

    def delta_conv1d(self, x, weight, state, out):
        """out [T, C] = silu(causal conv of x [T, C]) for weight [C, W] (float_weight's); state [W-1, C] advanced."""
        if self._conv_taps is None:
            self._conv_taps = {}
        found = self._conv_taps.get(id(weight))
        if found is None or found[0] is not weight:  # the kernel reads the taps as rows: transposed once
            found = self._conv_taps[id(weight)] = (weight, np.ascontiguousarray(weight.T))
        _serial_if_small(x.size, delta_net.conv1d_silu_serial, delta_net.conv1d_silu)(x, found[1], state, out)

    def delta_rule(self, mixed, g, beta, state, out, part):
        """The delta rule over the conv's output mixed [T, C] (q, k, v: the first Hk Dk, the next, the rest) -> out
        [T, Hv, Dv]; state [Hv, Dk, Dv] advanced."""
        num_tokens, qk = len(mixed), part.num_k_heads * part.key_dim
        q, k, v = (np.ascontiguousarray(mixed[:, lo:hi]) for lo, hi in ((0, qk), (qk, 2 * qk), (2 * qk, None)))
        heads = (num_tokens, part.num_k_heads, part.key_dim)
        rule = delta_net.delta_rule_recurrent_serial if numba.get_num_threads() == 1 else delta_net.delta_rule_recurrent
        rule(q.reshape(heads), k.reshape(heads),
                                       v.reshape(num_tokens, part.num_v_heads, part.value_dim), np.ascontiguousarray(g),
                                       np.ascontiguousarray(beta), state, out, part.tiled)

    def rmsnorm_gated(self, x, z, weight, eps):
        """weight * x / rms(x) * silu(z) per head: x, z [T, Hv, Dv] -> a new [T, Hv, Dv]."""
        out = np.empty_like(x)
        _serial_if_small(x.size, delta_net.rmsnorm_gated_serial, delta_net.rmsnorm_gated)(
            x, np.ascontiguousarray(z), weight, eps, out)
        return out

    def sigmoid_mul(self, x, gate):
        """x *= sigmoid(gate) in place: gate of x's shape, or [T, 1] per row of x [T, n]."""
        x *= 1.0 / (1.0 + np.exp(-gate))


def _serial_if_small(work, serial, parallel):
    """The serial twin for a tiny op, or a small one on one thread (cpu_thresholds.py: no parallel region for a
    decode step's conv or gated norm), else the parallel kernel."""
    small = work <= TINY_MAX_ELEMENTS or (work <= SERIAL_MAX_ELEMENTS and numba.get_num_threads() == 1)
    return serial if small else parallel
