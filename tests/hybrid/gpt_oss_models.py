"""Tiny random gpt-oss models for the tests: transformers' GptOssForCausalLM (float32), written as GGUF files by our
writer with the tensors llama.cpp's converter makes of it (gate/up split from the interleaved gate_up_proj, experts
transposed to [E, R, C], sinks as attn_sinks.weight), and the HF model on the file's dequantized weights (the
reference of a quantized file)."""
import numpy as np

# odd sizes where MXFP4's and Q8_0's 32-column blocks allow; four layers (sliding, full, sliding, full) with a
# window of 8 so that a short prompt crosses it; YaRN over an original context of 64
GPT_OSS_TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3,
                    sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.1,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 64,
                                     "rope_theta": 150000.0})


def make_gpt_oss_hf_model(vocab_size, seed=0, **overrides):
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=vocab_size, **{**GPT_OSS_TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, biases and sinks away from 0; experts large enough to meet the clamp
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias") or name.endswith("sinks"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "experts" in name:
                p.copy_(0.6 * torch.randn_like(p))
    return model


def gguf_float_tensors(model):
    """{GGUF name: float32 array} of the HF model as llama.cpp's converter names and lays them out."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(model.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        gate_up = sd[p + "mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # [E, 2F, H]
        gate_up_bias = sd[p + "mlp.experts.gate_up_proj_bias"]  # [E, 2F]
        out.update({
            b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
            b + "post_attention_norm.weight": sd[p + "post_attention_layernorm.weight"],
            **{b + f"attn_{x}.{kind}": sd[p + f"self_attn.{x}_proj.{kind}"]
               for x in "qkv" for kind in ("weight", "bias")},
            b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            b + "attn_output.bias": sd[p + "self_attn.o_proj.bias"],
            b + "attn_sinks.weight": sd[p + "self_attn.sinks"],
            b + "ffn_gate_inp.weight": sd[p + "mlp.router.weight"],
            b + "ffn_gate_inp.bias": sd[p + "mlp.router.bias"],
            b + "ffn_gate_exps.weight": np.ascontiguousarray(gate_up[:, ::2]),
            b + "ffn_up_exps.weight": np.ascontiguousarray(gate_up[:, 1::2]),
            b + "ffn_down_exps.weight": np.ascontiguousarray(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1)),
            b + "ffn_gate_exps.bias": np.ascontiguousarray(gate_up_bias[:, ::2]),
            b + "ffn_up_exps.bias": np.ascontiguousarray(gate_up_bias[:, 1::2]),
            b + "ffn_down_exps.bias": sd[p + "mlp.experts.down_proj_bias"],
        })
    return out


def write_gpt_oss_gguf(model, tokenizer, path, target):
    """The HF model as a GGUF of `target` (F32 or a type / mix of hybrid/formats/synthetic.py); returns the
    {name: QuantTensor} written."""
    from hybrid.arch.gpt_oss import config_from_hf
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model

    config = config_from_hf(model.config.to_dict(), "tiny gpt-oss")
    tensors = encode_model(gguf_float_tensors(model), target, np.random.default_rng(1))
    write_gguf(path, config, tensors.values(), tokenizer, name=f"tiny-gpt-oss-{target}")
    return tensors


def load_dequantized(model, tensors):
    """The HF model with every weight replaced by the written tensors' values as gguf-py dequantizes them."""
    import torch
    from gguf.quants import dequantize

    values = {name: np.asarray(dequantize(t.raw, t.qtype), dtype=np.float32).reshape(t.shape)
              for name, t in tensors.items()}
    sd = model.state_dict()
    sd["model.embed_tokens.weight"] = values["token_embd.weight"]
    sd["lm_head.weight"] = values["output.weight"]
    sd["model.norm.weight"] = values["output_norm.weight"]
    for i in range(model.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for x in "qkv":
            for kind in ("weight", "bias"):
                sd[p + f"self_attn.{x}_proj.{kind}"] = values[b + f"attn_{x}.{kind}"]
        for hf_name, name in (("self_attn.o_proj.weight", "attn_output.weight"), ("self_attn.o_proj.bias",
                              "attn_output.bias"), ("self_attn.sinks", "attn_sinks.weight"),
                              ("mlp.router.weight", "ffn_gate_inp.weight"), ("mlp.router.bias", "ffn_gate_inp.bias"),
                              ("input_layernorm.weight", "attn_norm.weight"),
                              ("post_attention_layernorm.weight", "post_attention_norm.weight"),
                              ("mlp.experts.down_proj_bias", "ffn_down_exps.bias")):
            sd[p + hf_name] = values[b + name]
        for hf_name, gate, up in (("mlp.experts.gate_up_proj", "ffn_gate_exps.weight", "ffn_up_exps.weight"),
                                  ("mlp.experts.gate_up_proj_bias", "ffn_gate_exps.bias", "ffn_up_exps.bias")):
            both = np.empty(sd[p + hf_name].shape, np.float32)  # [E, H, 2F] / [E, 2F], gate and up interleaved
            both[..., ::2], both[..., 1::2] = (np.swapaxes(values[b + n], -1, -2) if values[b + n].ndim == 3
                                               else values[b + n] for n in (gate, up))
            sd[p + hf_name] = both
        sd[p + "mlp.experts.down_proj"] = values[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
    model.load_state_dict({k: torch.as_tensor(np.ascontiguousarray(v)) for k, v in sd.items()})
    return model


def hf_logits(model, token_ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()


def hf_greedy(model, token_ids, num_tokens):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
