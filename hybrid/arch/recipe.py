"""The layer recipe: what one decoder layer is made of, as data a family picks and every runner reads.

A layer is a sequence of residual blocks: x += part(rmsnorm(x, norm weight)). A block's part is one of
the part types below; a family builds its `LayerRecipe` from them (hybrid/arch/qwen3moe.py), per layer
where its layers differ (ArchSpec.layer_recipe: leading dense layers, sliding / full attention), and says
nothing else about how a layer runs. Each runner (hybrid/runners.py, hybrid/backends/cpu_layer.py, the GPU
graphs) implements part types, not families: a new variant is a new part type (or a field with a default
that keeps the old behaviour) here plus one implementation per backend; a runner that has none for a
recipe's part is not used for that model.
"""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FullAttention:
    """Causal attention over every earlier position: GQA, per-head q/k RMSNorm (qk_norm), biases on the q, k
    and v projections (qkv_bias), RoPE (rope: "neox" rotates the two halves of the rotated dims: the first
    config.rotary_dim of each head, the rest pass through; "yarn": the same with YaRN-scaled frequencies and
    cos/sin scaled, hybrid/rope_freqs.py). gpt-oss: `window` > 0 attends only the last `window` positions (a
    sliding-window layer), `sinks` adds each head's learned logit (LayerWeights.attn_sinks) to the softmax's
    denominator, `o_bias` a bias on the output projection."""

    qk_norm: bool = False
    rope: str = "neox"
    qkv_bias: bool = False
    window: int = 0
    sinks: bool = False
    o_bias: bool = False


@dataclass(frozen=True)
class SoftmaxTopK:
    """Router: softmax over every expert's logit, the top k kept (renormalized where the model's
    norm_topk_prob says)."""


@dataclass(frozen=True)
class SigmoidTopK:
    """Router (DeepSeek-V3 / GLM-4.5): scores sigmoid(logits); the choice adds the layer's router_choice_bias
    [E] to them, keeps the topk_groups best of num_groups expert groups (a group's worth: its two best) and
    the top k there; the weights are the chosen experts' unbiased scores, renormalized where norm_topk_prob
    says, times `scale` (routed_scaling_factor)."""

    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0


@dataclass(frozen=True)
class TopKSoftmax:
    """Router (gpt-oss): logits plus the layer's router_bias [E], the top k of them, the softmax over those k."""


@dataclass(frozen=True)
class ClampedSwiGLU:
    """Experts (gpt-oss): with per-expert biases on gate, up and down (LayerWeights gate_exps_bias, up_exps_bias,
    down_exps_bias), g = min(gate, limit), u = clip(up, -limit, limit), down((u + 1) * g * sigmoid(alpha * g))."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class SwiGLU:
    """Experts: down(silu(gate(x)) * up(x)) for each routed (token, expert) pair, weighted per token."""


@dataclass(frozen=True)
class SharedExpert:
    """A dense SwiGLU expert run for every token beside the routed ones (LayerWeights gate_shexp, up_shexp,
    down_shexp), added to their mixture; `gated` (Qwen3-Next): scaled per token by sigmoid(h @ shexp_gate.T)."""

    gated: bool = False


@dataclass(frozen=True)
class GatedAttention:
    """Qwen3-Next's full attention: FullAttention with per-head q/k RMSNorm and partial NeoX RoPE, its q projection
    giving each head's query and then its output gate (attn_q [2 Hq D, H]); the attention's output times
    sigmoid(gate) before the output projection (hybrid/linear_attention.py)."""


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): a causal depthwise conv of width `conv_width` over q, k, v, then the
    gated delta rule over a fixed-size state per value head, a gated RMSNorm and the output projection
    (hybrid/linear_attention.py). Heads: num_k_heads of key_dim for q and k, num_v_heads of value_dim for v;
    `tiled`: value head h reads key head h % num_k_heads (llama.cpp's qwen35moe order), else h // (Hv / Hk);
    `joint_ba`: beta's and the decay's inputs come from one projection (qwen3next's ssm_ba), else two."""

    num_k_heads: int
    num_v_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    tiled: bool = False
    joint_ba: bool = True

    @property
    def conv_channels(self):
        return 2 * self.num_k_heads * self.key_dim + self.num_v_heads * self.value_dim


@dataclass(frozen=True)
class MoE:
    """A routed mixture of experts, with a shared expert where `shared` is one."""

    router: object = SoftmaxTopK()
    experts: SwiGLU = SwiGLU()
    shared: Optional[SharedExpert] = None


@dataclass(frozen=True)
class DenseFFN:
    """A dense SwiGLU feed-forward (LayerWeights ffn_gate, ffn_up, ffn_down): a MoE model's leading dense layers."""


@dataclass(frozen=True)
class Block:
    """x += part(rmsnorm(x, the layer's `norm` weight)): `norm` names a LayerWeights field."""

    norm: str
    part: object


@dataclass(frozen=True)
class LayerRecipe:
    """A decoder layer: its mixer block (attention), then its feed-forward block."""

    mixer: Block
    ffn: Block

    @property
    def blocks(self):
        return (self.mixer, self.ffn)

    def parts(self):
        """Every part the layer uses, nested ones (a MoE's router, experts and shared expert) included."""
        found = []
        for block in self.blocks:
            found.append(block.part)
            if isinstance(block.part, MoE):
                found += [p for p in (block.part.router, block.part.experts, block.part.shared) if p is not None]
        return tuple(found)
