"""Python launchers of the Gated DeltaNet kernels (src/delta_net.cu), a mixin of gpu_kernels.kernels.Kernels:
device arrays in, results written into caller-owned arrays.

Shape legend: T tokens, C conv channels, W conv width, Hk key heads, Hv value heads, Dk / Dv key / value head
dim, n values, L chunk tokens (DN_CHUNK), NC chunks.
"""
import numpy as np

from .sources import DELTA_NET_KERNELS, module_source

DN_MAX_WIDTH = 8  # delta_net.cu's DN_MAX_WIDTH
DN_MAX_DK = 128  # delta_net.cu's DN_MAX_DK
DN_COLS = 32  # delta_net.cu's DN_COLS
DN_CHUNK = 64  # delta_net.cu's DN_CHUNK
PREP_THREADS = 128  # threads of a delta_chunk_prep block (its columns: Dv + Dk)
ELEMENTWISE_THREADS = 256


def check_delta_shapes(conv_width, key_head_dim):
    """ValueError where a model's conv width or key head dim is past what the kernels hold in registers."""
    if conv_width > DN_MAX_WIDTH or key_head_dim > DN_MAX_DK:
        raise ValueError(f"linear attention with conv width {conv_width} and key head dim {key_head_dim}: the GPU "
                         f"kernels take at most {DN_MAX_WIDTH} and {DN_MAX_DK}")


class DeltaNetLaunchers:
    """Kernels' launchers of the delta_net module (uses Kernels' rt, _launch, _threads)."""

    def _dn(self, name):
        return self.rt.compile("delta_net", module_source("delta_net"), DELTA_NET_KERNELS)[name]

    def _elementwise(self, name, n, args):
        threads = ELEMENTWISE_THREADS
        self._launch(self._dn(name), ((n + threads - 1) // threads,), threads, args)

    def delta_conv1d_silu(self, x, weight, state, out):
        """out [T, C] = silu(causal conv of x [T, C] with weight [C, W]); state [W-1, C] updated."""
        num_tokens, channels = x.shape
        threads = self._threads(channels, cap=128)
        self._launch(self._dn("delta_conv1d_silu"), ((channels + threads - 1) // threads,), threads,
                     (x, weight, state, out, np.int32(num_tokens), np.int32(channels), np.int32(weight.shape[1])))

    def delta_gates(self, a, b, ssm_a, dt_bias, g, beta):
        """a, b [T, Hv], ssm_a, dt_bias [Hv] -> g (log decay), beta [T, Hv]."""
        self._elementwise("delta_gates", a.size, (a, b, ssm_a, dt_bias, g, beta, np.int64(a.size),
                                                  np.int32(a.shape[1])))

    def delta_rule(self, q, k, v, g, beta, state, out, tiled=False):
        """q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv] (updated) -> out [T, Hv, Dv]."""
        num_tokens, num_k_heads, dk = q.shape
        num_v_heads, dv = v.shape[1], v.shape[2]
        self._launch(self._dn("delta_rule"), (num_v_heads, -(-dv // DN_COLS)), DN_COLS,
                     (q, k, v, g, beta, state, out, np.int32(num_tokens), np.int32(num_k_heads),
                      np.int32(num_v_heads), np.int32(dk), np.int32(dv), np.int32(bool(tiled))),
                     shared_mem=4 * (2 * dk + DN_COLS))

    def delta_l2norm(self, x, out, scale):
        """out [..., D] = x * scale / sqrt(sum(x^2) + 1e-6) per row of D."""
        dim = x.shape[-1]
        threads = self._threads(dim, cap=128)
        self._launch(self._dn("delta_l2norm"), (x.size // dim,), threads, (x, out, np.int32(dim), np.float32(scale)),
                     shared_mem=threads * 4)

    def delta_chunk_prep(self, qn, kn, v, g, beta, cum, attn, u, w, tiled=False):
        """qn, kn [T, Hk, Dk] normed, v [T, Hv, Dv], g, beta [T, Hv] -> cum [T, Hv], attn [Hv, T, L], u [T, Hv, Dv],
        w [T, Hv, Dk] (src/delta_net.cu says what they hold)."""
        num_tokens, num_k_heads, dk = qn.shape
        num_v_heads, dv = v.shape[1], v.shape[2]
        self._launch(self._dn("delta_chunk_prep"), (num_v_heads, -(-num_tokens // DN_CHUNK)), PREP_THREADS,
                     (qn, kn, v, g, beta, cum, attn, u, w, np.int32(num_tokens), np.int32(num_k_heads),
                      np.int32(num_v_heads), np.int32(dk), np.int32(dv), np.int32(bool(tiled))))

    def delta_chunk_state(self, kn, cum, w, u, state, sc, tiled=False):
        """The chunks in order: u [T, Hv, Dv] becomes the new values, sc [NC, Hv, Dk, Dv] the state at each chunk's
        start, state [Hv, Dk, Dv] the state after the last."""
        num_tokens, num_k_heads, dk = kn.shape
        num_v_heads, dv = u.shape[1], u.shape[2]
        self._launch(self._dn("delta_chunk_state"), (num_v_heads, -(-dv // DN_COLS)), DN_COLS,
                     (kn, cum, w, u, state, sc, np.int32(num_tokens), np.int32(num_k_heads), np.int32(num_v_heads),
                      np.int32(dk), np.int32(dv), np.int32(bool(tiled))))

    def delta_chunk_out(self, qn, cum, attn, v_new, sc, out, tiled=False):
        """out [T, Hv, Dv] = exp(cum) qn S_chunk + attn v_new, every chunk at once."""
        num_tokens, num_k_heads, dk = qn.shape
        num_v_heads, dv = v_new.shape[1], v_new.shape[2]
        grid = (num_v_heads, -(-num_tokens // DN_CHUNK), -(-dv // DN_COLS))
        self._launch(self._dn("delta_chunk_out"), grid, DN_COLS,
                     (qn, cum, attn, v_new, sc, out, np.int32(num_tokens), np.int32(num_k_heads),
                      np.int32(num_v_heads), np.int32(dk), np.int32(dv), np.int32(bool(tiled))))

    def rmsnorm_gated(self, x, z, weight, eps, out):
        """Per row of D: out = weight * x / rms(x) * silu(z); x, z, out [..., D]."""
        dim = x.shape[-1]
        threads = self._threads(dim)
        self._launch(self._dn("rmsnorm_gated"), (x.size // dim,), threads,
                     (x, z, weight, out, np.int32(dim), np.float32(eps)), shared_mem=threads * 4)

    def sigmoid_mul(self, x, gate):
        """x *= sigmoid(gate) in place: gate of x's shape, or gate [T] per row of x [T, n]."""
        per_row = 0 if gate.size == x.size else x.size // gate.size
        self._elementwise("sigmoid_mul", x.size, (x, gate, np.int64(x.size), np.int32(per_row)))
