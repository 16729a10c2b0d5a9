"""Numba CPU kernels: quant formats (one module each), GEMV/GEMM, attention, norms, routing.

Every quant-format module exposes the same interface over GGUF's raw blocks
(uint8 rows of `BLOCK_BYTES`-sized blocks, each holding `BLOCK_SIZE` weights):

    QTYPE, BLOCK_SIZE, BLOCK_BYTES
    dequantize(raw [R, B], out f32 [R, C])
    matvec(raw [R, B], x f32 [C], out f32 [R])
    matmul(raw [R, B], x f32 [T, C], out f32 [T, R])
    moe_matmul(raw [E, R, B], x f32 [N, C], expert_ids int64 [G], row_starts int64 [G+1], out f32 [N, R])

Shape legend: R output rows, C columns (input features), B bytes per row,
T tokens, E experts, N (token, expert) rows sorted by expert, G groups.

The format modules read the compile target at import: a caller that sets an ISA floor
(cpu_kernels.target.apply_isa_floor) does so before importing them; `cpu_kernels.formats` maps a
GGML type to its module.
"""
import numba

from .cache_stamp import install

install()  # before any kernel module: Numba's cache keys each cached kernel by the modules it imports too

# Kernels loaded from Numba's cache call the threading layer without launching it, and a serial twin
# that holds a parallel helper crashed when it was a fresh process's first kernel (the backend's
# set_threads launches it; other callers of these modules may not): launch it here.
numba.get_num_threads()
