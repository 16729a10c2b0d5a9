"""Launchers of the shared-memory tiled matmuls of prompt chunks (src/gemm.cu, in the matmul modules of GEMM_FORMATS):
a block dequantizes a tile of GEMM_ROWS weight rows once for up to 64 tokens (kernel `gemm`) or 32 (`gemm32`), where
the TILE_TOKENS kernels dequantize each row again for every 8 tokens. Kernels.matmul takes them from GEMM_MIN_TOKENS
tokens on, and Kernels.moe_matmul for work tiles of more than TILE_TOKENS rows (moe_tile_tokens picks the tile size:
MOE_GEMM_TOKENS, as the experts' groups of a prompt chunk are small: 32 pairs on average at 512 tokens x top-8 of 128).
How the products multiply (gemm_math, GEMM_MATHS): on CUDA sm_80+ by tensor cores in 3xTF32 (the default, near
float32), opt-in plain TF32, or float32 FMA (the HIP build and older GPUs always).

Shape legend: T tokens, R output rows, C columns, B bytes per row, S expert slots, N pair rows, W work tiles.
"""
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from .attention_plan import prefill_mma

GEMM_FORMATS = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})  # matmul modules with gemm.cu
GEMM_KERNELS = ("gemm", "gemm32", "gemm_reduce")
GEMM_ROWS = 128  # gemm.cu's GEMM_ROWS: weight rows a block
GEMM_TOKENS = 64  # tokens a block of gemm.cu's `gemm` (a dense matmul's, unless its blocks would be few)
MOE_GEMM_TOKENS = 32  # pair rows a block of `gemm32` (the experts' work tiles)
GEMM_KERNEL = {GEMM_TOKENS: "gemm", MOE_GEMM_TOKENS: "gemm32"}
GEMM_THREADS = 128
GEMM_STAGE_BYTES = 160  # a staged row's raw bytes at most where the format's blocks are smaller (stage_columns)
GEMM_MIN_TOKENS = 64  # a dense matmul of at least this many tokens takes the tiled GEMM (H100: 16 was 0.25-0.6x)
GEMM_MIN_PAIRS = 8  # a prompt chunk's expert groups take it where they average at least this many pairs
GEMM_MAX_SPLITS = 8  # a dense GEMM's column splits at most (GemmLaunchers.gemm_splits)
GEMM_SPLIT_MIN_TOKENS = 128  # splits only from here: no decode step (a captured graph) gets their scratch allocation
REDUCE_THREADS = 256
GROUP_THREADS = 256  # prompt_groups' block: a thread an expert in its row pass (more where there are more experts)
GEMM_MATHS = {"tf32x3": 3, "tf32": 1, "fp32": 0}  # gemm.cu's GEMM_MATH of each gemm_math setting
DEFAULT_GEMM_MATH = "tf32x3"
DEFAULT_GEMM_ASYNC = 1  # gemm.cu's GEMM_ASYNC: stages double-buffered by cp.async on the tensor-core path


def gemm_math(name=None):
    """The GEMM's products by name (None: DEFAULT_GEMM_MATH): "tf32x3" (tensor cores, each operand split into two
    TF32 parts, three mma a product: float32-like), "tf32" (one mma of operands rounded to TF32: ~1e-3 off, opt-in)
    or "fp32" (float32 FMA, the kernel before tensor cores). Where the GPU has no tensor-core path (HIP, before sm_80)
    every setting is fp32."""
    name = (name or DEFAULT_GEMM_MATH).strip().lower()
    if name not in GEMM_MATHS:
        raise ValueError(f"gemm_math {name!r}: expected one of {', '.join(GEMM_MATHS)}")
    return name


