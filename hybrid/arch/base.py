"""What an architecture family declares: its names, its hyper-parameters and its layer recipe.

The layer's parts are written once per runner (hybrid/arch/recipe.py); a family only picks them
and says how its files name things. Canonical tensor names are GGUF's (`blk.N.attn_q.weight`).
"""
from dataclasses import dataclass, field

from ..errors import ModelError
from .recipe import LayerRecipe

# Per-layer tensors every MoE family here has: canonical suffix -> HF suffix.
LAYER_TENSORS_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
QK_NORM_TENSORS_HF = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Stacked expert tensors: canonical suffix -> HF per-expert projection name.
EXPERT_TENSORS_HF = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
GLOBAL_TENSORS_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ArchSpec:
    name: str  # general.architecture in GGUF
    hf_model_types: tuple  # config.json model_type values
    recipe: LayerRecipe
    config_from_gguf: object  # (fields, source, vocab_size, tie_word_embeddings) -> ModelConfig
    config_from_hf: object  # (config_json: dict, source: str) -> ModelConfig
    layer_tensors_hf: dict = field(default_factory=dict)

    def layer_tensor_names(self, layer):
        names = [f"blk.{layer}.{suffix}" for suffix in self.layer_tensors_hf]
        names += [f"blk.{layer}.{suffix}" for suffix in EXPERT_TENSORS_HF]
        return names

    def required_tensor_names(self, config):
        names = ["token_embd.weight", "output_norm.weight"]
        if not config.tie_word_embeddings:
            names.append("output.weight")
        for layer in range(config.num_layers):
            names += self.layer_tensor_names(layer)
        return names


def require(mapping, key, source, what="field"):
    """mapping[key], or a ModelError naming the file and the missing key."""
    if key not in mapping or mapping[key] is None:
        raise ModelError(f"{source}: missing {what} '{key}'")
    return mapping[key]


def hf_tensor_sources(spec, config):
    """(canonical name, HF name or list of per-expert HF names) for every tensor of a model."""
    sources = [(name, hf) for name, hf in GLOBAL_TENSORS_HF.items()
               if not (name == "output.weight" and config.tie_word_embeddings)]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        sources += [(f"blk.{layer}.{name}", prefix + hf) for name, hf in spec.layer_tensors_hf.items()]
        for name, proj in EXPERT_TENSORS_HF.items():
            experts = [f"{prefix}mlp.experts.{e}.{proj}.weight" for e in range(config.num_experts)]
            sources.append((f"blk.{layer}.{name}", experts))
    return sources


def expected_shape(name, config):
    """The logical shape [..., R, C] a canonical tensor must have, or None for names we do not check."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    global_shapes = {
        "token_embd.weight": (c.vocab_size, c.hidden_size),
        "output.weight": (c.vocab_size, c.hidden_size),
        "output_norm.weight": (c.hidden_size,),
    }
    if name in global_shapes:
        return global_shapes[name]
    suffix = name.split(".", 2)[-1]
    return {
        "attn_norm.weight": (c.hidden_size,),
        "ffn_norm.weight": (c.hidden_size,),
        "attn_q.weight": (q_dim, c.hidden_size),
        "attn_k.weight": (kv_dim, c.hidden_size),
        "attn_v.weight": (kv_dim, c.hidden_size),
        "attn_output.weight": (c.hidden_size, q_dim),
        "attn_q_norm.weight": (c.head_dim,),
        "attn_k_norm.weight": (c.head_dim,),
        "ffn_gate_inp.weight": (c.num_experts, c.hidden_size),
        "ffn_gate_exps.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
        "ffn_up_exps.weight": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
        "ffn_down_exps.weight": (c.num_experts, c.hidden_size, c.moe_intermediate_size),
    }.get(suffix)


def validate_tensors(spec, config, tensors, source):
    """Every tensor the recipe needs is present with the shape the config implies."""
    for name in spec.required_tensor_names(config):
        if name not in tensors:
            raise ModelError(f"{source}: missing tensor '{name}'")
        want = expected_shape(name, config)
        if want is not None and tuple(tensors[name].shape) != want:
            raise ModelError(f"{source}: tensor '{name}' has shape {tuple(tensors[name].shape)}, expected {want}")
