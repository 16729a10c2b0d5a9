"""What an architecture family declares: its names, its hyper-parameters and its layer recipes.

The layer's parts are written once per runner (hybrid/arch/recipe.py); a family only picks them, per layer
where its layers differ (`ArchSpec.layer_recipe`), and says how its files name things. Canonical tensor
names are GGUF's (`blk.N.attn_q.weight`). Each part declares the tensors it reads (PART_TENSORS: a
`LayerTensor` each: GGUF suffix, LayerWeights field, HF suffix, shape from the config); the required names,
the HF sources, the expected shapes and the model's LayerWeights are all made from those declarations.
"""
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ModelError
from .recipe import (ClampedSwiGLU, DenseFFN, FullAttention, LayerRecipe, MoE, SharedExpert, SigmoidTopK, SoftmaxTopK,
                     SwiGLU, TopKSoftmax)

GLOBAL_TENSORS_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of a layer: `gguf` its name after `blk.N.`, `field` the LayerWeights field it fills, `hf` its
    name after `model.layers.N.` in an HF directory ("{e}" in it: one tensor per expert, stacked [E, ...] in the
    canonical one), `shape(config)` its logical shape [..., R, C]; `optional`: a file may lack it."""

    gguf: str
    field: str
    hf: str
    shape: Callable
    optional: bool = False

    @property
    def stacked(self):
        return "{e}" in self.hf


def _q_dim(c):
    return c.num_heads * c.head_dim


def _kv_dim(c):
    return c.num_kv_heads * c.head_dim


def attention_tensors(part, config):
    """FullAttention's projections, and its q/k norms and q/k/v biases where the part has them."""
    tensors = [
        LayerTensor("attn_q.weight", "attn_q", "self_attn.q_proj.weight", lambda c: (_q_dim(c), c.hidden_size)),
        LayerTensor("attn_k.weight", "attn_k", "self_attn.k_proj.weight", lambda c: (_kv_dim(c), c.hidden_size)),
        LayerTensor("attn_v.weight", "attn_v", "self_attn.v_proj.weight", lambda c: (_kv_dim(c), c.hidden_size)),
        LayerTensor("attn_output.weight", "attn_output", "self_attn.o_proj.weight",
                    lambda c: (c.hidden_size, _q_dim(c))),
    ]
    if part.qk_norm:
        tensors += [LayerTensor("attn_q_norm.weight", "attn_q_norm", "self_attn.q_norm.weight",
                                lambda c: (c.head_dim,)),
                    LayerTensor("attn_k_norm.weight", "attn_k_norm", "self_attn.k_norm.weight",
                                lambda c: (c.head_dim,))]
    if part.qkv_bias:
        tensors += [LayerTensor("attn_q.bias", "attn_q_bias", "self_attn.q_proj.bias", lambda c: (_q_dim(c),)),
                    LayerTensor("attn_k.bias", "attn_k_bias", "self_attn.k_proj.bias", lambda c: (_kv_dim(c),)),
                    LayerTensor("attn_v.bias", "attn_v_bias", "self_attn.v_proj.bias", lambda c: (_kv_dim(c),))]
    if part.o_bias:
        tensors.append(LayerTensor("attn_output.bias", "attn_output_bias", "self_attn.o_proj.bias",
                                   lambda c: (c.hidden_size,)))
    if part.sinks:
        tensors.append(LayerTensor("attn_sinks.weight", "attn_sinks", "self_attn.sinks", lambda c: (c.num_heads,)))
    return tensors


def moe_tensors(part, config):
    """The router's weight and the stacked experts, then those of the router, experts and shared expert parts."""
    tensors = [LayerTensor("ffn_gate_inp.weight", "router", "mlp.gate.weight",
                           lambda c: (c.num_experts, c.hidden_size))]
    for sub in (part.router, part.experts, part.shared):
        if sub is not None:
            tensors += part_tensors(sub, config)
    return tensors


def swiglu_tensors(part, config):
    def width(c):
        return (c.num_experts, c.moe_intermediate_size, c.hidden_size)

    return [LayerTensor("ffn_gate_exps.weight", "gate_exps", "mlp.experts.{e}.gate_proj.weight", width),
            LayerTensor("ffn_up_exps.weight", "up_exps", "mlp.experts.{e}.up_proj.weight", width),
            LayerTensor("ffn_down_exps.weight", "down_exps", "mlp.experts.{e}.down_proj.weight",
                        lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size))]


