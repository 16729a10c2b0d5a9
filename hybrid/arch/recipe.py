"""The layer recipe: what one decoder layer is made of, as data a family picks and every runner reads.

A layer is a sequence of residual blocks: x += part(rmsnorm(x, norm weight)). A block's part is one of
the part types below; a family builds its `LayerRecipe` from them (hybrid/arch/qwen3moe.py) and says
nothing else about how a layer runs. Each runner (hybrid/runners.py, hybrid/backends/cpu_layer.py,
the GPU graphs) implements part types, not families: a new variant is a new part type here plus one
implementation per backend; a runner that has none for a recipe's part is not used for that model.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttention:
    """Causal attention over every earlier position: GQA, per-head q/k RMSNorm (qk_norm), RoPE (rope:
    "neox" rotates the two halves of the head dim)."""

    qk_norm: bool = False
    rope: str = "neox"


@dataclass(frozen=True)
class SoftmaxTopK:
    """Router: softmax over every expert's logit, the top k kept (renormalized where the model's
    norm_topk_prob says)."""


@dataclass(frozen=True)
class SwiGLU:
    """Experts: down(silu(gate(x)) * up(x)) for each routed (token, expert) pair, weighted per token."""


@dataclass(frozen=True)
class MoE:
    """A routed mixture of experts."""

    router: SoftmaxTopK = SoftmaxTopK()
    experts: SwiGLU = SwiGLU()


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
        """Every part the layer uses, nested ones (a MoE's router and experts) included."""
        found = []
        for block in self.blocks:
            found.append(block.part)
            if isinstance(block.part, MoE):
                found += [block.part.router, block.part.experts]
        return tuple(found)
