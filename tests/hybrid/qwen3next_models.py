"""Tiny random Qwen3-Next and Qwen3.5-MoE models for the tests: made by transformers (float32), saved as HF
directories, turned into GGUF tensors as llama.cpp's convert_hf_to_gguf.py turns them (Qwen3NextModel.modify_tensors:
its names through gguf-py's tensor map, A_log -> -exp(A_log), conv weights squeezed to [C, W], RMSNorm weights + 1
but the gated norm's, in_proj_qkvz split into attn_qkv (q heads, k heads, v heads) and attn_gate, per-expert
weights stacked; Qwen3.5's value heads reordered from grouped by key head to tiled,
_LinearAttentionVReorderBase), and back: the reference model runs on the weights the GGUF file holds, dequantized."""
import json
import os

import numpy as np

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, intermediate_size=64, max_position_embeddings=2048,
            rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1)


def _classes(qwen35):
    import transformers

    if qwen35:
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    return transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM


def make_hf_model(vocab_size, seed=0, qwen35=False, **overrides):
    import torch

    config_class, model_class = _classes(qwen35)
    torch.manual_seed(seed)
    model = model_class(config_class(vocab_size=vocab_size, **{**TINY, **overrides})).float().eval()
    with torch.no_grad():  # norms (1 + w) and gates away from their initial values, so they are exercised
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
    return model


def save_hf_dir(model, directory, save_tokenizer_files, tokenizer):
    model.save_pretrained(directory)
    save_tokenizer_files(tokenizer, directory)
    return directory


def _hf_tensors(directory):
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def reorder_v_heads(x, axis, num_k_heads, num_v_per_k, head_dim, to_tiled=True):
    """The converter's _reorder_v_heads: value heads along `axis` from grouped by key head to tiled (or back)."""
    shape = list(x.shape)
    groups = (num_k_heads, num_v_per_k) if to_tiled else (num_v_per_k, num_k_heads)
    x = x.reshape(shape[:axis] + [*groups, head_dim] + shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(x, axis, axis + 1)).reshape(shape)


