"""gemm.cu's word-wise dequantization (GEMM_DEQUANT: gemm_q6_k_unit, gemm_q4_k_unit) compiled for the CPU with g++:
bit for bit the format's unit_dequant on random blocks (every code and scale bit pattern; Q6_K rows at 0 and 2 bytes
past a word, as its 210-byte blocks lie in a row), and within float32 rounding of gguf's NumPy dequantization."""
import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from gpu_kernels.sources import FORMAT_HEADERS, SRC

from .test_slice_emulation import PRELUDE

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

UNITS = {Q.Q6_K: ("gemm_q6_k_unit", 16, (208,)), Q.Q4_K: ("gemm_q4_k_unit", 32, (0, 2))}  # fn, weights, f16 offsets

HARNESS = r"""
// out_ref, out_new [U * UNIT_WEIGHTS]: units 0 .. U - 1 of row by unit_dequant and by the word-wise function.
extern "C" void dequant_both(const u8* row, int units, float* out_ref, float* out_new) {
    for (int u = 0; u < units; ++u) {
        unit_dequant(row, u, out_ref + u * UNIT_WEIGHTS);
        GEMM_UNIT(row, u, out_new + u * UNIT_WEIGHTS);
    }
}
"""


def gemm_dequant_source(qtype):
    """The format's headers and gemm.cu's GEMM_DEQUANT part (up to gemm_dequant) for g++, with the harness."""
    gemm = (SRC / "gemm.cu").read_text()
    part = gemm[gemm.index("// GEMM_DEQUANT 1"):gemm.index("// w [K] = columns k0")]
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return (PRELUDE + "".join((SRC / f).read_text() for f in ("common.cuh", *FORMAT_HEADERS[qtype])) +
            f"#define GEMM_BLOCK_WEIGHTS {block_weights}\n#define GEMM_BLOCK_BYTES {block_bytes}\n"
            f"#define GEMM_DEQUANT 1\n#define GEMM_UNIT {UNITS[qtype][0]}\n" + part + HARNESS)


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    libs = {}

    def get(qtype):
        if qtype not in libs:
            path = tmp_path_factory.mktemp(qtype.name)
            (path / "dq.cpp").write_text(gemm_dequant_source(qtype))
            subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(path / "dq.so"),
                            str(path / "dq.cpp")], check=True, capture_output=True)
            libs[qtype] = ctypes.CDLL(str(path / "dq.so"))
        return libs[qtype]
    return get


@pytest.mark.parametrize("qtype", list(UNITS), ids=lambda q: q.name)
def test_word_wise_dequant_is_unit_dequant(build, qtype):
    lib = build(qtype)
    _, unit_weights, f16_offsets = UNITS[qtype]
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    num_blocks = 64
    blocks = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)  # [blocks, bytes]: every bit pattern
    for offset in f16_offsets:
        blocks[:, offset:offset + 2] = rng.uniform(0.5e-3, 1.5e-3, num_blocks).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    ref_np = np.asarray(gguf_dequantize(blocks.reshape(-1), qtype), np.float32)  # [blocks * weights]
    units = num_blocks * block_weights // unit_weights
    for shift in (0, 2) if qtype == Q.Q6_K else (0,):
        buf = np.zeros(blocks.size + 16, np.uint8)
        buf[shift:shift + blocks.size] = blocks.reshape(-1)
        ref, new = np.empty(units * unit_weights, np.float32), np.empty(units * unit_weights, np.float32)
        f32p = ctypes.POINTER(ctypes.c_float)
        lib.dequant_both(ctypes.c_void_p(buf.ctypes.data + shift), units, ref.ctypes.data_as(f32p),
                         new.ctypes.data_as(f32p))
        assert np.array_equal(ref.view(np.uint32), new.view(np.uint32))
        assert np.abs(new - ref_np).max() <= 1e-6 * np.abs(ref_np).max()
