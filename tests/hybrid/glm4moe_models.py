"""Tiny random glm4moe models for the tests: transformers' Glm4MoeForCausalLM (float32) saved as an HF directory,
and GGUF files of it written by our writer with llama.cpp's names, a random NextN layer added."""
import dataclasses
import os

import numpy as np

# odd sizes where Q8_0's 32-column blocks allow; one leading dense layer, two MoE layers, 2 of 4 expert groups
GLM_TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=3, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.1,
                tie_word_embeddings=False)
# K-quants need rows of whole 256-weight super-blocks
GLM_KQUANT = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64, num_hidden_layers=2)


def make_glm_hf_model(vocab_size, seed=0, **overrides):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(vocab_size=vocab_size, **{**GLM_TINY, **overrides})
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # norms away from 1, biases and the choice bias away from 0: all of them exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn_like(buf))
    return model


def save_glm_hf_dir(directory, tokenizer, **overrides):
    from tests.conftest import save_tokenizer_files

    make_glm_hf_model(tokenizer.vocab_size, **overrides).save_pretrained(directory)
    save_tokenizer_files(tokenizer, directory)
    return directory


def nextn_float_tensors(config, rng):
    """Random float tensors of one NextN layer after the decoder layers (its decoder layer and its own)."""
    from hybrid.arch.glm4moe import nextn_tensors

    out = {}
    for name, shape in nextn_tensors(config).items():
        values = rng.standard_normal(shape).astype(np.float32)
        out[name] = 1.0 + 0.2 * values if len(shape) == 1 else 0.1 * values
    return out


def write_glm_gguf(hf_dir, path, target, num_nextn=1):
    """The HF directory's model as a GGUF of `target` (F32 or a type / mix of hybrid/formats/synthetic.py), with
    num_nextn random NextN layers; returns the path."""
    from hybrid.formats import load_model
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model
    from tests.conftest import float_tensors

    weights = load_model(hf_dir)
    config = dataclasses.replace(weights.config, num_nextn_layers=num_nextn)
    values = {**float_tensors(weights), **nextn_float_tensors(config, np.random.default_rng(3))}
    tensors = encode_model(values, target, np.random.default_rng(1))
    write_gguf(path, config, tensors.values(), weights.tokenizer, name=f"tiny-glm4moe-{target}")
    return path


def glm_reference(model_dir):
    import torch
    from transformers import Glm4MoeForCausalLM

    return Glm4MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def glm_logits(model_dir, token_ids):
    import torch

    with torch.no_grad():
        return glm_reference(model_dir)(torch.tensor([token_ids])).logits[0].numpy()


def glm_greedy(model_dir, token_ids, num_tokens):
    import torch

    with torch.no_grad():
        out = glm_reference(model_dir).generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=num_tokens,
                                                min_new_tokens=num_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def reference_dir(gguf_path, hf_dir, out_dir):
    """An HF directory of the GGUF's weights as gguf-py dequantizes them (the reference of a quantized file)."""
    from tests.conftest import write_hf_dir_from_gguf

    return write_hf_dir_from_gguf(gguf_path, hf_dir, os.path.join(out_dir, "ref"))
