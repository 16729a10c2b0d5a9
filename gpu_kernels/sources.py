"""The CUDA/HIP C sources of the kernels, assembled into compilable modules.

A module is "ops" (norms, RoPE, attention merge, SwiGLU, routing, row moves), one per quant format
(its header + the matmul kernels) one per KV storage type ("kv_<type>": the paged KV kernels) or "delta_net" (Gated DeltaNet, sigmoid gates).
Sources need no headers, so NVRTC and hiprtc compile them as they are, with or without a GPU.
"""
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from .gemm import GEMM_FORMATS, GEMM_KERNELS, gemm_defines

SRC = Path(__file__).parent / "src"

FORMAT_HEADERS = {  # quant type -> headers before matmul.cu
    Q.F32: ("float.cuh",), Q.F16: ("float.cuh",), Q.BF16: ("float.cuh",), Q.Q8_0: ("q8_0.cuh",),
    Q.Q4_0: ("q4_0.cuh",), Q.Q4_K: ("kquant.cuh", "q4_k.cuh"), Q.Q5_K: ("kquant.cuh", "q5_k.cuh"),
    Q.Q6_K: ("q6_k.cuh",), Q.Q2_K: ("q2_k.cuh",), Q.Q3_K: ("q3_k.cuh",),
    Q.IQ4_XS: ("levels.cuh", "iq4_xs.cuh"), Q.MXFP4: ("levels.cuh", "mxfp4.cuh"),
    Q.IQ3_S: ("levels.cuh", "iq3_s.cuh"), Q.IQ2_XXS: ("levels.cuh", "iq2_xxs.cuh"),
    Q.Q4_1: ("q4_1.cuh", "block32.cuh"), Q.Q5_0: ("q5_0.cuh", "block32.cuh"),
    Q.Q5_1: ("q5_1.cuh", "block32.cuh"), Q.IQ4_NL: ("levels.cuh", "iq4_nl.cuh", "block32.cuh"),
    Q.IQ3_XXS: ("levels.cuh", "iq3_xxs.cuh", "block32.cuh"), Q.IQ2_XS: ("levels.cuh", "iq2_xs.cuh", "block32.cuh"),
    Q.IQ2_S: ("levels.cuh", "iq2_s.cuh", "block32.cuh"), Q.IQ1_S: ("levels.cuh", "iq1_s.cuh", "block32.cuh"),
    Q.IQ1_M: ("levels.cuh", "iq1_m.cuh", "block32.cuh"),
}
FORMAT_DEFINES = {  # quant type -> the macros its headers read (float.cuh: a weight's size, bits, conversion)
    Q.F32: {"FLOAT_BYTES": "4", "FLOAT_BITS": "u32", "TO_FLOAT": "__uint_as_float"},
    Q.F16: {"FLOAT_BYTES": "2", "FLOAT_BITS": "u16", "TO_FLOAT": "half_to_float"},
    Q.BF16: {"FLOAT_BYTES": "2", "FLOAT_BITS": "u16", "TO_FLOAT": "bf16_to_float"},
    # the levels formats' int16 decode takes x in their nibble lookup's order (common.cuh's XQ_POS)
    Q.IQ4_XS: {"XQ_NIBBLE_ORDER": "1"}, Q.MXFP4: {"XQ_NIBBLE_ORDER": "1"}, Q.IQ4_NL: {"XQ_NIBBLE_ORDER": "1"},
}

# quant type -> (the gguf.quants class whose 16 levels levels.cuh's LEVELS_* hold, {grid name: iq_grids table})
FORMAT_TABLES = {
    Q.IQ4_XS: ("IQ4_NL", {}), Q.MXFP4: ("MXFP4", {}), Q.IQ3_S: ("IQ4_NL", {"IQ3S_GRID": "IQ3_S"}),
    Q.IQ2_XXS: ("IQ4_NL", {"IQ2XXS_GRID": "IQ2_XXS"}), Q.IQ4_NL: ("IQ4_NL", {}),
    Q.IQ3_XXS: ("IQ4_NL", {"IQ3XXS_GRID": "IQ3_XXS"}), Q.IQ2_XS: ("IQ4_NL", {"IQ2XS_GRID": "IQ2_XS"}),
    Q.IQ2_S: ("IQ4_NL", {"IQ2S_GRID": "IQ2_S"}), Q.IQ1_S: ("IQ4_NL", {"IQ1_GRID": "IQ1"}),
    Q.IQ1_M: ("IQ4_NL", {"IQ1_GRID": "IQ1"}),
}

OPS_KERNELS = ("rmsnorm", "rope_neox", "attn_merge", "swiglu", "route_topk", "gather_rows",
               "combine_rows", "decode_tiles", "add_into", "pack_decode", "publish_decode",
               "await_host_add", "route_sigmoid", "add_bias", "attn_sinks", "route_topk_softmax", "clamped_swiglu",
               "add_pair_bias", "add_rmsnorm", "qk_norm_rope", "decode_pairs", "decode_groups", "prompt_groups")
MATMUL_KERNELS = ("matmul", "matmul_1", "moe_matmul", "moe_matmul_1", "moe_matmul2_1", "dequant_rows", "matmul_n")
# one token, x rounded to int16 (formats in INT_DECODE)
INT_DOT_KERNELS = ("matmul_1q", "moe_matmul_1q", "moe_matmul2_1q", "moe_matmul_glu_1q", "matmul_nq", "matmul_1qx",
                   "matmul_nqx", "moe_matmul_1qx", "moe_matmul2_1qx")  # the dots; quantize_xq rounds x for the `_qx`