def _tiled(name, data, hk, hv, dk, dv):
    """Qwen3.5's linear-attention tensors with their value heads tiled (_LinearAttentionVReorderBase)."""
    rep, qk = hv // hk, 2 * hk * dk
    if ".in_proj_qkv." in name:
        return np.concatenate([data[:qk], reorder_v_heads(data[qk:], 0, hk, rep, dv)])
    if ".in_proj_z." in name:
        return reorder_v_heads(data, 0, hk, rep, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return reorder_v_heads(data, 0, hk, rep, 1)
    if ".conv1d." in name:
        return np.concatenate([data[:qk], reorder_v_heads(data[qk:], 0, hk, rep, dv)])
    if ".out_proj." in name:
        return reorder_v_heads(data, 1, hk, rep, dv)
    return data


def gguf_float_tensors(directory):
    """{GGUF name: float32 array} of an HF directory, as llama.cpp's converter makes them."""
    import gguf

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    qwen35 = cfg["model_type"].startswith("qwen3_5")
    arch = gguf.MODEL_ARCH.QWEN35MOE if qwen35 else gguf.MODEL_ARCH.QWEN3NEXT
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    out, experts = {}, {}
    for name, data in _hf_tensors(directory).items():
        data = data.astype(np.float32)
        if qwen35 and hk != hv and "linear_attn." in name:
            data = _tiled(name, data, hk, hv, dk, dv)
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.proj.weight: stacked per layer and proj
            layer, _, _, e, proj = name.split(".")[2:7]
            experts.setdefault((int(layer), proj), {})[int(e)] = data
            continue
        if name.endswith(".A_log"):
            data = -np.exp(data)
        elif name.endswith(".dt_bias"):
            name = name[: -len("dt_bias")] + "dt_proj.bias"
        elif "conv1d" in name:
            data = data.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            data = data + 1
        if name.endswith("in_proj_qkvz.weight"):
            block = data.reshape(hk, 2 * dk + 2 * hv // hk * dv, -1)  # per key head: q, k, its v heads, their z
            q, k, v, z = np.split(block, np.cumsum([dk, dk, hv // hk * dv])[:3], axis=1)
            prefix = f"blk.{name.split('.')[2]}"
            out[f"{prefix}.attn_qkv.weight"] = np.concatenate([x.reshape(-1, data.shape[1]) for x in (q, k, v)])
            out[f"{prefix}.attn_gate.weight"] = z.reshape(-1, data.shape[1])
            continue
        base, suffix = (name.rsplit(".", 1) if name.endswith((".weight", ".bias")) else (name, None))
        gguf_name = names.get_name(base)
        out[gguf_name + (f".{suffix}" if suffix else "")] = np.ascontiguousarray(data)
    for (layer, proj), by_expert in experts.items():
        kind = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[proj]
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def hf_state_dict(canonical, config):
    """The transformers (in-memory) state dict of GGUF-named float tensors: the converter's changes undone."""
    import torch

    from hybrid.arch.qwen3next import is_full_attention

    c = config
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    state = {"model.embed_tokens.weight": canonical["token_embd.weight"],
             "model.norm.weight": canonical["output_norm.weight"] - 1, "lm_head.weight": canonical["output.weight"]}
    for i in range(c.num_layers):
        def t(suffix):
            return canonical[f"blk.{i}.{suffix}"]

        p = f"model.layers.{i}."
        state.update({p + "input_layernorm.weight": t("attn_norm.weight") - 1,
                      p + "post_attention_layernorm.weight": t("post_attention_norm.weight") - 1,
                      p + "mlp.gate.weight": t("ffn_gate_inp.weight"),
                      p + "mlp.experts.gate_up_proj": np.concatenate([t("ffn_gate_exps.weight"),
                                                                     t("ffn_up_exps.weight")], axis=1),
                      p + "mlp.experts.down_proj": t("ffn_down_exps.weight"),
                      p + "mlp.shared_expert.gate_proj.weight": t("ffn_gate_shexp.weight"),
                      p + "mlp.shared_expert.up_proj.weight": t("ffn_up_shexp.weight"),
                      p + "mlp.shared_expert.down_proj.weight": t("ffn_down_shexp.weight"),
                      p + "mlp.shared_expert_gate.weight": t("ffn_gate_inp_shexp.weight").reshape(1, -1)})
        if is_full_attention(c, i):
            state.update({p + "self_attn.q_proj.weight": t("attn_q.weight"),
                          p + "self_attn.k_proj.weight": t("attn_k.weight"),
                          p + "self_attn.v_proj.weight": t("attn_v.weight"),
                          p + "self_attn.o_proj.weight": t("attn_output.weight"),
                          p + "self_attn.q_norm.weight": t("attn_q_norm.weight") - 1,
                          p + "self_attn.k_norm.weight": t("attn_k_norm.weight") - 1})
            continue
        if c.arch == "qwen35moe":
            state.update(_qwen35_linear(p, t, hk, hv, dk, dv))
            continue
        qkv, z = t("attn_qkv.weight"), t("attn_gate.weight")
        q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
        per_head = [x.reshape(hk, -1, qkv.shape[1]) for x in (q, k, v, z)]
        state.update({p + "linear_attn.in_proj_qkvz.weight": np.concatenate(per_head, axis=1).reshape(-1, qkv.shape[1]),
                      p + "linear_attn.in_proj_ba.weight": t("ssm_ba.weight"),
                      p + "linear_attn.conv1d.weight": t("ssm_conv1d.weight")[:, None, :],
                      p + "linear_attn.A_log": np.log(-t("ssm_a")), p + "linear_attn.dt_bias": t("ssm_dt.bias"),
                      p + "linear_attn.norm.weight": t("ssm_norm.weight"),
                      p + "linear_attn.out_proj.weight": t("ssm_out.weight")})
    return {name: torch.from_numpy(np.array(x, dtype=np.float32)) for name, x in state.items()}


def _qwen35_linear(prefix, t, hk, hv, dk, dv):
    """A Qwen3.5 linear-attention layer's HF tensors from its GGUF ones (value heads back to grouped order)."""
    rep, qk = hv // hk, 2 * hk * dk

    def grouped(x, axis, head_dim):
        return reorder_v_heads(x, axis, hk, rep, head_dim, to_tiled=False) if hk != hv else x

    qkv, conv = t("attn_qkv.weight"), t("ssm_conv1d.weight")
    p = prefix + "linear_attn."
    return {p + "in_proj_qkv.weight": np.concatenate([qkv[:qk], grouped(qkv[qk:], 0, dv)]),
            p + "in_proj_z.weight": grouped(t("attn_gate.weight"), 0, dv),
            p + "in_proj_b.weight": grouped(t("ssm_beta.weight"), 0, 1),
            p + "in_proj_a.weight": grouped(t("ssm_alpha.weight"), 0, 1),
            p + "conv1d.weight": np.concatenate([conv[:qk], grouped(conv[qk:], 0, dv)])[:, None, :],
            p + "A_log": np.log(-grouped(t("ssm_a"), 0, 1)), p + "dt_bias": grouped(t("ssm_dt.bias"), 0, 1),
            p + "norm.weight": t("ssm_norm.weight"), p + "out_proj.weight": grouped(t("ssm_out.weight"), 1, dv)}


def reference_model(hf_dir, canonical, config):
    """The transformers model (float32) with the weights of `canonical` (GGUF-named float tensors of the file)."""
    import torch

    model = _classes(config.arch == "qwen35moe")[1].from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.load_state_dict(hf_state_dict(canonical, config), strict=True)
    return model


def mtp_tensors(floats, config, rng):
    """An MTP layer after the decoder layers as Qwen3.5's converter names it (_Qwen35MtpMixin): a gated-attention MoE
    decoder layer (here the last one's weights) and its nextn.eh_proj [H, 2H], enorm, hnorm, shared_head_norm [H]."""
    last, mtp, h = config.num_layers - 1, config.num_layers, config.hidden_size
    out = {name.replace(f"blk.{last}.", f"blk.{mtp}.", 1): x for name, x in floats.items()
           if name.startswith(f"blk.{last}.")}
    out[f"blk.{mtp}.nextn.eh_proj.weight"] = (0.1 * rng.standard_normal((h, 2 * h))).astype(np.float32)
    for name in ("enorm", "hnorm", "shared_head_norm"):
        out[f"blk.{mtp}.nextn.{name}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return out


def write_qwen3next_gguf(hf_dir, path, target, tokenizer, mtp=False):
    """A GGUF file of `target` type from an HF directory, as llama.cpp's converter writes it (then quantized as
    hybrid.formats.synthetic does), with an MTP layer where `mtp`; returns ({GGUF name: float32 weights the file
    holds}, ModelConfig)."""
    from dataclasses import replace

    from hybrid.arch.qwen3next import hf_config
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model
    from hybrid.weight_formats import dequantize

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = hf_config(json.load(f), hf_dir)
    floats = gguf_float_tensors(hf_dir)
    if mtp:
        floats.update(mtp_tensors(floats, config, np.random.default_rng(2)))
        config = replace(config, num_nextn_layers=1)
    tensors = encode_model(floats, target, np.random.default_rng(1))
    write_gguf(path, config, tensors.values(), tokenizer, name=f"tiny-qwen3next-{target}")
    return {name: dequantize(t) for name, t in tensors.items()}, config
