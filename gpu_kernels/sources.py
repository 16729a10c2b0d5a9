"""The CUDA/HIP C sources of the kernels, assembled into compilable modules.

A module is "ops" (norms, RoPE, attention, SwiGLU, routing, row moves) or one per quant format
(its header + the matmul kernels). Sources need no headers, so NVRTC and hiprtc compile them
as they are, with or without a GPU.
"""
from functools import lru_cache
from pathlib import Path

from gguf import GGMLQuantizationType as Q

SRC = Path(__file__).parent / "src"

FORMAT_HEADERS = {  # quant type -> headers before matmul.cu
    Q.F32: ("f32.cuh",), Q.F16: ("f16.cuh",), Q.BF16: ("bf16.cuh",), Q.Q8_0: ("q8_0.cuh",),
    Q.Q4_0: ("q4_0.cuh",), Q.Q4_K: ("kquant.cuh", "q4_k.cuh"), Q.Q5_K: ("kquant.cuh", "q5_k.cuh"),
    Q.Q6_K: ("q6_k.cuh",),
}

OPS_KERNELS = ("rmsnorm", "rope_neox", "attention", "swiglu", "route_topk", "gather_rows", "combine_rows",
               "decode_tiles", "add_into")
MATMUL_KERNELS = ("matmul", "matmul_1", "moe_matmul", "moe_matmul_1", "dequant_rows")


def module_name(qtype=None):
    return "ops" if qtype is None else f"matmul_{Q(qtype).name.lower()}"


def all_modules():
    """Every module: (name, kernel names)."""
    return [(module_name(), OPS_KERNELS)] + [(module_name(q), MATMUL_KERNELS) for q in FORMAT_HEADERS]


@lru_cache(maxsize=None)
def module_source(name):
    """The full source of module `name` ("ops" or "matmul_<type>")."""
    if name == "ops":
        files = ("common.cuh", "ops.cu")
    else:
        qtype = Q[name.removeprefix("matmul_").upper()]
        files = ("common.cuh", *FORMAT_HEADERS[qtype], "matmul.cu")
    return "\n".join(f"// ---- {f}\n" + (SRC / f).read_text() for f in files)