INT_DECODE_KERNELS = INT_DOT_KERNELS + ("quantize_xq",)
# formats whose header defines INT_DECODE (slice_dot_q)
INT_DECODE = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.MXFP4, Q.IQ3_S})
KV_DEFINES = {"f32": "KV_F32", "f16": "KV_F16", "bf16": "KV_BF16", "int8": "KV_INT8"}  # KV dtype -> kv.cu's type
KV_KERNELS = ("paged_attention", "paged_attention_1", "paged_attention_1s", "paged_attention_merge", "kv_write",
              "paged_prefill")
DELTA_NET_KERNELS = ("delta_conv1d_silu", "delta_gates", "delta_rule", "delta_l2norm", "delta_chunk_prep",
                     "delta_chunk_state", "delta_chunk_out", "rmsnorm_gated", "sigmoid_mul")


def table_shared_bytes(qtype):
    """Static shared memory of qtype's `_1q` kernels besides x: IQ3_S's grid, under its 16 sign patterns (iq3_s.cuh's
    IQ3S_SIGNED_GRID, on unless FORMAT_DEFINES sets it 0: 32 KiB) or as IQ3S_GRID_COPIES copies (default 1), else
    none."""
    if Q(qtype) != Q.IQ3_S:
        return 0
    defines = FORMAT_DEFINES.get(Q.IQ3_S, {})
    if int(defines.get("IQ3S_SIGNED_GRID", 1)):
        return 32768
    return 2048 * int(defines.get("IQ3S_GRID_COPIES", 1))


def module_name(qtype=None):
    return "ops" if qtype is None else f"matmul_{Q(qtype).name.lower()}"


def kv_module_name(kv_dtype):
    if kv_dtype not in KV_DEFINES:
        raise ValueError(f"KV dtype must be one of {', '.join(KV_DEFINES)}, got {kv_dtype!r}")
    return f"kv_{kv_dtype}"


def matmul_kernels(qtype):
    """The kernel names of qtype's matmul module."""
    return (MATMUL_KERNELS + (INT_DECODE_KERNELS if Q(qtype) in INT_DECODE else ())
            + (GEMM_KERNELS if Q(qtype) in GEMM_FORMATS else ()))


def all_modules():
    """Every module: (name, kernel names)."""
    return ([(module_name(), OPS_KERNELS)] + [(module_name(q), matmul_kernels(q)) for q in FORMAT_HEADERS]
            + [(kv_module_name(d), KV_KERNELS) for d in KV_DEFINES] + [("delta_net", DELTA_NET_KERNELS)])


@lru_cache(maxsize=None)
def module_source(name):
    """The full source of module `name` ("ops", "matmul_<type>" or "kv_<type>")."""
    prefix, tables = "", ""
    if name in ("ops", "delta_net"):
        files = ("common.cuh", f"{name}.cu") + (("moe_parts.cu", "routing.cu", "prompt_groups.cu") if name == "ops"
                                                 else ())
    elif name.startswith("kv_"):
        prefix = f"#define {KV_DEFINES[name.removeprefix('kv_')]}\n"
        files = ("common.cuh", "kv.cu", "kv_short.cu", "kv_prefill.cu")
    else:
        qtype = Q[name.removeprefix("matmul_").upper()]
        prefix = "".join(f"#define {key} {value}\n" for key, value in FORMAT_DEFINES.get(qtype, {}).items())
        files = ("common.cuh", *FORMAT_HEADERS[qtype], "matmul.cu") + (("gemm.cu",) if qtype in GEMM_FORMATS else ())
        if qtype in GEMM_FORMATS:
            prefix += gemm_defines(qtype)
        if qtype in FORMAT_TABLES:
            levels, grids = FORMAT_TABLES[qtype]
            prefix += level_defines(levels)
            tables = grid_tables(grids)
    texts = [f"// ---- {f}\n" + (SRC / f).read_text() for f in files]
    return prefix + "\n".join(texts[:1] + [tables] * bool(tables) + texts[1:])


def level_defines(quant):
    """levels.cuh's LEVELS_0 .. LEVELS_3: gguf.quants' `quant` class's 16 int8 levels, four bytes a word."""
    from gguf import quants

    levels = np.array(getattr(quants, quant).kvalues, dtype=np.int8).view(np.uint32)  # [4]
    return "".join(f"#define LEVELS_{i} 0x{int(w):08x}u\n" for i, w in enumerate(levels))


def grid_tables(grids):
    """Device constants of IQ grids: {C name: cpu_kernels.iq_grids table name}, the same tables the CPU reads,
    one row's values packed into words (4 values a word, little-endian)."""
    from cpu_kernels import iq_grids

    out = "// ---- grid tables (sources.py, from cpu_kernels.iq_grids)\n"
    for c_name, table_name in grids.items():
        words = np.ascontiguousarray(getattr(iq_grids, table_name)).view(np.uint32).ravel()
        body = ",".join(f"0x{int(w):08x}u" for w in words)
        out += f"static const __device__ u32 {c_name}[{len(words)}] = {{{body}}};\n"
    return out
