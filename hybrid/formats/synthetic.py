"""Turn float weights into GGUF tensors of a chosen type (tests, benchmarks, the demo model).

F32, F16, BF16, Q8_0 and Q4_0 are quantized for real by gguf-py. gguf-py has
no K-quant quantizer, so Q4_K / Q5_K / Q6_K tensors are random valid blocks
at the weights' scale: the values change, which is fine for synthetic models;
references then run on the weights dequantized from the file.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from .weights import QuantTensor

GGUF_QUANTIZERS = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0)

# Tensor name suffixes that stay F32 whatever the target type (as llama.cpp does).
KEEP_F32 = ("_norm.weight", "ffn_gate_inp.weight")

# llama.cpp's Q4_K_M gives these Q6_K; the rest of the matrices Q4_K.
Q4_K_M_UPGRADES = ("attn_v.weight", "ffn_down_exps.weight", "output.weight")


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
    """The GGML type a tensor gets in a file whose main type is `target` ('Q4_K_M' or a type name)."""
    if len(shape) == 1 or name.endswith(KEEP_F32):
        return Q.F32
    if target == "Q4_K_M":
        qtype = Q.Q6_K if name.endswith(Q4_K_M_UPGRADES) else Q.Q4_K
    else:
        qtype = Q[target]
    block_size = GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block_size:
        # llama.cpp falls back to a smaller block for rows that do not split evenly.
        qtype = Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16
    return qtype


def encode_model(float_tensors, target, rng):
    """{canonical name: float array} -> {name: QuantTensor} in the mix `target` names."""
    return {name: encode(name, values, type_for(name, values.shape, target), rng)
            for name, values in float_tensors.items()}
