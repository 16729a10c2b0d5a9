"""Qwen3-Next / Qwen3.5-MoE HF directories read into the tensors llama.cpp's converter would write
(hybrid/arch/qwen3next.py says which): rows and columns moved on the raw F32 / F16 / BF16 bytes (qwen3next's
in_proj_qkvz split into attn_qkv and attn_gate; Qwen3.5's value heads tiled), the few vectors changed in float32
(A_log -> -exp(A_log), RMSNorm weights + 1 but the gated norm's), the conv weight squeezed to [C, W], per-expert
weights stacked. Shape legend: H hidden, Hk / Hv key / value heads, Dk / Dv their head dims, R rows, C columns.
"""
import numpy as np
from gguf import GGMLQuantizationType as Q

from ..errors import ModelError
from ..formats.weights import QuantTensor
from ..weight_formats import dequantize

ITEM = {Q.F32: np.uint32, Q.F16: np.uint16, Q.BF16: np.uint16}  # one element of a raw row


def _rows(t, name, index):
    return QuantTensor(name, t.qtype, (len(index), *t.shape[1:]), np.ascontiguousarray(t.raw[index]))


def _columns(t, name, index):
    raw = t.raw.view(ITEM[t.qtype])[:, index]
    return QuantTensor(name, t.qtype, (t.shape[0], len(index)), np.ascontiguousarray(raw).view(np.uint8))


def _float(name, values):
    values = np.ascontiguousarray(values, np.float32)
    return QuantTensor(name, Q.F32, values.shape, values.view(np.uint8).reshape(*values.shape[:-1], -1))


def _tiled(num_k_heads, num_v_heads, head_dim):
    """Index of value-head rows in tiled order (head r * Hk + kh holds grouped head kh * rep + r)."""
    rep = num_v_heads // num_k_heads
    return np.arange(num_v_heads * head_dim).reshape(num_k_heads, rep, head_dim).transpose(1, 0, 2).reshape(-1)


def linear_tensors(fetch, prefix, blk, config):
    """A linear-attention layer's canonical tensors from `fetch(hf name)`."""
    c = config
    hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    rep, qk = hv // hk, 2 * hk * dk
    tiled = c.arch == "qwen35moe" and hk != hv
    v_order = _tiled(hk, hv, dv) if tiled else np.arange(hv * dv)
    h_order = _tiled(hk, hv, 1) if tiled else np.arange(hv)
    out = {}
    if c.arch == "qwen3next":  # rows per key head: q, k, its value heads' v, their z
        per_head = 2 * dk + 2 * rep * dv
        base = np.arange(hk)[:, None] * per_head
        runs = [np.arange(dk), dk + np.arange(dk), 2 * dk + np.arange(rep * dv), 2 * dk + rep * dv + np.arange(rep * dv)]
        q, k, v, z = ((base + r).reshape(-1) for r in runs)
        qkvz = fetch(prefix + "in_proj_qkvz.weight")
        out["attn_qkv.weight"] = _rows(qkvz, f"{blk}.attn_qkv.weight", np.concatenate([q, k, v]))
        out["attn_gate.weight"] = _rows(qkvz, f"{blk}.attn_gate.weight", z)
        out["ssm_ba.weight"] = fetch(prefix + "in_proj_ba.weight")
    else:
        out["attn_qkv.weight"] = _rows(fetch(prefix + "in_proj_qkv.weight"), f"{blk}.attn_qkv.weight",
                                       np.concatenate([np.arange(qk), qk + v_order]))
        out["attn_gate.weight"] = _rows(fetch(prefix + "in_proj_z.weight"), f"{blk}.attn_gate.weight", v_order)
        out["ssm_beta.weight"] = _rows(fetch(prefix + "in_proj_b.weight"), f"{blk}.ssm_beta.weight", h_order)
        out["ssm_alpha.weight"] = _rows(fetch(prefix + "in_proj_a.weight"), f"{blk}.ssm_alpha.weight", h_order)
    conv = dequantize(fetch(prefix + "conv1d.weight")).reshape(qk + hv * dv, -1)
    out["ssm_conv1d.weight"] = _float(f"{blk}.ssm_conv1d.weight", conv[np.concatenate([np.arange(qk), qk + v_order])])
    out["ssm_a"] = _float(f"{blk}.ssm_a", -np.exp(dequantize(fetch(prefix + "A_log"))[h_order]))
    out["ssm_dt.bias"] = _float(f"{blk}.ssm_dt.bias", dequantize(fetch(prefix + "dt_bias"))[h_order])
    out["ssm_norm.weight"] = fetch(prefix + "norm.weight")
    out["ssm_out.weight"] = _columns(fetch(prefix + "out_proj.weight"), f"{blk}.ssm_out.weight", v_order)
    return out


def hf_tensors(fetch, config, spec, source):
    """{canonical name: QuantTensor} of an HF directory (fetch(hf name) -> its QuantTensor)."""
    c, tensors = config, {}

    def plus_one(name, hf_name):
        return _float(name, dequantize(fetch(hf_name)) + 1.0)

    tensors["token_embd.weight"] = fetch("model.embed_tokens.weight")
    tensors["output_norm.weight"] = plus_one("output_norm.weight", "model.norm.weight")
    if not c.tie_word_embeddings:
        tensors["output.weight"] = fetch("lm_head.weight")
    for layer in range(c.num_layers):
        blk, prefix = f"blk.{layer}", f"model.layers.{layer}."
        for t in spec.layer_tensors(c, layer):
            name = f"{blk}.{t.gguf}"
            if t.gguf.startswith(("attn_qkv", "attn_gate", "ssm_")):
                continue  # the linear-attention tensors, below
            if t.stacked:
                parts = [fetch(prefix + t.hf.replace("shared_experts", "shared_expert").format(e=e))
                         for e in range(c.num_experts)]
                tensors[name] = QuantTensor(name, parts[0].qtype, (len(parts), *parts[0].shape),
                                            np.stack([p.raw for p in parts]))
            elif t.gguf.endswith("norm.weight"):  # the HF models scale by 1 + w
                tensors[name] = plus_one(name, prefix + t.hf)
            else:
                tensors[name] = fetch(prefix + t.hf.replace("shared_experts", "shared_expert"))
                tensors[name].name = name
        if not any(t.gguf == "attn_q.weight" for t in spec.layer_tensors(c, layer)):
            tensors.update({f"{blk}.{k}": v for k, v in
                            linear_tensors(fetch, prefix + "linear_attn.", blk, c).items()})
    if c.num_nextn_layers:
        raise ModelError(f"{source}: MTP layers of an HF directory are not read yet")
    return tensors