def topk_softmax_router_tensors(part, config):
    return [LayerTensor("ffn_gate_inp.bias", "router_bias", "mlp.router.bias", lambda c: (c.num_experts,))]


def clamped_swiglu_tensors(part, config):
    """SwiGLU's stacked experts and their biases (GGUF names as llama.cpp's converter writes gpt-oss's; its HF
    checkpoints hold the experts fused, which the HF directory reader does not split)."""
    def bias(width):
        return lambda c: (c.num_experts, width(c))

    return swiglu_tensors(part, config) + [
        LayerTensor("ffn_gate_exps.bias", "gate_exps_bias", "mlp.experts.{e}.gate_proj.bias",
                    bias(lambda c: c.moe_intermediate_size)),
        LayerTensor("ffn_up_exps.bias", "up_exps_bias", "mlp.experts.{e}.up_proj.bias",
                    bias(lambda c: c.moe_intermediate_size)),
        LayerTensor("ffn_down_exps.bias", "down_exps_bias", "mlp.experts.{e}.down_proj.bias",
                    bias(lambda c: c.hidden_size))]


def sigmoid_router_tensors(part, config):
    return [LayerTensor("exp_probs_b.bias", "router_choice_bias", "mlp.gate.e_score_correction_bias",
                        lambda c: (c.num_experts,))]


def shared_expert_tensors(part, config):
    return [LayerTensor("ffn_gate_shexp.weight", "gate_shexp", "mlp.shared_experts.gate_proj.weight",
                        lambda c: (c.shared_intermediate_size, c.hidden_size)),
            LayerTensor("ffn_up_shexp.weight", "up_shexp", "mlp.shared_experts.up_proj.weight",
                        lambda c: (c.shared_intermediate_size, c.hidden_size)),
            LayerTensor("ffn_down_shexp.weight", "down_shexp", "mlp.shared_experts.down_proj.weight",
                        lambda c: (c.hidden_size, c.shared_intermediate_size))] + \
        ([LayerTensor("ffn_gate_inp_shexp.weight", "shexp_gate", "mlp.shared_expert_gate.weight",
                      lambda c: (1, c.hidden_size))] if part.gated else [])


def dense_ffn_tensors(part, config):
    return [LayerTensor("ffn_gate.weight", "ffn_gate", "mlp.gate_proj.weight",
                        lambda c: (c.dense_intermediate_size, c.hidden_size)),
            LayerTensor("ffn_up.weight", "ffn_up", "mlp.up_proj.weight",
                        lambda c: (c.dense_intermediate_size, c.hidden_size)),
            LayerTensor("ffn_down.weight", "ffn_down", "mlp.down_proj.weight",
                        lambda c: (c.hidden_size, c.dense_intermediate_size))]


# part type -> (part, config) -> [LayerTensor]: the tensors a part reads (a new part type adds its entry).
PART_TENSORS = {FullAttention: attention_tensors, MoE: moe_tensors, SoftmaxTopK: lambda part, config: [],
                SigmoidTopK: sigmoid_router_tensors, SwiGLU: swiglu_tensors, SharedExpert: shared_expert_tensors,
                DenseFFN: dense_ffn_tensors, TopKSoftmax: topk_softmax_router_tensors,
                ClampedSwiGLU: clamped_swiglu_tensors}

# A block's norm (its LayerWeights field) -> (GGUF suffix, HF suffix), unless the family names it otherwise.
NORM_TENSORS = {"attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
                "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight")}


def part_tensors(part, config):
    make = PART_TENSORS.get(type(part))
    if make is None:
        raise ValueError(f"no tensor declaration for part {part!r} (hybrid/arch/base.py PART_TENSORS)")
    return make(part, config)


SPECS = {}  # name -> ArchSpec of the families Strata serves (filled by hybrid/arch/__init__.py from its ARCHS)


