"""GLM-4.5 / 4.6 / 4.7 (GGUF `glm4moe`, HF `glm4_moe`): GQA with q/k/v biases, optional per-head q/k RMSNorm,
partial NeoX RoPE; `first_k_dense_replace` leading dense layers, then MoE layers with a sigmoid router (choice
bias `e_score_correction_bias`, group-limited top-k, routed scaling) and a shared expert; NextN (MTP) layers
after the decoder layers (hybrid/model.py Model.nextn_layers), run by the MTP drafter (hybrid/speculative/mtp.py).

GGUF names and keys are those llama.cpp's converter writes (gguf-py's MODEL_TENSORS[GLM4_MOE], Keys.LLM): its
block_count counts the NextN layers too (also in a file whose checkpoint had no NextN weights: then it has
no NextN layer), the FFN norm is `post_attention_norm`.
"""
import dataclasses

from gguf import ExpertGatingFuncType, Keys

from ..errors import ModelError
from ..formats.weights import ModelConfig
from .base import ArchSpec, require
from .recipe import Block, DenseFFN, FullAttention, LayerRecipe, MoE, SharedExpert, SigmoidTopK, SwiGLU

NAME = "glm4moe"

# The NextN layer's own tensors (after `blk.N.`) and their shapes; embed_tokens / shared_head_head may be absent
# (llama.cpp reads them as optional: the model's own embeddings and head then serve).
NEXTN_TENSORS = {
    "nextn.eh_proj.weight": lambda c: (c.hidden_size, 2 * c.hidden_size),
    "nextn.enorm.weight": lambda c: (c.hidden_size,),
    "nextn.hnorm.weight": lambda c: (c.hidden_size,),
    "nextn.shared_head_norm.weight": lambda c: (c.hidden_size,),
}
NEXTN_HF = {"nextn.eh_proj.weight": "eh_proj.weight", "nextn.enorm.weight": "enorm.weight",
            "nextn.hnorm.weight": "hnorm.weight", "nextn.shared_head_norm.weight": "shared_head.norm.weight"}
NEXTN_OPTIONAL = {
    "nextn.embed_tokens.weight": lambda c: (c.vocab_size, c.hidden_size),
    "nextn.shared_head_head.weight": lambda c: (c.vocab_size, c.hidden_size),
}


def _gguf_key(fields, source, key, default=None):
    value = fields.get(key.format(arch=NAME), default)
    if value is None:
        raise ModelError(f"{source}: missing GGUF metadata '{key.format(arch=NAME)}'")
    return value


