"""Qwen3-Next (GGUF `qwen3next`, HF `qwen3_next`) and Qwen3.5-MoE (GGUF `qwen35moe`, HF `qwen3_5_moe`): most
layers Gated DeltaNet linear attention with a fixed-size recurrent state, every full_attention_interval-th layer
gated full attention (output gate from the doubled q projection, q/k RMSNorm, partial NeoX RoPE); every layer a
MoE (softmax top-k) with a shared expert scaled by a sigmoid gate. Their MTP layers are read where a file has
them (nextn tensors, hybrid/model.py Model.nextn_layers), run by the MTP drafter (speculative/mtp.py).

GGUF names and keys are those llama.cpp's converter writes (gguf-py's MODEL_TENSORS[QWEN3NEXT] / [QWEN35MOE]):
the FFN norm is `post_attention_norm`; RMSNorm weights are stored as 1 + w (the HF models scale by 1 + w), the
gated norm's as w; ssm_a holds -exp(A_log); the conv weight is [C, W]; qwen3next's q, k, v rows come as
attn_qkv (all q heads, then k, then v) and its z as attn_gate, its beta / alpha inputs interleaved per key head in
ssm_ba; qwen35moe's are ssm_beta / ssm_alpha, its value heads tiled (hybrid/arch/recipe.py LinearAttention).
HF directories are read into the same tensors (hybrid/arch/qwen3next_hf.py makes the converter's changes).
"""
from gguf import Keys

from ..errors import ModelError
from ..formats.weights import ModelConfig
from .base import PART_TENSORS, ArchSpec, LayerTensor, attention_tensors, require
from .qwen3next_hf import hf_tensors
from .recipe import (Block, FullAttention, GatedAttention, LayerRecipe, LinearAttention, MoE, SharedExpert, SoftmaxTopK,
                     SwiGLU)

QWEN3NEXT, QWEN35MOE = "qwen3next", "qwen35moe"
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # llama.cpp's key (newer gguf-py: Keys.Attention.RECURRENT_LAYERS)