@lru_cache(maxsize=None)
def stage_columns(qtype):
    """Columns of qtype's GEMM stage: whole blocks of the format, at least 32 columns, doubled while its raw bytes a
    row stay within GEMM_STAGE_BYTES."""
    block_weights, block_bytes = GGML_QUANT_SIZES[Q(qtype)]
    cols = max(block_weights, 32)
    while block_weights < 256 and 2 * cols // block_weights * block_bytes <= GEMM_STAGE_BYTES:
        cols *= 2
    return cols


def gemm_defines(qtype):
    """The #define lines gemm.cu reads for qtype (its block and stage)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[Q(qtype)]
    return (f"#define GEMM_BLOCK_WEIGHTS {block_weights}\n#define GEMM_BLOCK_BYTES {block_bytes}\n"
            f"#define GEMM_STAGE_COLS {stage_columns(qtype)}\n")


def variant_defines(variant):
    """((NAME, VALUE), ...) of a variant "NAME[=VALUE][+NAME[=VALUE]...]" of gemm.cu's defines (VALUE 1 where not
    given)."""
    return tuple((part.partition("=")[0], part.partition("=")[2] or "1") for part in variant.split("+") if part)


def gemm_dynamic_shared(qtype, tokens, defines=(), mma=True):
    """Dynamic shared memory bytes of qtype's GEMM kernel of `tokens` a block, compiled with `defines` ((NAME, VALUE)
    pairs, variant_defines) before gemm.cu's defaults, on a GPU where it takes the tensor-core path (mma: CUDA
    sm_80+): GEMM_ASYNC 1's two staged buffers and tiles (GEMM_ASYNC_SHARED at its step K: 32 where the static tiles
    fit 48 KiB, else 16); 0 where its tiles are static (GEMM_ASYNC 0 or 2, GEMM_MATH 0, no tensor cores)."""
    defines = dict(defines)
    if not mma or defines.get("GEMM_MATH") == "0" or defines.get("GEMM_ASYNC", str(DEFAULT_GEMM_ASYNC)) != "1":
        return 0
    block_weights, block_bytes = GGML_QUANT_SIZES[Q(qtype)]
    stage_bytes = stage_columns(qtype) // block_weights * block_bytes
    step = 32 if 4 * 32 * (GEMM_ROWS + tokens) + 4 * GEMM_ROWS * (((stage_bytes + 3) // 4) | 1) <= 48 * 1024 else 16
    return 4 * step * (GEMM_ROWS + tokens) + 2 * 4 * GEMM_ROWS * (((stage_bytes + 5) // 4) | 1)


def allow_dynamic_shared(fn, shared):
    """Raise compiled kernel fn's dynamic shared memory limit to `shared` bytes where past the default 48 KiB."""
    if shared > 48 * 1024 and getattr(fn, "max_dynamic_shared_size_bytes", shared) < shared:
        fn.max_dynamic_shared_size_bytes = shared


def gemm_fits(qtype, num_cols):
    """Whether qtype's matmul module has the tiled GEMM and it takes rows of num_cols columns (whole stages)."""
    return Q(qtype) in GEMM_FORMATS and num_cols % stage_columns(qtype) == 0


def moe_tile_tokens(projections, num_pairs, num_groups, small):
    """Pair rows a work tile of a prompt chunk's expert matmuls: MOE_GEMM_TOKENS (moe_gemm) where every projection
    (qtype, columns) fits the GEMM and the num_groups groups average at least GEMM_MIN_PAIRS of the num_pairs
    pairs, else `small` (the TILE_TOKENS kernels)."""
    if num_pairs < GEMM_MIN_PAIRS * max(1, num_groups) or not all(gemm_fits(q, c) for q, c in projections):
        return small
    return MOE_GEMM_TOKENS