@dataclass(frozen=True)
class ArchSpec:
    """name: general.architecture in GGUF; hf_model_types: config.json model_type values; recipe: every layer's
    recipe, or recipe_for(config, layer) where layers differ; config_from_gguf(fields, source, vocab_size,
    tie_word_embeddings, tensor_names) and config_from_hf(config_json, source) -> ModelConfig; norm_names: the
    family's names of a block's norm (NORM_TENSORS' entries it renames); extra_tensors(config) -> {name: shape}:
    tensors outside the layers' recipes that a file must have (e.g. NextN layers); write_gguf_hparams(writer,
    config): the family's GGUF keys beyond the common ones, block_count and feed_forward_length included (None:
    the MoE layers' width as feed_forward_length, as qwen3moe's files have); fit_to_tensors(config, hf_names) -> the
    config of an HF directory with these tensor names (e.g. no NextN layers where it has none of their weights);
    extra_hf_tensors(config) -> [(canonical name, HF name)] of its tensors outside the layers (NextN layers);
    hf_tensors(fetch, config, spec, source) -> {canonical name: QuantTensor}: the family's own reading of an HF
    directory (fetch(HF name) -> its tensor), where its tensors need changes on the way (None: by the names)."""

    name: str
    hf_model_types: tuple
    recipe: Optional[LayerRecipe]
    config_from_gguf: Callable
    config_from_hf: Callable
    recipe_for: Optional[Callable] = None
    norm_names: tuple = ()
    extra_tensors: Optional[Callable] = None
    write_gguf_hparams: Optional[Callable] = None
    fit_to_tensors: Optional[Callable] = None
    extra_hf_tensors: Optional[Callable] = None
    hf_tensors: Optional[Callable] = None

    def layer_recipe(self, config, layer):
        """The recipe of layer `layer` (0-based)."""
        return self.recipe if self.recipe_for is None else self.recipe_for(config, layer)

    def layer_tensors(self, config, layer):
        """[LayerTensor] of a layer: its blocks' norms, then its parts' tensors."""
        return recipe_tensors(self.layer_recipe(config, layer), config, dict(NORM_TENSORS, **dict(self.norm_names)))

    def layer_tensor_names(self, layer, config):
        return [f"blk.{layer}.{t.gguf}" for t in self.layer_tensors(config, layer) if not t.optional]

    def required_tensor_names(self, config):
        names = ["token_embd.weight", "output_norm.weight"]
        if not config.tie_word_embeddings:
            names.append("output.weight")
        for layer in range(config.num_layers):
            names += self.layer_tensor_names(layer, config)
        if self.extra_tensors is not None:
            names += list(self.extra_tensors(config))
        return names

    def tensor_shapes(self, config):
        """{canonical name: expected shape} of every tensor the family declares."""
        c = config
        shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output.weight": (c.vocab_size, c.hidden_size),
                  "output_norm.weight": (c.hidden_size,)}
        for layer in range(config.num_layers):
            shapes.update((f"blk.{layer}.{t.gguf}", tuple(t.shape(c))) for t in self.layer_tensors(c, layer))
        if self.extra_tensors is not None:
            shapes.update(self.extra_tensors(config))
        return shapes


def recipe_tensors(recipe, config, norm_names):
    """[LayerTensor] a layer of `recipe` reads: each block's norm, then its part's tensors."""
    tensors = []
    for block in recipe.blocks:
        gguf, hf = norm_names[block.norm]
        tensors.append(LayerTensor(gguf, block.norm, hf, lambda c: (c.hidden_size,)))
        tensors += part_tensors(block.part, config)
    return tensors


def require(mapping, key, source, what="field"):
    """mapping[key], or a ModelError naming the file and the missing key."""
    if key not in mapping or mapping[key] is None:
        raise ModelError(f"{source}: missing {what} '{key}'")
    return mapping[key]


def hf_tensor_sources(spec, config):
    """(canonical name, HF name or list of per-expert HF names) for every layer and global tensor of a model."""
    sources = [(name, hf) for name, hf in GLOBAL_TENSORS_HF.items()
               if not (name == "output.weight" and config.tie_word_embeddings)]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for t in spec.layer_tensors(config, layer):
            hf = [prefix + t.hf.format(e=e) for e in range(config.num_experts)] if t.stacked else prefix + t.hf
            sources.append((f"blk.{layer}.{t.gguf}", hf))
    if spec.extra_hf_tensors is not None:
        sources += spec.extra_hf_tensors(config)
    return sources


def expected_shape(name, config):
    """The logical shape [..., R, C] a canonical tensor must have, or None for names we do not check."""
    return SPECS[config.arch].tensor_shapes(config).get(name)


def validate_tensors(spec, config, tensors, source):
    """Every tensor the recipe needs is present with the shape the config implies."""
    shapes = spec.tensor_shapes(config)
    for name in spec.required_tensor_names(config):
        if name not in tensors:
            raise ModelError(f"{source}: missing tensor '{name}'")
    for name, want in shapes.items():
        if name in tensors and tuple(tensors[name].shape) != want:
            raise ModelError(f"{source}: tensor '{name}' has shape {tuple(tensors[name].shape)}, expected {want}")
