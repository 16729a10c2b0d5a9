"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B): GQA with per-head
q/k RMSNorm, NeoX RoPE, softmax top-k routing (norm_topk_prob), SwiGLU experts. A GGUF file may carry NextN
(MTP) layers after the decoder layers as glm4moe's do (`nextn_predict_layers`, blk.L: a decoder layer and its
nextn.* tensors): Qwen3-MoE checkpoints have none, bench/train_mtp.py trains one for a drafter."""
from ..errors import ModelError
from ..formats.weights import ModelConfig
from .base import ArchSpec, require
from .recipe import Block, FullAttention, LayerRecipe, MoE, SoftmaxTopK, SwiGLU

NAME = "qwen3moe"


def config_from_gguf(fields, source, vocab_size, tie_word_embeddings, tensor_names=()):
    def key(suffix, default=None):
        value = fields.get(f"{NAME}.{suffix}", default)
        if value is None:
            raise ModelError(f"{source}: missing GGUF metadata '{NAME}.{suffix}'")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    nextn = int(key("nextn_predict_layers", 0))
    return ModelConfig(
        arch=NAME,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=int(key("block_count")) - nextn,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        context_length=int(key("context_length")),
        norm_topk_prob=bool(key("expert_weights_norm", True)),
        tie_word_embeddings=tie_word_embeddings,
        num_nextn_layers=nextn,
    )


def _rope_theta_from_hf(cfg, source):
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelError(f"{source}: rope type '{rope_type}' is not supported yet (only default RoPE)")
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def config_from_hf(cfg, source):
    if cfg.get("mlp_only_layers"):
        raise ModelError(f"{source}: dense layers (mlp_only_layers={cfg['mlp_only_layers']}) are not supported")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ModelError(f"{source}: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (only 1)")
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise ModelError(f"{source}: missing field 'num_experts' (or 'num_local_experts')")
    hidden = int(require(cfg, "hidden_size", source))
    num_heads = int(require(cfg, "num_attention_heads", source))
    return ModelConfig(
        arch=NAME,
        vocab_size=int(require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(require(cfg, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        num_experts=int(num_experts),
        num_experts_per_tok=int(require(cfg, "num_experts_per_tok", source)),
        moe_intermediate_size=int(require(cfg, "moe_intermediate_size", source)),
        rope_theta=_rope_theta_from_hf(cfg, source),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_length=int(cfg.get("max_position_embeddings", 32768)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def nextn_tensors(config):
    """{name: shape} of the NextN layers' tensors: a decoder layer, eh_proj [H, 2H], enorm, hnorm, shared_head_norm."""
    c, shapes = config, {}
    for layer in range(c.num_layers, c.num_layers + c.num_nextn_layers):
        shapes.update((f"blk.{layer}.{t.gguf}", tuple(t.shape(c))) for t in SPEC.layer_tensors(c, layer))
        shapes[f"blk.{layer}.nextn.eh_proj.weight"] = (c.hidden_size, 2 * c.hidden_size)
        shapes.update((f"blk.{layer}.nextn.{n}.weight", (c.hidden_size,))
                      for n in ("enorm", "hnorm", "shared_head_norm"))
    return shapes


def write_gguf_hparams(writer, config):
    """block_count counts the NextN layers (as llama.cpp's glm4moe files do); the experts' width as
    feed_forward_length."""
    writer.add_block_count(config.num_layers + config.num_nextn_layers)
    writer.add_feed_forward_length(config.moe_intermediate_size)
    if config.num_nextn_layers:
        writer.add_nextn_predict_layers(config.num_nextn_layers)


SPEC = ArchSpec(
    name=NAME,
    hf_model_types=("qwen3_moe",),
    recipe=LayerRecipe(mixer=Block("attn_norm", FullAttention(qk_norm=True, rope="neox")),
                       ffn=Block("ffn_norm", MoE(router=SoftmaxTopK(), experts=SwiGLU()))),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    extra_tensors=nextn_tensors,
    write_gguf_hparams=write_gguf_hparams,
)
