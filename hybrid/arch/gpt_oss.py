"""gpt-oss (GGUF `gpt-oss`, HF `gpt_oss`): GQA with q/k/v/o biases and a learned sink logit per head, YaRN RoPE,
sliding-window (even layers) and full (odd layers) attention; a router with a bias that keeps the top k logits
and softmaxes over them; experts with biases and the clamped SwiGLU (alpha 1.702, limit 7.0), MXFP4 in the
released files.

GGUF names and keys are those llama.cpp's converter writes (gguf-py's MODEL_TENSORS[GPT_OSS], conversion/gpt_oss.py):
the FFN norm is `post_attention_norm`, the sinks `attn_sinks.weight`, the experts' gate/up split from HF's interleaved
gate_up_proj, their biases `ffn_*_exps.bias`; its layer pattern is llama.cpp's too (swa pattern 2: even layers slide).
HF configs give the hyper-parameters (the HF directory reader does not split gpt-oss's fused expert tensors).
"""
from gguf import Keys, RopeScalingType

from ..errors import ModelError
from ..formats.weights import ModelConfig
from ..rope_freqs import YarnScaling
from .base import ArchSpec, require
from .recipe import Block, ClampedSwiGLU, FullAttention, LayerRecipe, MoE, TopKSoftmax

NAME = "gpt-oss"
SLIDING, FULL = "sliding_attention", "full_attention"


def _key(fields, source, key, default=None):
    name = key.format(arch=NAME)
    value = fields.get(name, default)
    if value is None:
        raise ModelError(f"{source}: missing GGUF metadata '{name}'")
    return value


def _yarn_from_gguf(fields, source):
    scaling = fields.get(Keys.Rope.SCALING_TYPE.format(arch=NAME))
    if scaling in (None, "none"):
        return None
    if scaling != RopeScalingType.YARN.value:
        raise ModelError(f"{source}: {NAME} rope scaling '{scaling}' is not supported (only yarn)")
    attn_factor = fields.get(Keys.Rope.SCALING_YARN_ATTN_FACTOR.format(arch=NAME))
    return YarnScaling(factor=float(_key(fields, source, Keys.Rope.SCALING_FACTOR)),
                       original_max_position_embeddings=int(_key(fields, source, Keys.Rope.SCALING_ORIG_CTX_LEN)),
                       beta_fast=float(fields.get(Keys.Rope.SCALING_YARN_BETA_FAST.format(arch=NAME), 32.0)),
                       beta_slow=float(fields.get(Keys.Rope.SCALING_YARN_BETA_SLOW.format(arch=NAME), 1.0)),
                       attention_factor=None if attn_factor is None else float(attn_factor), truncate=False)


def config_from_gguf(fields, source, vocab_size, tie_word_embeddings, tensor_names=()):
    def key(k, default=None):
        return _key(fields, source, k, default)

    hidden, num_heads = int(key(Keys.LLM.EMBEDDING_LENGTH)), int(key(Keys.Attention.HEAD_COUNT))
    return ModelConfig(
        arch=NAME, vocab_size=vocab_size, hidden_size=hidden, num_layers=int(key(Keys.LLM.BLOCK_COUNT)),
        num_heads=num_heads, num_kv_heads=int(key(Keys.Attention.HEAD_COUNT_KV, num_heads)),
        head_dim=int(key(Keys.Attention.KEY_LENGTH, hidden // num_heads)),
        num_experts=int(key(Keys.LLM.EXPERT_COUNT)), num_experts_per_tok=int(key(Keys.LLM.EXPERT_USED_COUNT)),
        moe_intermediate_size=int(key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
        rope_theta=float(key(Keys.Rope.FREQ_BASE, 150000.0)),
        rms_norm_eps=float(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        context_length=int(key(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=tie_word_embeddings, attention_bias=True,
        sliding_window=int(key(Keys.Attention.SLIDING_WINDOW, 0)), rope_scaling=_yarn_from_gguf(fields, source),
    )


def _yarn_from_hf(cfg, source):
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 150000.0)))
    if rope_type in ("default", None):
        return theta, None
    if rope_type != "yarn":
        raise ModelError(f"{source}: rope type '{rope_type}' is not supported for {NAME} (default or yarn)")
    return theta, YarnScaling(factor=float(require(params, "factor", source)),
                              original_max_position_embeddings=int(require(params, "original_max_position_embeddings",
                                                                           source)),
                              beta_fast=float(params.get("beta_fast") or 32.0),
                              beta_slow=float(params.get("beta_slow") or 1.0),
                              attention_factor=params.get("attention_factor"),
                              truncate=bool(params.get("truncate", True)))


def config_from_hf(cfg, source):
    hidden = int(require(cfg, "hidden_size", source))
    num_heads = int(require(cfg, "num_attention_heads", source))
    theta, yarn = _yarn_from_hf(cfg, source)
    num_layers = int(require(cfg, "num_hidden_layers", source))
    layer_types = tuple(cfg.get("layer_types") or ())
    if layer_types and (len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}):
        raise ModelError(f"{source}: layer_types must give '{SLIDING}' or '{FULL}' for each of the {num_layers} "
                         f"layers")
    return ModelConfig(
        arch=NAME, vocab_size=int(require(cfg, "vocab_size", source)), hidden_size=hidden, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        num_experts=int(require(cfg, "num_local_experts", source)),
        num_experts_per_tok=int(require(cfg, "num_experts_per_tok", source)),
        moe_intermediate_size=int(require(cfg, "intermediate_size", source)),
        rope_theta=theta, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        context_length=int(cfg.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", True)),
        sliding_window=int(cfg.get("sliding_window") or 0), rope_scaling=yarn, layer_types=layer_types,
    )


def layer_type(config, layer):
    """The HF config's layer_types where it gives them, else llama.cpp's pattern: even layers slide."""
    if config.layer_types:
        return config.layer_types[layer]
    return SLIDING if layer % 2 == 0 else FULL


def recipe_for(config, layer):
    window = config.sliding_window if layer_type(config, layer) == SLIDING else 0
    attention = FullAttention(rope="yarn" if config.rope_scaling is not None else "neox",
                              qkv_bias=config.attention_bias, o_bias=config.attention_bias, window=window, sinks=True)
    return LayerRecipe(mixer=Block("attn_norm", attention),
                       ffn=Block("ffn_norm", MoE(router=TopKSoftmax(), experts=ClampedSwiGLU())))


def write_gguf_hparams(writer, config):
    """The keys llama.cpp's converter writes for gpt-oss beyond the common ones (hybrid/formats/gguf_writer.py)."""
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.moe_intermediate_size)
    writer.add_sliding_window(config.sliding_window)
    yarn = config.rope_scaling
    if yarn is not None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn.factor)
        writer.add_rope_scaling_orig_ctx_len(yarn.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(yarn.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(yarn.beta_slow)
        if yarn.attention_factor is not None:
            writer.add_rope_scaling_yarn_attn_factor(yarn.attention_factor)


SPEC = ArchSpec(
    name=NAME,
    hf_model_types=("gpt_oss",),
    recipe=None,
    recipe_for=recipe_for,
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    norm_names=(("ffn_norm", ("post_attention_norm.weight", "post_attention_layernorm.weight")),),
    write_gguf_hparams=write_gguf_hparams,
)
