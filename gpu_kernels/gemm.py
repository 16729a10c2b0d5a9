"""Launchers of the shared-memory tiled matmuls of prompt chunks (src/gemm.cu, in the matmul modules of GEMM_FORMATS):
a block dequantizes a tile of GEMM_ROWS weight rows once for up to GEMM_TOKENS tokens, where the TILE_TOKENS kernels
dequantize each row again for every 8 tokens. Kernels.matmul takes them from GEMM_MIN_TOKENS tokens on, and
Kernels.moe_matmul for work tiles of more than TILE_TOKENS rows (moe_tile_tokens picks the tile size).

Shape legend: T tokens, R output rows, C columns, B bytes per row, S expert slots, N pair rows, W work tiles.
"""
import numpy as np
from gguf import GGMLQuantizationType as Q

from .sources import GEMM_FORMATS

GEMM_ROWS = 128  # gemm.cu's GEMM_ROWS: weight rows a block
GEMM_TOKENS = 64  # gemm.cu's GEMM_TOKENS: tokens (pair rows) a block
GEMM_K = 32  # gemm.cu's GEMM_K: columns a step (C must be a multiple)
GEMM_THREADS = 128
GEMM_MIN_TOKENS = 16  # a dense matmul of at least this many tokens takes the tiled GEMM
GEMM_MIN_PAIRS = 8  # a prompt chunk's expert groups take it where they average at least this many pairs


def gemm_fits(qtype, num_cols):
    """Whether qtype's matmul module has the tiled GEMM and it takes rows of num_cols columns."""
    return Q(qtype) in GEMM_FORMATS and num_cols % GEMM_K == 0


def moe_tile_tokens(projections, num_pairs, num_groups, small):
    """Pair rows a work tile of a prompt chunk's expert matmuls: GEMM_TOKENS (moe_gemm) where every projection
    (qtype, columns) fits the GEMM and the num_groups groups average at least GEMM_MIN_PAIRS of the num_pairs
    pairs, else `small` (the TILE_TOKENS kernels)."""
    if num_pairs < GEMM_MIN_PAIRS * max(1, num_groups) or not all(gemm_fits(q, c) for q, c in projections):
        return small
    return GEMM_TOKENS


class GemmLaunchers:
    """The tiled GEMM launches of Kernels (which supplies _mm, the compiled kernel of a format's matmul module, and
    _launch)."""

    def gemm(self, raw, qtype, x, out):
        """out [T, R] = x [T, C] @ dequant(raw [R, B]).T; x and out contiguous, gemm_fits(qtype, C)."""
        num_tokens, num_cols = x.shape
        num_rows = raw.shape[0]
        self._launch(self._mm(qtype, "gemm"), (-(-num_rows // GEMM_ROWS), -(-num_tokens // GEMM_TOKENS)),
                     GEMM_THREADS, (raw, x, out, np.int32(num_tokens), np.int32(num_rows), np.int32(num_cols),
                                    np.int64(raw.shape[-1])))

    def moe_gemm(self, raw, qtype, x, out, tile_slot, tile_row, tile_count):
        """out [N, R] = per work tile w: x[rows of w] @ dequant(raw [S, R, B][tile_slot[w]]).T; tiles int32 [W] of at
        most GEMM_TOKENS rows; gemm_fits(qtype, C)."""
        num_rows, num_cols = raw.shape[1], x.shape[1]
        self._launch(self._mm(qtype, "moe_gemm"), (-(-num_rows // GEMM_ROWS), len(tile_slot)), GEMM_THREADS,
                     (raw, x, out, tile_slot, tile_row, tile_count, np.int32(num_rows), np.int32(num_cols),
                      np.int64(raw.shape[-1])))