def config_from_gguf(fields, source, vocab_size, tie_word_embeddings, tensor_names=()):
    def key(k, default=None):
        return _gguf_key(fields, source, k, default)

    gating = int(key(Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SIGMOID.value))
    if gating != ExpertGatingFuncType.SIGMOID.value:
        raise ModelError(f"{source}: {NAME}.expert_gating_func is {gating}; glm4moe routes by sigmoid "
                         f"({ExpertGatingFuncType.SIGMOID.value})")
    hidden, num_heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
    head_dim = int(key(Keys.Attention.KEY_LENGTH, hidden // num_heads))
    nextn = int(key(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
    num_layers = int(key(Keys.LLM.BLOCK_COUNT)) - nextn
    # a file converted from a checkpoint without its MTP weights counts the NextN layers but has none of them
    kept = nextn if any(name.startswith(f"blk.{num_layers}.") for name in tensor_names) else 0
    width = int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    return _checked(ModelConfig(
        arch=NAME, vocab_size=vocab_size, hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV, num_heads)), head_dim=head_dim,
        num_experts=int(key(Keys.LLM.EXPERT_COUNT)), num_experts_per_tok=int(key(Keys.LLM.EXPERT_USED_COUNT)),
        moe_intermediate_size=width,
        rope_theta=float(key(Keys.Rope.FREQ_BASE, 10000.0)),
        rms_norm_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        context_length=int(key(Keys.LLM.CONTEXT_LENGTH)),
        norm_topk_prob=bool(key(Keys.LLM.EXPERT_WEIGHTS_NORM, True)),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rotary_dim=int(key(Keys.Rope.DIMENSION_COUNT, head_dim)),
        first_dense_layers=int(key(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)),
        dense_intermediate_size=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        shared_intermediate_size=width * int(key(Keys.LLM.EXPERT_SHARED_COUNT, 0)),
        num_expert_groups=int(key(Keys.LLM.EXPERT_GROUP_COUNT, 1)),
        topk_expert_groups=int(key(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1)),
        routed_scaling_factor=float(key(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)),
        num_nextn_layers=kept,
    ), source)


def _checked(config, source):
    """config, or a ModelError on routing or RoPE settings the parts cannot run."""
    c = config
    groups, used = c.num_expert_groups, c.topk_expert_groups
    if groups < 1 or groups > 64 or c.num_experts % groups or not 1 <= used <= groups:
        raise ModelError(f"{source}: {c.num_experts} experts in {groups} groups, {used} of them used: the groups must "
                         f"split the experts evenly (at most 64) and 1 <= groups used <= groups")
    if c.num_experts_per_tok > used * (c.num_experts // groups):
        raise ModelError(f"{source}: {c.num_experts_per_tok} experts per token, more than the {used} groups used hold")
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise ModelError(f"{source}: RoPE over {c.rotary_dim} dims of a {c.head_dim}-dim head (an even number, at "
                         f"most the head's, is needed)")
    return config


def _rope_from_hf(cfg, source):
    """(rope_theta, partial_rotary_factor) from rope_parameters (transformers 5) or the top-level fields."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelError(f"{source}: rope type '{rope_type}' is not supported for {NAME} (only default RoPE)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta), float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))


def config_from_hf(cfg, source):
    hidden = int(require(cfg, "hidden_size", source))
    num_heads = int(require(cfg, "num_attention_heads", source))
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    theta, partial = _rope_from_hf(cfg, source)
    width = int(require(cfg, "moe_intermediate_size", source))
    return _checked(ModelConfig(
        arch=NAME, vocab_size=int(require(cfg, "vocab_size", source)), hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers", source)),
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads), head_dim=head_dim,
        num_experts=int(require(cfg, "n_routed_experts", source)),
        num_experts_per_tok=int(require(cfg, "num_experts_per_tok", source)),
        moe_intermediate_size=width, rope_theta=theta, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        context_length=int(cfg.get("max_position_embeddings", 131072)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=bool(cfg.get("use_qk_norm", False)),
        rotary_dim=int(head_dim * partial),
        first_dense_layers=int(cfg.get("first_k_dense_replace", 0)),
        dense_intermediate_size=int(require(cfg, "intermediate_size", source)),
        shared_intermediate_size=width * int(cfg.get("n_shared_experts", 0)),
        num_expert_groups=int(cfg.get("n_group") or 1), topk_expert_groups=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_nextn_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    ), source)


def fit_to_tensors(config, hf_names):
    """No NextN layers in an HF directory without their weights (transformers' own saves have none)."""
    if config.num_nextn_layers and f"model.layers.{config.num_layers}.eh_proj.weight" not in hf_names:
        return dataclasses.replace(config, num_nextn_layers=0)
    return config


def nextn_hf_tensors(config):
    """(canonical name, HF name) of the NextN layers' required tensors: model.layers.{L + i}.* in HF checkpoints."""
    sources = []
    for layer in range(config.num_layers, config.num_layers + config.num_nextn_layers):
        prefix = f"model.layers.{layer}."
        for t in SPEC.layer_tensors(config, layer):
            hf = [prefix + t.hf.format(e=e) for e in range(config.num_experts)] if t.stacked else prefix + t.hf
            sources.append((f"blk.{layer}.{t.gguf}", hf))
        sources += [(f"blk.{layer}.{name}", prefix + hf) for name, hf in NEXTN_HF.items()]
    return sources


def recipe_for(config, layer):
    """Leading dense layers, then MoE layers (the NextN layers, past num_layers, are MoE layers too)."""
    attention = FullAttention(qk_norm=config.qk_norm, rope="neox", qkv_bias=config.attention_bias)
    if layer < config.first_dense_layers:
        ffn = DenseFFN()
    else:
        router = SigmoidTopK(num_groups=config.num_expert_groups, topk_groups=config.topk_expert_groups,
                             scale=config.routed_scaling_factor)
        ffn = MoE(router=router, experts=SwiGLU(), shared=SharedExpert() if config.shared_intermediate_size else None)
    return LayerRecipe(mixer=Block("attn_norm", attention), ffn=Block("ffn_norm", ffn))


def nextn_tensors(config):
    """{name: shape} of the NextN layers' required tensors: each a whole MoE decoder layer plus its own."""
    shapes = {}
    for layer in range(config.num_layers, config.num_layers + config.num_nextn_layers):
        shapes.update((f"blk.{layer}.{t.gguf}", tuple(t.shape(config))) for t in SPEC.layer_tensors(config, layer)
                      if not t.optional)
        shapes.update((f"blk.{layer}.{name}", shape(config)) for name, shape in NEXTN_TENSORS.items())
    return shapes


def write_gguf_hparams(writer, config):
    """The keys llama.cpp's converter writes for glm4moe beyond the common ones (hybrid/formats/gguf_writer.py)."""
    writer.add_block_count(config.num_layers + config.num_nextn_layers)
    writer.add_feed_forward_length(config.dense_intermediate_size)
    writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
    writer.add_expert_shared_count(config.shared_intermediate_size // config.moe_intermediate_size)
    writer.add_leading_dense_block_count(config.first_dense_layers)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_group_count(config.num_expert_groups)
    writer.add_expert_group_used_count(config.topk_expert_groups)
    if config.num_nextn_layers:
        writer.add_nextn_predict_layers(config.num_nextn_layers)


SPEC = ArchSpec(
    name=NAME,
    hf_model_types=("glm4_moe",),
    recipe=None,
    recipe_for=recipe_for,
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    norm_names=(("ffn_norm", ("post_attention_norm.weight", "post_attention_layernorm.weight")),),
    extra_tensors=nextn_tensors,
    write_gguf_hparams=write_gguf_hparams,
    fit_to_tensors=fit_to_tensors,
    extra_hf_tensors=nextn_hf_tensors,
)