def config_from_gguf(arch):
    """The family's GGUF config reader: (fields, source, vocab_size, tie_word_embeddings, tensor_names) ->
    ModelConfig."""
    def read(fields, source, vocab_size, tie_word_embeddings, tensor_names=()):
        def key(k, default=None):
            value = fields.get(k.format(arch=arch), default)
            if value is None:
                raise ModelError(f"{source}: missing GGUF metadata '{k.format(arch=arch)}'")
            return value

        hidden, num_heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
        head_dim = int(key(Keys.Attention.KEY_LENGTH, hidden // num_heads))
        num_v_heads = int(key(Keys.SSM.TIME_STEP_RANK))
        nextn = int(key(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
        num_layers = int(key(Keys.LLM.BLOCK_COUNT)) - nextn
        recurrent = fields.get(RECURRENT_LAYERS.format(arch=arch))  # per layer (MTP layers included), when written
        return ModelConfig(
            arch=arch, vocab_size=vocab_size, hidden_size=hidden, num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV, num_heads)), head_dim=head_dim,
            num_experts=int(key(Keys.LLM.EXPERT_COUNT)), num_experts_per_tok=int(key(Keys.LLM.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            rope_theta=float(key(Keys.Rope.FREQ_BASE, 10000.0)),
            rms_norm_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
            context_length=int(key(Keys.LLM.CONTEXT_LENGTH)),
            norm_topk_prob=bool(key(Keys.LLM.EXPERT_WEIGHTS_NORM, True)),
            tie_word_embeddings=tie_word_embeddings, qk_norm=True,
            rotary_dim=int(key(Keys.Rope.DIMENSION_COUNT, head_dim)),
            shared_intermediate_size=int(key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)),
            num_nextn_layers=nextn,
            full_attention_interval=int(key(Keys.LLM.FULL_ATTENTION_INTERVAL, 4)),
            layer_types=() if recurrent is None else tuple(LAYER_TYPES[bool(r)] for r in recurrent[:num_layers]),
            linear_num_key_heads=int(key(Keys.SSM.GROUP_COUNT)), linear_num_value_heads=num_v_heads,
            linear_key_head_dim=int(key(Keys.SSM.STATE_SIZE)),
            linear_value_head_dim=int(key(Keys.SSM.INNER_SIZE)) // num_v_heads,
            linear_conv_kernel=int(key(Keys.SSM.CONV_KERNEL)),
        )

    return read


def hf_config(cfg, source):
    """ModelConfig of an HF config.json of either family (a qwen3_5_moe's text_config), named as its GGUF arch."""
    cfg = cfg.get("text_config") or cfg
    arch = QWEN35MOE if cfg.get("model_type", "").startswith("qwen3_5") else QWEN3NEXT
    hidden = int(require(cfg, "hidden_size", source))
    num_heads = int(require(cfg, "num_attention_heads", source))
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise ModelError(f"{source}: rope type '{params['rope_type']}' is not supported for {arch} (only default RoPE)")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    interval = int(cfg.get("full_attention_interval", 4))
    layer_types = tuple(cfg.get("layer_types") or ())
    if set(layer_types) - set(LAYER_TYPES):
        raise ModelError(f"{source}: layer_types {sorted(set(layer_types) - set(LAYER_TYPES))} are not supported "
                         f"for {arch} (only {' and '.join(LAYER_TYPES)})")
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ModelError(f"{source}: dense layers (mlp_only_layers, decoder_sparse_step) are not supported for {arch}")
    return ModelConfig(
        arch=arch, vocab_size=int(require(cfg, "vocab_size", source)), hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers", source)), num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads), head_dim=head_dim,
        num_experts=int(require(cfg, "num_experts", source)),
        num_experts_per_tok=int(require(cfg, "num_experts_per_tok", source)),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size", source)),
        rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_length=int(cfg.get("max_position_embeddings", 262144)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), qk_norm=True,
        rotary_dim=int(head_dim * partial),
        shared_intermediate_size=int(require(cfg, "shared_expert_intermediate_size", source)),
        full_attention_interval=interval, layer_types=layer_types,
        linear_num_key_heads=int(require(cfg, "linear_num_key_heads", source)),
        linear_num_value_heads=int(require(cfg, "linear_num_value_heads", source)),
        linear_key_head_dim=int(require(cfg, "linear_key_head_dim", source)),
        linear_value_head_dim=int(require(cfg, "linear_value_head_dim", source)),
        linear_conv_kernel=int(require(cfg, "linear_conv_kernel_dim", source)),
    )


def config_from_hf(cfg, source):
    """hf_config, for the HF model types of this family's spec (the tensors: hybrid/arch/qwen3next_hf.py)."""
    return hf_config(cfg, source)


LAYER_TYPES = ("full_attention", "linear_attention")  # by "is it recurrent"


def is_full_attention(config, layer):
    """From the file's per-layer list where it has one, else every full_attention_interval-th layer."""
    if config.layer_types:
        return config.layer_types[layer] == "full_attention"
    return (layer + 1) % config.full_attention_interval == 0


def linear_part(config):
    c = config
    return LinearAttention(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                           c.linear_value_head_dim, c.linear_conv_kernel,
                           tiled=c.arch == QWEN35MOE and c.linear_num_key_heads != c.linear_num_value_heads,
                           joint_ba=c.arch == QWEN3NEXT)


def recipe_for(config, layer):
    """Gated full attention every full_attention_interval-th layer, linear attention in the others; MoE with a gated
    shared expert in every layer (the MTP layers, past num_layers, are full-attention layers)."""
    full = layer >= config.num_layers or is_full_attention(config, layer)
    mixer = GatedAttention() if full else linear_part(config)
    ffn = MoE(router=SoftmaxTopK(), experts=SwiGLU(), shared=SharedExpert(gated=True))
    return LayerRecipe(mixer=Block("attn_norm", mixer), ffn=Block("ffn_norm", ffn))


def gated_attention_tensors(part, config):
    """FullAttention's with q/k norms, the q projection doubled (each head's query, then its gate)."""
    tensors = attention_tensors(FullAttention(qk_norm=True), config)
    q = tensors[0]
    return [LayerTensor(q.gguf, q.field, q.hf, lambda c: (2 * c.num_heads * c.head_dim, c.hidden_size))] + tensors[1:]


def linear_attention_tensors(part, config):
    value_dim, hv = part.num_v_heads * part.value_dim, part.num_v_heads
    tensors = [
        LayerTensor("attn_qkv.weight", "ssm_qkv", "linear_attn.in_proj_qkv.weight",
                    lambda c: (part.conv_channels, c.hidden_size)),
        LayerTensor("attn_gate.weight", "ssm_z", "linear_attn.in_proj_z.weight", lambda c: (value_dim, c.hidden_size)),
        LayerTensor("ssm_conv1d.weight", "ssm_conv1d", "linear_attn.conv1d.weight",
                    lambda c: (part.conv_channels, part.conv_width)),
        LayerTensor("ssm_a", "ssm_a", "linear_attn.A_log", lambda c: (hv,)),
        LayerTensor("ssm_dt.bias", "ssm_dt_bias", "linear_attn.dt_bias", lambda c: (hv,)),
        LayerTensor("ssm_norm.weight", "ssm_norm", "linear_attn.norm.weight", lambda c: (part.value_dim,)),
        LayerTensor("ssm_out.weight", "ssm_out", "linear_attn.out_proj.weight", lambda c: (c.hidden_size, value_dim)),
    ]
    if part.joint_ba:
        return tensors + [LayerTensor("ssm_ba.weight", "ssm_ba", "linear_attn.in_proj_ba.weight",
                                      lambda c: (2 * hv, c.hidden_size))]
    return tensors + [LayerTensor("ssm_beta.weight", "ssm_beta", "linear_attn.in_proj_b.weight",
                                  lambda c: (hv, c.hidden_size)),
                      LayerTensor("ssm_alpha.weight", "ssm_alpha", "linear_attn.in_proj_a.weight",
                                  lambda c: (hv, c.hidden_size))]


# The parts this family adds declare their tensors beside the others (hybrid/arch/base.py PART_TENSORS).
PART_TENSORS.update({GatedAttention: gated_attention_tensors, LinearAttention: linear_attention_tensors})

NEXTN_TENSORS = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


def nextn_tensors(config):
    """{name: shape} of the MTP layers' required tensors: each a gated-attention MoE layer plus its own."""
    c, shapes = config, {}
    for layer in range(c.num_layers, c.num_layers + c.num_nextn_layers):
        shapes.update((f"blk.{layer}.{t.gguf}", tuple(t.shape(c))) for t in spec_of(c).layer_tensors(c, layer)
                      if not t.optional)
        shapes.update({f"blk.{layer}.nextn.eh_proj.weight": (c.hidden_size, 2 * c.hidden_size)})
        shapes.update((f"blk.{layer}.{name}", (c.hidden_size,)) for name in NEXTN_TENSORS[1:])
    return shapes


def write_gguf_hparams(writer, config):
    """The keys llama.cpp's converter writes for these families beyond the common ones
    (hybrid/formats/gguf_writer.py)."""
    c = config
    writer.add_block_count(c.num_layers + c.num_nextn_layers)
    writer.add_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    writer.add_rope_dimension_count(c.rotary_dim or c.head_dim)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(c.full_attention_interval)
    if c.layer_types:
        writer.add_array(RECURRENT_LAYERS.format(arch=c.arch),
                         [t == "linear_attention" for t in c.layer_types] + [False] * c.num_nextn_layers)
    if c.num_nextn_layers:
        writer.add_nextn_predict_layers(c.num_nextn_layers)


def _spec(name, hf_types):
    return ArchSpec(name=name, hf_model_types=hf_types, recipe=None, recipe_for=recipe_for,
                    config_from_gguf=config_from_gguf(name), config_from_hf=config_from_hf,
                    norm_names=(("ffn_norm", ("post_attention_norm.weight", "post_attention_layernorm.weight")),),
                    extra_tensors=nextn_tensors, write_gguf_hparams=write_gguf_hparams, hf_tensors=hf_tensors)


SPECS = (_spec(QWEN3NEXT, ("qwen3_next",)), _spec(QWEN35MOE, ("qwen3_5_moe", "qwen3_5_moe_text")))


def spec_of(config):
    return SPECS[config.arch == QWEN35MOE]
