"""Turn float weights into GGUF tensors of a chosen type or mix (tests, benchmarks, the demo model).

The types gguf-py quantizes (GGUF_QUANTIZERS) are quantized for real. gguf-py has no
K-quant or IQ quantizer, so those tensors are random valid blocks at the weights'
scale (each format module's random_blocks): the values change, which is fine for
synthetic models; references then run on the weights dequantized from the file.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from .weights import QuantTensor

GGUF_QUANTIZERS = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4)

# Tensor name suffixes that stay F32 whatever the target type (as llama.cpp does).
KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight", ".bias", "attn_sinks.weight")

# Mixes of several types, as llama.cpp's and Unsloth's files have: name -> (the matrices' main type,
# {tensor name suffix: its type}). Any other target is one type name for every matrix.
MIXES = {
    # llama.cpp's Q4_K_M
    "Q4_K_M": (Q.Q4_K, {"attn_v.weight": Q.Q6_K, "ffn_down_exps.weight": Q.Q6_K, "output.weight": Q.Q6_K}),
    # like llama.cpp's Q3_K_M: the tensors that lose the most to 3 bits get Q4_K / Q5_K, the head Q6_K
    "Q3_K_M": (Q.Q3_K, {"attn_v.weight": Q.Q5_K, "attn_output.weight": Q.Q4_K, "ffn_down_exps.weight": Q.Q4_K,
                        "output.weight": Q.Q6_K}),
    # gpt-oss's files (llama.cpp's MXFP4_MOE): MXFP4 experts, the dense weights Q8_0
    "MXFP4_MOE": (Q.Q8_0, {"ffn_gate_exps.weight": Q.MXFP4, "ffn_up_exps.weight": Q.MXFP4,
                           "ffn_down_exps.weight": Q.MXFP4}),
    # like Unsloth's dynamic ("UD") files: many types in one file, the experts at 2 to 4 bits
    "UD_MIX": (Q.IQ4_XS, {"attn_k.weight": Q.Q2_K, "attn_v.weight": Q.Q6_K, "attn_output.weight": Q.Q3_K,
                          "ffn_gate_exps.weight": Q.IQ2_XXS, "ffn_up_exps.weight": Q.IQ3_S,
                          "ffn_down_exps.weight": Q.IQ4_XS, "output.weight": Q.Q6_K, "token_embd.weight": Q.Q4_K}),
}


def encode(name, values, qtype, rng):
    """values: float32 [..., R, C] -> QuantTensor of `qtype`."""
    qtype = Q(qtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype in GGUF_QUANTIZERS:
        raw = gguf_quants.quantize(values, qtype)
        raw = np.ascontiguousarray(raw).view(np.uint8)
    else:
        from cpu_kernels.formats import format_for

        raw = format_for(qtype).random_blocks(rng, values.shape, float(np.std(values)) or 1e-3)
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = raw.reshape(*values.shape[:-1], values.shape[-1] // block_size * block_bytes)
    return QuantTensor(name, qtype, tuple(values.shape), raw)


def type_for(name, shape, target):
    """The GGML type a tensor gets in a file whose main type is `target` (a MIXES name or a type name)."""
    if len(shape) == 1 or name.endswith(KEEP_F32):
        return Q.F32
    main, overrides = MIXES.get(target, (None, {}))
    qtype = next((q for suffix, q in overrides.items() if name.endswith(suffix)), main or Q[target])
    block_size = GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block_size:
        # llama.cpp falls back to a smaller block for rows that do not split evenly.
        qtype = Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16
    return qtype


def encode_model(float_tensors, target, rng):
    """{canonical name: float array} -> {name: QuantTensor} in the mix `target` names."""
    return {name: encode(name, values, type_for(name, values.shape, target), rng)
            for name, values in float_tensors.items()}


def mix_types(target):
    """Every matrix type a file of `target` (a MIXES name or a type name) may hold, F32 for the norms aside."""
    main, overrides = MIXES[target] if target in MIXES else (Q[target], {})
    return {main, *overrides.values()}