def group_tiles_bound(num_pairs, num_experts, tile_tokens):
    """Work tiles prompt_groups may give num_pairs pairs over num_experts experts: ceil(N / tile_tokens), plus one
    partial tile for each expert with pairs at most."""
    return -(-num_pairs // tile_tokens) + min(num_experts, num_pairs)


def split_count(num_blocks, num_stages, target_blocks):
    """Column splits of a dense GEMM launch of num_blocks blocks over num_stages stages: doubled, up to
    GEMM_MAX_SPLITS and while they divide the stages, until the blocks reach target_blocks."""
    splits = 1
    while num_blocks * splits < target_blocks and 2 * splits <= GEMM_MAX_SPLITS and num_stages % (2 * splits) == 0:
        splits *= 2
    return splits


class GemmLaunchers:
    """The tiled GEMM launches of Kernels (which supplies rt, _mm, the compiled kernel of a format's matmul module,
    _module, the module compiled with more defines, and _launch). A dense GEMM whose 64-token blocks would be fewer
    than the multiprocessors takes 32-token ones; split_columns: one of at least GEMM_SPLIT_MIN_TOKENS tokens whose
    blocks would still be fewer than the multiprocessors splits its columns (split_count) into partial sums, added up
    in order by gemm_reduce (a 512-token prompt's router [128, 2048] F32: 8 blocks of 64 tokens, 128 of 32 tokens in 8
    splits). gemm_math: how the products multiply (gemm_math's names; GpuBackend sets its setting)."""

    split_columns = True
    gemm_math = DEFAULT_GEMM_MATH  # gemm_math's setting of the products
    gemm_variant = ""  # opt-in compile-time alternatives of gemm.cu, "NAME=VALUE+..." (variant_defines; benches)
    _gemm_mma = None  # whether the runtime has the tensor-core path (gemm_mma), found at the first GEMM
    _gemm_partial = None  # f32 scratch of the splits' partial sums, grown as needed

    def gemm_mma(self):
        """Whether the GEMM takes the tensor-core path here: CUDA sm_80+ (attention_plan.prefill_mma's test) and a
        gemm_math other than fp32."""
        if self._gemm_mma is None:
            self._gemm_mma = prefill_mma(self.rt)
        return self._gemm_mma and self.gemm_math != "fp32"

    def _gemm_fn(self, qtype, name):
        """(qtype's GEMM kernel `name` at self.gemm_math and gemm_variant, its dynamic shared bytes): the matmul
        module's at the defaults, else the module compiled again with its GEMM_MATH and the variant's defines
        (Kernels._module); the bytes by gemm_dynamic_shared (the kernel's limit raised to them)."""
        defines = dict(variant_defines(self.gemm_variant)) if name != "gemm_reduce" else {}
        if self.gemm_math != DEFAULT_GEMM_MATH:
            defines["GEMM_MATH"] = str(GEMM_MATHS[gemm_math(self.gemm_math)])
        tag = "".join(f"_{key}{value}" for key, value in sorted(defines.items()))
        lines = "".join(f"#define {key} {value}\n" for key, value in sorted(defines.items()))
        fn = self._module(qtype, lines, tag)[name] if defines else self._mm(qtype, name)
        if name == "gemm_reduce":
            return fn, 0
        tokens = {kernel: tokens for tokens, kernel in GEMM_KERNEL.items()}[name]
        shared = gemm_dynamic_shared(qtype, tokens, defines.items(), self.gemm_mma())
        allow_dynamic_shared(fn, shared)
        return fn, shared

    def gemm_plan(self, qtype, num_tokens, num_rows, num_cols):
        """(tokens a block, column splits) of the dense GEMM of [num_tokens, num_cols] by [num_rows, num_cols]."""
        row_blocks = -(-num_rows // GEMM_ROWS)
        tokens = GEMM_TOKENS if row_blocks * -(-num_tokens // GEMM_TOKENS) >= self.rt.multiprocessors else \
            MOE_GEMM_TOKENS
        if not self.split_columns or num_tokens < GEMM_SPLIT_MIN_TOKENS:
            return tokens, 1
        num_blocks = row_blocks * -(-num_tokens // tokens)
        return tokens, split_count(num_blocks, num_cols // stage_columns(qtype), self.rt.multiprocessors)

    def gemm(self, raw, qtype, x, out):
        """out [T, R] = x [T, C] @ dequant(raw [R, B]).T; x and out contiguous, gemm_fits(qtype, C)."""
        num_tokens, num_cols = x.shape
        num_rows, none = raw.shape[0], np.uint64(0)  # no work tiles: null pointers
        tokens, splits = self.gemm_plan(qtype, num_tokens, num_rows, num_cols)
        target = out
        if splits > 1:
            size = splits * num_tokens * num_rows
            if self._gemm_partial is None or self._gemm_partial.size < size:
                self._gemm_partial = self.rt.empty((size,), np.float32)
            target = self._gemm_partial
        grid = (-(-num_rows // GEMM_ROWS), -(-num_tokens // tokens), splits)
        fn, shared = self._gemm_fn(qtype, GEMM_KERNEL[tokens])
        self._launch(fn, grid, GEMM_THREADS,
                     (raw, x, target, none, none, none, np.int32(num_tokens), np.int32(num_rows), np.int32(num_cols),
                      np.int64(raw.shape[-1])), shared_mem=shared)
        if splits > 1:
            n = num_tokens * num_rows
            self._launch(self._gemm_fn(qtype, "gemm_reduce")[0], (-(-n // REDUCE_THREADS),), REDUCE_THREADS,
                         (target, out, np.int64(n), np.int32(splits)))

    def prompt_groups(self, ids, slot_map, tile_tokens, order, row_of_pair, tiles):
        """A prompt chunk's pairs grouped by expert on the device (prompt_groups.cu): ids int32 [T, K], slot_map int32
        [E] (-1: not resident) -> order int32 [N] (the pair of each row, N = T * K), row_of_pair int32 [N] and tiles
        int32 [3, W] (slot, first row, rows of each work tile of at most tile_tokens rows; W >= group_tiles_bound)."""
        num_pairs, num_experts = ids.size, slot_map.shape[0]
        if tiles.shape[1] < group_tiles_bound(num_pairs, num_experts, tile_tokens):
            raise ValueError(f"prompt_groups: {tiles.shape[1]} work tiles for {num_pairs} pairs over {num_experts} "
                             f"experts in tiles of {tile_tokens}; expected at least "
                             f"{group_tiles_bound(num_pairs, num_experts, tile_tokens)}")
        threads = max(GROUP_THREADS, self._threads(num_experts, cap=1024))
        self._launch(self._ops("prompt_groups"), (1,), threads,
                     (ids, slot_map, np.int32(num_pairs), np.int32(num_experts), np.int32(tile_tokens),
                      np.int32(tiles.shape[1]), order, row_of_pair, tiles),
                     shared_mem=4 * (3 * num_experts + threads))

    def moe_gemm(self, raw, qtype, x, out, tile_slot, tile_row, tile_count, tile_tokens=MOE_GEMM_TOKENS):
        """out [N, R] = per work tile w: x[rows of w] @ dequant(raw [S, R, B][tile_slot[w]]).T; tiles int32 [W] of at
        most tile_tokens rows (MOE_GEMM_TOKENS or GEMM_TOKENS); gemm_fits(qtype, C)."""
        if tile_tokens not in GEMM_KERNEL:
            raise ValueError(f"moe_gemm: work tiles of {tile_tokens} rows; expected one of {sorted(GEMM_KERNEL)}")
        num_rows, num_cols = raw.shape[1], x.shape[1]
        fn, shared = self._gemm_fn(qtype, GEMM_KERNEL[tile_tokens])
        self._launch(fn, (-(-num_rows // GEMM_ROWS), len(tile_slot)), GEMM_THREADS,
                     (raw, x, out, tile_slot, tile_row, tile_count, np.int32(x.shape[0]), np.int32(num_rows),
                      np.int32(num_cols), np.int64(raw.shape[-1])), shared_mem=shared)
