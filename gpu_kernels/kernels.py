"""Python launchers of the GPU kernels: arrays and ints in, results written into caller-owned arrays.

Device arrays are the runtime's (CuPy). Shape legend: T tokens, H hidden, R output rows,
C columns, B bytes per row, nH heads, D head dim, Hq / Hkv query / kv heads, S cache positions,
E experts, K top-k, N pair rows, W work tiles, M gathered rows; paged KV: NB pool blocks, BT positions
a block, nS stage blocks, nb logical blocks.
"""
import logging

import numpy as np
from gguf import GGMLQuantizationType as Q

from .attention_plan import (MAX_SPLITS, PA_MAX_HEAD_DIM, PA_OUTS, PA_THREADS, PD_KEYS,  # noqa: F401
                             PD_MAX_ROWS, PREFILL_MIN_TOKENS, SHORT_ATTENTION_KEYS, _pow2_at_least,
                             attention_plan, prefill_mma, split_scratch_sizes)
from .delta_launch import DeltaNetLaunchers
from .gemm import GEMM_MIN_TOKENS, GemmLaunchers, gemm_fits
from .ops_launch import MATMUL_THREADS, OpsLaunchers
from .sources import (FORMAT_DEFINES, INT_DECODE, KV_KERNELS, OPS_KERNELS, kv_module_name, matmul_kernels, module_name, module_source,
                      table_shared_bytes)

log = logging.getLogger(__name__)

TILE_TOKENS = 8  # common.cuh's TILE_TOKENS: tokens per work tile of the tiled matmuls
UNIT_WEIGHTS = {Q.F32: 1, Q.F16: 1, Q.BF16: 1, Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16,
                Q.Q2_K: 32, Q.Q3_K: 32, Q.IQ4_XS: 32, Q.MXFP4: 32, Q.IQ3_S: 32, Q.IQ2_XXS: 32, Q.Q4_1: 32, Q.Q5_0: 32,
                Q.Q5_1: 32, Q.IQ4_NL: 32, Q.IQ3_XXS: 32, Q.IQ2_XS: 32, Q.IQ2_S: 32, Q.IQ1_S: 32, Q.IQ1_M: 32}
SLICE_WEIGHTS = {Q.F32: 4, Q.F16: 8, Q.BF16: 8, Q.Q8_0: 8, Q.Q4_0: 16, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 32,
                 Q.Q2_K: 32, Q.Q3_K: 32, Q.IQ4_XS: 32, Q.MXFP4: 32, Q.IQ3_S: 32, Q.IQ2_XXS: 32, Q.Q4_1: 32, Q.Q5_0: 32,
                Q.Q5_1: 32, Q.IQ4_NL: 32, Q.IQ3_XXS: 32, Q.IQ2_XS: 32, Q.IQ2_S: 32, Q.IQ1_S: 32, Q.IQ1_M: 32}
MAX_THREADS = 256
DECODE_ROWS = 2  # rows a lane group of the one-token kernels works on (common.cuh's DECODE_ROWS)
LANE_SLICES = 2  # slices each lane of a group takes, about: sets the group's width (tpr)
# Per format (DECODE_ROWS, LANE_SLICES) of the one-token kernels where a sweep found better than the default
# (bench/results/gpu_kernels.md): more rows a group or slices a lane keep more loads in flight. BF16 is as fast
# at every tuning.
DECODE_TUNING = {Q.F16: (4, 2), Q.Q8_0: (4, 4), Q.Q4_0: (8, 8), Q.Q4_K: (4, 8), Q.Q5_K: (2, 8), Q.Q6_K: (2, 4),
                 Q.IQ4_XS: (4, 4), Q.MXFP4: (2, 4), Q.IQ3_S: (4, 4)}
# Per format, blocks an SM must hold at once (common.cuh's DECODE_MIN_BLOCKS: registers capped to fit them) where
# that measured better than the compiler's choice (0): IQ3_S at (4, 4) in two H100 calls (bench/results/gpu_kernels.md).
DECODE_MIN_BLOCKS = {Q.IQ3_S: 3}
# A dense one-token launch (one work tile) whose blocks at its format's tuning would fill at most half the GPU's
# multiprocessors is latency-bound: it takes SMALL_TUNING (rows a lane group, slices a lane, slices in flight a lane
# plus one or None), shorter chains of loads a lane and more blocks, instead of DECODE_TUNING's (swept on a
# 128-expert launch). The decode shapes' timings by tuning: bench/results/vs_llamacpp_gpu.md (larger launches and
# the expert launches were as fast or faster at their format's tuning).
SMALL_TUNING = (1, 2, None)
# Slices in flight a lane plus one (matmul.cu's DECODE_PREFETCH) of the one-token expert launches (several work
# tiles: a decode step's pairs), or None: the double buffer.
EXPERT_PREFETCH = None
ACT_QUANTS = ("int16", "float", "int8")  # the act_quant setting's values (cpu_kernels.act_quant)
# Formats whose one-token matmuls take x as int16 with act_quant unset ("auto"): where that measured faster than
# float x (bench/results/gpu_kernels.md, bench/results/formats_h200_host.md): every format with an integer dot.
GPU_INT16_FORMATS = INT_DECODE
# AMD chips that do a 4-byte integer dot in one instruction besides RDNA3 and 4 (gfx11*, gfx12*): common.cuh's
# AMD_DOT4. The others take four products a dot, and there "auto" gives float x (tests/gpu_kernels/test_compile_hip.py
# holds this list to the kernels' machine code).
AMD_DOT4_CHIPS = frozenset({"gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950",
                            *(f"gfx103{i}" for i in range(7))})
MULTI_TOKENS = 4  # matmul.cu's MULTI_TOKENS: tokens of a matmul_nq block (each block row of the grid: its own 4)
# Dense matmuls of 2 to this many tokens (a decode step of several users) take matmul_nq, the one-token kernel's rows
# read once for every 4 tokens with x as int16 (where act_quant rounds one token's so), not the tiled kernel (float x
# from global memory); 0: never.
MULTI_DECODE_TOKENS = 16
# The `_q` kernels (int16 x) and their `_qx` twins: a `_q` kernel's blocks each round their rows' x to int16 into shared
# memory, a `_qx` kernel's read it from global memory, rounded once a launch by quantize_xq (the SwiGLU'd rows of
# moe_matmul_glu_1q through quantize_xq's up).
XQ_KERNELS = {"matmul_1q": "matmul_1qx", "matmul_nq": "matmul_nqx", "moe_matmul_1q": "moe_matmul_1qx",
              "moe_matmul2_1q": "moe_matmul2_1qx", "moe_matmul_glu_1q": "moe_matmul_1qx"}
# The `_q` kernels (XQ_KERNELS' keys) that take their `_qx` twin (Kernels.xq_per_launch): all of them, measured faster
# at 1 and 4 tokens (bench/results/gpu_users.md)
XQ_PER_LAUNCH = frozenset(XQ_KERNELS)
XQ_SCRATCH_ROWS = 64  # rows of x a quantize_xq buffer holds at first (grown, the old ones kept, for more)
XQ_MAX_SHARED = 40 << 10  # the `_1q` kernels' x in shared memory stays under this (48 KiB without opting in)
SHARED_LIMIT = 48 << 10  # a block's shared memory without opting in: x and the format's tables


def gpu_act_quant(name="auto"):
    """How the one-token matmuls of INT_DECODE formats take x: "int16" (rounded once per block into shared
    memory, as the CPU's default decode), "float", or "auto" (int16 for GPU_INT16_FORMATS, float for the others).
    name: the act_quant setting (None: "auto"); "int8" gives int16 here, the GPU kernels have no int8 dot."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return name
    if name not in ACT_QUANTS:
        raise ValueError(f"act_quant {name!r}: expected one of {', '.join(ACT_QUANTS)}")
    if name == "int8":
        log.info("act_quant int8: the GPU matmuls round activations to int16")
    return "float" if name == "float" else "int16"


def format_tuning(qtype):
    """(rows a lane group, slices a lane, blocks an SM holds or 0) of qtype's one-token matmuls by default."""
    rows, slices = DECODE_TUNING.get(Q(qtype), (DECODE_ROWS, LANE_SLICES))
    return rows, slices, DECODE_MIN_BLOCKS.get(Q(qtype), 0)


def xq_layout(qtype):
    """What orders a row's values in quantize_xq's buffer for qtype's `_qx` kernels (FORMAT_DEFINES' XQ_ macros): two
    formats of one layout read one rounding of x."""
    return tuple(sorted((k, v) for k, v in FORMAT_DEFINES.get(Q(qtype), {}).items() if k.startswith("XQ_")))


def tuned_source(qtype, rows, blocks, defines=""):
    """The source of qtype's matmul module at a tuning (common.cuh's DECODE_ROWS, DECODE_MIN_BLOCKS); `defines`: more
    lines before it."""
    tuning = f"#define DECODE_ROWS {rows}\n#define DECODE_MIN_BLOCKS {blocks}\n"
    return tuning + defines + module_source(module_name(qtype))


def tuned_module_name(qtype, rows, blocks):
    return f"{module_name(qtype)}_r{rows}_b{blocks}"


def has_dot4(chip):
    """Whether the GPU does the int16 matmuls' 4-byte integer dots in one instruction: every NVIDIA GPU (chip None)
    and the AMD chips of common.cuh's AMD_DOT4 (chip: the base name, "gfx1100")."""
    return chip is None or chip in AMD_DOT4_CHIPS or chip.startswith(("gfx11", "gfx12"))


def describe_act_quant(act_quant):
    """gpu_act_quant's setting in words, for the start-up log."""
    if act_quant != "auto":
        return act_quant
    return f"int16 for {', '.join(sorted(q.name for q in GPU_INT16_FORMATS))}, float for the others (auto)"


def takes_int16(act_quant, qtype):
    """Whether qtype's one-token matmuls take x as int16 under gpu_act_quant's `act_quant`."""
    q = Q(qtype)
    return q in INT_DECODE and (act_quant == "int16" or (act_quant == "auto" and q in GPU_INT16_FORMATS))


def fuses_glu(act_quant, qtype, num_cols):
    """Whether the one-row expert matmul of qtype over num_cols columns takes the SwiGLU in (moe_matmul_glu: its
    x rounded to int16 in shared memory, under gpu_act_quant's `act_quant`)."""
    return takes_int16(act_quant, qtype) and xq_fits(qtype, num_cols)


def xq_fits(qtype, num_cols):
    """Whether qtype's `_1q` kernels take x over num_cols columns: its int16 x under XQ_MAX_SHARED, and with the
    format's tables in shared memory (sources.table_shared_bytes) under SHARED_LIMIT."""
    nbytes = xq_shared_bytes(num_cols)
    return nbytes <= XQ_MAX_SHARED and nbytes + table_shared_bytes(qtype) <= SHARED_LIMIT


def _pad16(nbytes):
    return -(-nbytes // 16) * 16


def xq_shared_bytes(num_cols):
    """common.cuh's XQ_SHARED_BYTES: int8 hi and lo [C], f32 scale and sum [C/32]."""
    return 2 * num_cols + 8 * (num_cols // 32)


class Kernels(DeltaNetLaunchers, OpsLaunchers, GemmLaunchers):
    """decode_rows, lane_slices, min_blocks: tuning of the one-token matmuls for every format (the benchmark
    sweeps them); None: each format's DECODE_TUNING / DECODE_MIN_BLOCKS, else the defaults. max_splits: most
    key splits of paged_attention (1: none). act_quant: "int16" or "float" (gpu_act_quant; None: "auto";
    "auto" is float on an AMD chip without has_dot4).
    row_chunks: runs of rows a one-token matmul block walks (matmul.cu's block_walk); None: _row_chunks decides.
    fill_sms: a one-token matmul whose blocks would be fewer than the GPU's multiprocessors takes fewer rows a lane
    group (halved until they are not, down to 1), so that more multiprocessors read its weights.
    small_tuning: (rows a lane group, slices a lane, prefetch or None) of dense one-token launches too small to
    fill half the GPU at their format's tuning, or None (every launch its format's tuning). prefetch: slices a lane
    of the one-token kernels has in flight plus one (matmul.cu's DECODE_PREFETCH; None: its default, 2)."""

    def __init__(self, runtime, stream=None, decode_rows=None, lane_slices=None, min_blocks=None,
                 max_splits=MAX_SPLITS, act_quant=None, row_chunks=None, fill_sms=False, small_tuning=SMALL_TUNING,
                 prefetch=None):
        self.rt, self.stream = runtime, stream
        self.act_quant = gpu_act_quant(act_quant)
        chip = getattr(runtime, "chip", None)
        if self.act_quant == "auto" and not has_dot4(chip):
            log.info("%s has no 4-byte dot instruction: the one-token matmuls take x as float", chip)
            self.act_quant = "float"
        self.warp = runtime.warp_size
        self.decode_rows, self.lane_slices, self.max_splits = decode_rows, lane_slices, max_splits
        self.min_blocks, self.row_chunks, self.fill_sms = min_blocks, row_chunks, fill_sms
        self.small_tuning, self.prefetch, self.expert_prefetch = small_tuning, prefetch, EXPERT_PREFETCH
        self.multi_tokens = MULTI_DECODE_TOKENS  # dense matmuls of 2 to this many tokens take matmul_nq
        self.xq_per_launch = XQ_PER_LAUNCH  # `_q` kernel names: those launched as their `_qx` twin
        self._xq_kernels = set()  # compiled `_qx` kernels: x from quantize_xq
        self._xq_buffers = {}  # C -> quantize_xq's scratch uint8 [rows * step]
        self._xq_kept = []  # buffers a larger one replaced: a captured graph may still point at them
        self._last_xq = None  # (x, its layout, the buffer) of the last quantize_xq launch of a plain x
        self._resident = {}  # (function, shared bytes) -> blocks of MATMUL_THREADS the GPU holds at once
        self._functions = {}  # (qtype or KV dtype, kernel name(, rows)) -> compiled function
        self._launches = {}  # (qtype, kernel name, R, C, B, ...) -> _mm_launch's (kernel, blocks, scalars)
        self._dummy = None  # stands in for an absent array argument
        self.attention_rows = PD_MAX_ROWS  # most heads a one-token attention block takes (attention_plan)
        self.short_attention_keys = SHORT_ATTENTION_KEYS  # one token over at most this many keys: paged_attention_1s
        self._split_out = self._split_lse = None  # paged_attention's partial results, grown as needed
        # chunks of at least prefill_tokens tokens take paged_prefill (tensor cores) where the GPU has it
        self.prefill_mma, self.prefill_tokens = prefill_mma(runtime), PREFILL_MIN_TOKENS

    def _threads(self, work, cap=MAX_THREADS):
        """A power-of-two block size: enough for `work` items, at least one warp, at most `cap`."""
        return int(min(cap, max(self.warp, _pow2_at_least(work))))

    def _ops(self, name):
        return self.rt.compile("ops", module_source("ops"), OPS_KERNELS)[name]

    def tuning(self, qtype):
        """(rows a lane group, slices a lane, blocks an SM holds or 0) of qtype's one-token matmuls."""
        rows, slices, blocks = format_tuning(qtype)
        return (self.decode_rows or rows, self.lane_slices or slices,
                blocks if self.min_blocks is None else self.min_blocks)

    def _mm(self, qtype, name, rows=None, prefetch=None):
        """qtype's kernel `name` at `rows` a lane group (None: its tuning's) and `prefetch` (None: self.prefetch)."""
        key = (qtype, name, rows, prefetch)
        if key not in self._functions:  # the lookup runs at every launch: keep it to one dict read
            tuned_rows, _, blocks = self.tuning(qtype)
            depth, rows = prefetch or self.prefetch, rows or tuned_rows
            tag = f"_p{depth}" if depth else ""
            source = tuned_source(qtype, rows, blocks, f"#define DECODE_PREFETCH {depth}\n" if tag else "")
            self._functions[key] = self.rt.compile(tuned_module_name(qtype, rows, blocks) + tag, source,
                                                   matmul_kernels(qtype))[name]
        return self._functions[key]

    def _module(self, qtype, defines, tag):
        """qtype's matmul module at its tuning with `defines` (#define lines) before its source, compiled as a module of
        its own (`tag` added to the name): {kernel name: function}."""
        rows, _, blocks = self.tuning(qtype)
        return self.rt.compile(tuned_module_name(qtype, rows, blocks) + tag, tuned_source(qtype, rows, blocks, defines),
                               matmul_kernels(qtype))

    def _small(self, num_rows, num_slices, rows, lane_slices, num_tiles):
        """Whether a one-token launch of num_tiles tiles over num_rows rows of num_slices slices, at (rows a group,
        slices a lane), takes small_tuning: set, one tile, no tuning given to every format, blocks at most half the
        multiprocessors."""
        if self.small_tuning is None or num_tiles != 1 or self.decode_rows or self.lane_slices:
            return False
        tpr = min(self.warp, _pow2_at_least(-(-num_slices // lane_slices)))
        return 2 * -(-num_rows // (MATMUL_THREADS // tpr * rows)) <= self.rt.multiprocessors

    def _filling_rows(self, rows, tpr, num_rows, num_tiles):
        """fill_sms' rows a lane group: `rows` halved while the launch's blocks are fewer than the multiprocessors."""
        groups = MATMUL_THREADS // tpr
        while rows > 1 and -(-num_rows // (groups * rows)) * num_tiles < self.rt.multiprocessors:
            rows //= 2
        return rows

    def _kv(self, kv_dtype, name):
        key = (kv_dtype, name)
        if key not in self._functions:
            mod = kv_module_name(kv_dtype)
            self._functions[key] = self.rt.compile(mod, module_source(mod), KV_KERNELS)[name]
        return self._functions[key]

    def _or_dummy(self, array):
        if array is not None:
            return array
        if self._dummy is None:
            self._dummy = self.rt.zeros((4,), np.float32)
        return self._dummy

    @staticmethod
    def _address(start_at):
        """The device position array of a start_at, or a null pointer."""
        return np.uint64(0) if start_at is None else start_at[0]

    def _split_buffers(self, num_values, num_rows):
        """Device scratch for the splits' partial outputs [S, T, Hq, D] and lse [S, T, Hq], flat."""
        if self._split_out is None or self._split_out.size < num_values:
            self._split_out = self.rt.empty((num_values,), np.float32)
        if self._split_lse is None or self._split_lse.size < num_rows:
            self._split_lse = self.rt.empty((num_rows,), np.float32)
        return self._split_out, self._split_lse

    def _launch(self, fn, grid, block, args, shared_mem=0):
        self.rt.launch(fn, grid, (block,), args, shared_mem=shared_mem, stream=self.stream)

    def _mm_threads(self, qtype, num_cols):
        return self._threads(num_cols // UNIT_WEIGHTS[Q(qtype)], cap=128)

    def _mm_launch(self, qtype, kernel, num_rows, num_cols, row_bytes, one, float_x=False, num_tiles=1):
        """(compiled kernel, blocks over the rows at one chunk a block, (R, C, B, tpr) as kernel scalars, shared
        memory bytes) of a matmul launch (one: the one-token kernel's, `_1q` where x goes in as int16 unless
        float_x; num_tiles: its work tiles, for fill_sms), kept per shape: a decode step launches the same few
        shapes hundreds of times."""
        key = (qtype, kernel, num_rows, num_cols, row_bytes, float_x, num_tiles, self.xq_per_launch)
        launch = self._launches.get(key)
        if launch is None:
            slices, rem = divmod(num_cols, SLICE_WEIGHTS[Q(qtype)])
            if rem:
                raise ValueError(f"{Q(qtype).name} matmul: {num_cols} columns, not a multiple of "
                                 f"{SLICE_WEIGHTS[Q(qtype)]}")
            rows_per_group, lane_slices = self.tuning(qtype)[:2] if one else (1, self.lane_slices or LANE_SLICES)
            prefetch = self.expert_prefetch if one and num_tiles > 1 else None
            if one and self._small(num_rows, slices, rows_per_group, lane_slices, num_tiles):
                rows_per_group, lane_slices, prefetch = self.small_tuning
            tpr = int(min(self.warp, _pow2_at_least(-(-slices // lane_slices))))
            if one and self.fill_sms:
                rows_per_group = self._filling_rows(rows_per_group, tpr, num_rows, num_tiles)
            per_block = MATMUL_THREADS // tpr * rows_per_group
            shared = 0
            int16 = one and not float_x and takes_int16(self.act_quant, qtype)
            multi = MULTI_TOKENS * _pad16(xq_shared_bytes(num_cols))  # matmul_nq's x
            if kernel == "matmul_n":
                if int16 and xq_fits(qtype, num_cols) and multi + table_shared_bytes(qtype) <= SHARED_LIMIT:
                    kernel, shared = "matmul_nq", multi
            elif int16 and xq_fits(qtype, num_cols):
                kernel, shared = kernel + "q", xq_shared_bytes(num_cols)
            twin = kernel in XQ_KERNELS and kernel in self.xq_per_launch
            fn = self._mm(qtype, XQ_KERNELS[kernel] if twin else kernel, rows_per_group if one else None, prefetch)
            if twin:
                self._xq_kernels.add(fn)
                shared = 0
            launch = self._launches[key] = (fn, (num_rows + per_block - 1) // per_block,
                                            (np.int32(num_rows), np.int32(num_cols), np.int64(row_bytes),
                                             np.int32(tpr)), shared)
        return launch

    def _x_arg(self, fn, qtype, x, up=None, same_x=False):
        """x [N, C] as kernel fn takes it: for a `_qx` kernel (xq_per_launch's) its rows (silu(x) * up where up is
        given) rounded to int16 by one quantize_xq launch into a scratch buffer [N, step] kept per C, else x.
        same_x: x is the array the last quantize_xq launch rounded, unchanged since (the caller says so: one input's
        several projections); its buffer is taken again where the layouts of x's rounding agree."""
        if fn not in self._xq_kernels:
            return x
        layout = xq_layout(qtype)
        last = self._last_xq
        if same_x and up is None and last is not None and last[0] is x and last[1] == layout:
            return last[2]
        num_rows, num_cols = x.shape
        step = _pad16(xq_shared_bytes(num_cols))
        buf = self._xq_buffers.get(num_cols)
        if buf is None or buf.size < num_rows * step:
            if buf is not None:
                self._xq_kept.append(buf)
            buf = self._xq_buffers[num_cols] = self.rt.empty((max(num_rows, XQ_SCRATCH_ROWS) * step,), np.uint8)
        warps = MATMUL_THREADS // 32
        self._launch(self._mm(qtype, "quantize_xq"), (-(-num_cols // (32 * warps)), num_rows), MATMUL_THREADS,
                     (x, self._or_dummy(up), np.int32(up is not None), buf, np.int32(num_cols)))
        self._last_xq = (x, layout, buf) if up is None else None
        return buf

    def _row_chunks(self, fn, num_blocks, num_tiles, shared, one):
        """Runs of rows a matmul block walks, given the launch's num_blocks x num_tiles blocks at one run a block.
        The one-token kernels take 1 while those blocks fit on the GPU at once, else the fewest runs that make them
        fit: each block then stages its x once for all its runs, and its loads go on from one run into the next
        instead of the block ending and another one starting cold. The tiled kernels always take 1 (on the
        bench's prefill shapes, their walking version was slower)."""
        if not one:
            return 1
        if self.row_chunks is not None:
            return max(1, min(int(self.row_chunks), num_blocks))
        key = (fn, shared)
        resident = self._resident.get(key)
        if resident is None:
            resident = self._resident[key] = self.rt.resident_blocks(fn, MATMUL_THREADS, shared)
        total = num_blocks * num_tiles
        return 1 if total <= resident else min(num_blocks, -(-total // resident))

    def _mm_grid_x(self, fn, num_blocks, num_tiles, shared, one):
        """(blocks over the rows, runs of rows a block) of a matmul launch: _row_chunks."""
        chunks = self._row_chunks(fn, num_blocks, num_tiles, shared, one)
        return -(-num_blocks // chunks), np.int32(chunks)

    def matmul(self, raw, qtype, x, out, float_x=False, same_x=False):
        """out [T, R] = x [T, C] @ dequant(raw [R, B]).T; x and out contiguous. float_x: x as float32 in the
        one-token kernel too (not rounded to int16 whatever act_quant says). same_x: x is unchanged since the last
        matmul that rounded it (_x_arg)."""
        num_tokens, num_cols = x.shape
        if num_tokens >= GEMM_MIN_TOKENS and gemm_fits(qtype, num_cols):
            return self.gemm(raw, qtype, x, out)
        if 1 < num_tokens <= self.multi_tokens:
            return self._matmul_multi(raw, qtype, x, out, float_x, same_x)
        one = num_tokens == 1
        fn, num_blocks, scalars, shared = self._mm_launch(qtype, "matmul_1" if one else "matmul", raw.shape[0],
                                                          num_cols, raw.shape[-1], one, float_x)
        num_tiles = 1 if one else (num_tokens + TILE_TOKENS - 1) // TILE_TOKENS
        grid_x, chunks = self._mm_grid_x(fn, num_blocks, num_tiles, shared, one)
        self._launch(fn, (grid_x, num_tiles), MATMUL_THREADS,
                     (raw, self._x_arg(fn, qtype, x, same_x=same_x), out, np.int32(num_tokens)) + scalars + (chunks,),
                     shared_mem=shared)

    def _matmul_multi(self, raw, qtype, x, out, float_x=False, same_x=False):
        """matmul's few-token launch (matmul.cu matmul_n / matmul_nq): the one-token kernel's tuning, lane groups and
        rows, each block's rows read once for MULTI_TOKENS tokens (x as int16 in shared memory where one token's
        would be and every token's fits)."""
        num_tokens, num_cols = x.shape
        fn, num_blocks, scalars, shared = self._mm_launch(qtype, "matmul_n", raw.shape[0], num_cols, raw.shape[-1],
                                                          True, float_x)
        num_tiles = -(-num_tokens // MULTI_TOKENS)
        grid_x, chunks = self._mm_grid_x(fn, num_blocks, num_tiles, shared, True)
        self._launch(fn, (grid_x, num_tiles), MATMUL_THREADS,
                     (raw, self._x_arg(fn, qtype, x, same_x=same_x), out, np.int32(num_tokens)) + scalars + (chunks,),
                     shared_mem=shared)

    def moe_matmul(self, raw, qtype, x, out, tile_slot, tile_row, tile_count, tile_tokens=TILE_TOKENS):
        """out [N, R] = per work tile w: x[rows of w] @ dequant(raw [S, R, B][tile_slot[w]]).T; tiles int32 [W]
        of at most `tile_tokens` rows (1: the one-row kernel; up to TILE_TOKENS: the tiled one; 32 or 64: the tiled
        GEMM's kernel of that many, for formats where gemm.moe_tile_tokens gives it)."""
        if tile_tokens > TILE_TOKENS:
            return self.moe_gemm(raw, qtype, x, out, tile_slot, tile_row, tile_count, tile_tokens)
        one = tile_tokens == 1
        fn, num_blocks, scalars, shared = self._mm_launch(qtype, "moe_matmul_1" if one else "moe_matmul",
                                                          raw.shape[1], x.shape[1], raw.shape[-1], one,
                                                          num_tiles=len(tile_slot))
        grid_x, chunks = self._mm_grid_x(fn, num_blocks, len(tile_slot), shared, one)
        self._launch(fn, (grid_x, len(tile_slot)), MATMUL_THREADS,
                     (raw, self._x_arg(fn, qtype, x), out, tile_slot, tile_row, tile_count) + scalars + (chunks,),
                     shared_mem=shared)

    def dequant_rows(self, raw, qtype, row_ids, out):
        """out [M, C] = dequant(raw [rows, B][row_ids]); row_ids int64 [M] on the device."""
        num_cols = out.shape[1]
        self._launch(self._mm(qtype, "dequant_rows"), (len(row_ids),), self._mm_threads(qtype, num_cols),
                     (raw, row_ids, out, np.int32(num_cols), np.int64(raw.shape[-1])))

    def rope_neox(self, x, positions, inv_freq, scale=1.0):
        """In place over x [T, nH, D]: the first R = 2 * len(inv_freq) dims rotated, cos and sin times scale;
        positions int64 [T], inv_freq f32 [R/2] on the device."""
        num_tokens, num_heads, head_dim = x.shape
        half = inv_freq.shape[0]
        self._launch(self._ops("rope_neox"), (num_tokens,), self._threads(num_heads * half),
                     (x, positions, inv_freq, np.int32(num_heads), np.int32(head_dim), np.int32(half),
                      np.float32(scale)))

    def attn_sinks(self, out, lse, sinks):
        """Each head's sink logit joins the softmax's denominator: out [T, Hq, D] *= 1 / (1 + exp(sinks - lse)),
        lse [T, Hq] becomes log(exp(lse) + exp(sinks)) (cpu_kernels.attention.apply_sinks)."""
        num_tokens, num_q_heads, head_dim = out.shape
        self._launch(self._ops("attn_sinks"), (num_tokens * num_q_heads,), self._threads(head_dim),
                     (out, lse, sinks, np.int32(num_q_heads), np.int32(head_dim)))

    def paged_attention(self, kv_dtype, q, k_pool, v_pool, k_scale, v_scale, table, start, key_lo, scale, out,
                        lse=None, stage=None, start_at=None, window=0):
        """out [T, Hq, D] = causal GQA attention of q [T, Hq, D] (query t at position start + t) over keys
        [key_lo, start + t + 1) of the paged cache k_pool / v_pool [NB, BT, Hkv, D] (k_scale / v_scale
        [NB, BT, Hkv] for int8, else None) through table int32 [nb]; logical blocks with table < 0 come
        from stage = (k_stage, v_stage, k_stage_scale, v_stage_scale) [nS, BT, Hkv(, D)] (scales None
        unless int8). lse [T, Hq], when given, gets each row's log-sum-exp (-inf with no key), for
        attn_merge. Arrays contiguous, each starting 16-byte aligned.
        start_at = (positions int64 [1] on the device, split scratch (out, lse) or None): the kernels read
        start there (a captured decode step replays with the step's position); `start` is then a bound on
        it that plans the key splits, and the splits write into the given scratch, which the capture keeps.
        window > 0: query t attends only keys from start + t + 1 - window on (a sliding-window layer).
        Chunks of prefill_tokens tokens or more take paged_prefill (tensor cores) where prefill_mma, in 3xTF32, in
        TF32 where gemm_math is "tf32", not where it is "fp32" nor in a captured step (start_at: its scratch is
        split_scratch_sizes')."""
        num_tokens, num_q_heads, head_dim = q.shape
        _, block_tokens, num_kv_heads, _ = k_pool.shape
        if head_dim > PA_MAX_HEAD_DIM or num_q_heads % num_kv_heads:
            raise ValueError(f"paged_attention: q {q.shape} against a KV pool {k_pool.shape}: head dim at most "
                             f"{PA_MAX_HEAD_DIM}, query heads a multiple of kv heads")
        if num_tokens == 0:
            return
        group = num_q_heads // num_kv_heads
        num_keys = start + num_tokens - key_lo
        if window > 0:
            num_keys = min(num_keys, window + num_tokens - 1)
        plan = attention_plan(num_tokens, group, num_kv_heads, head_dim, num_keys, self.warp, self.max_splits,
                              self.attention_rows, self.short_attention_keys,
                              self.prefill_mma and self.gemm_math != "fp32" and start_at is None, self.prefill_tokens)
        num_rows = num_tokens * num_q_heads
        if plan.splits == 1:
            target, target_lse, want_lse = out, self._or_dummy(lse), int(lse is not None)
        elif start_at is not None:
            target, target_lse = start_at[1]
            want_lse = 1
        else:
            target, target_lse = self._split_buffers(plan.splits * num_rows * head_dim, plan.splits * num_rows)
            want_lse = 1
        k_stage, v_stage, k_stage_scale, v_stage_scale = (None,) * 4 if stage is None else stage
        tokens = () if plan.kernel.startswith("paged_attention_1") else (np.int32(num_tokens),)
        args = (q, k_pool, v_pool, *map(self._or_dummy, (k_scale, v_scale)), table,
                *map(self._or_dummy, (k_stage, v_stage, k_stage_scale, v_stage_scale)), target, target_lse,
                np.int32(want_lse), *tokens, np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(head_dim),
                np.int32(block_tokens), np.int32(start), np.int32(key_lo), np.float32(scale), np.int32(plan.rows),
                np.int32(plan.width), np.int32(plan.split_keys), self._address(start_at), np.int32(window), np.int32(0))
        kernel = self._kv(kv_dtype, plan.kernel)
        if plan.kernel == "paged_prefill" and self.gemm_math == "tf32":  # opt-in: one TF32 mma a product
            key = (kv_dtype, "paged_prefill_tf32")
            if key not in self._functions:
                mod = kv_module_name(kv_dtype)
                self._functions[key] = self.rt.compile(mod + "_tf32", "#define PF_MATH 1\n" + module_source(mod),
                                                       KV_KERNELS)["paged_prefill"]
            kernel = self._functions[key]
        self._launch(kernel, (plan.num_tiles, num_kv_heads, plan.splits), PA_THREADS, args, shared_mem=plan.shared_mem)
        if plan.splits > 1:
            self._launch(self._kv(kv_dtype, "paged_attention_merge"), (num_rows,), self._threads(head_dim),
                         (target, target_lse, out, self._or_dummy(lse), np.int32(lse is not None),
                          np.int32(plan.splits), np.int32(num_rows), np.int32(head_dim)), shared_mem=4 * plan.splits)

    def kv_write(self, kv_dtype, x, pool, scale, table, start, start_at=None, second=None, slot_table=0):
        """Encode rows x [n, Hkv, D] f32 of positions start .. start + n - 1 into pool [NB, BT, Hkv, D]
        through table int32 [nb] (pool blocks only); scale [NB, BT, Hkv] gets int8's row scales (else None).
        start_at: as paged_attention's (start read on the device). second: (x, pool, scale) of another pool of
        the same shapes written in the same launch (v's beside k's), or None. slot_table > 0: row t is the one
        token of slot t, at position start_at[0][t] through table [n, slot_table]'s row t (kv.cu kv_write)."""
        num_rows, num_kv_heads, head_dim = x.shape
        if num_rows == 0:
            return
        threads = self._threads(head_dim)
        x2, pool2, scale2 = second if second is not None else (x, pool, scale)
        self._launch(self._kv(kv_dtype, "kv_write"), (num_rows * num_kv_heads, 1 if second is None else 2), threads,
                     (x, pool, self._or_dummy(scale), x2, pool2, self._or_dummy(scale2), table, np.int32(start),
                      np.int32(num_kv_heads), np.int32(head_dim), np.int32(pool.shape[1]), self._address(start_at),
                      np.int32(slot_table)), shared_mem=threads * 4)

    def attn_merge(self, out_a, lse_a, out_b, lse_b, out):
        """out [T, Hq, D] = merge of two attentions over disjoint keys, (out_a, lse_a) and (out_b, lse_b)
        (lse [T, Hq]); out may alias out_a or out_b."""
        num_tokens, num_q_heads, head_dim = out.shape
        self._launch(self._ops("attn_merge"), (num_tokens * num_q_heads,), self._threads(head_dim),
                     (out_a, lse_a, out_b, lse_b, out, np.int32(head_dim)))

    def swiglu(self, gate, up, out):
        """out = silu(gate) * up, elementwise; out may alias gate or up."""
        n = gate.size
        threads = MAX_THREADS
        self._launch(self._ops("swiglu"), ((n + threads - 1) // threads,), threads, (gate, up, out, np.int64(n)))

    def clamped_swiglu(self, gate, up, order, ids, gate_bias, up_bias, alpha, limit, out):
        """gpt-oss's experts' activation over pair rows gate, up [N, F]: with e = ids.flat[order[n]] the pair's
        expert, g = min(gate + gate_bias[e], limit), u = clip(up + up_bias[e], -limit, limit), out = (u + 1) * g *
        sigmoid(alpha * g); out may alias gate or up."""
        n = gate.size
        threads = MAX_THREADS
        self._launch(self._ops("clamped_swiglu"), ((n + threads - 1) // threads,), threads,
                     (gate, up, order, ids, gate_bias, up_bias, out, np.int64(n), np.int32(gate.shape[1]),
                      np.float32(alpha), np.float32(limit)))

    def add_pair_bias(self, rows, order, ids, bias):
        """rows [N, H] += bias[e] (bias [E, H]) with e = ids.flat[order[n]], each pair row's expert."""
        n = rows.size
        threads = MAX_THREADS
        self._launch(self._ops("add_pair_bias"), ((n + threads - 1) // threads,), threads,
                     (rows, order, ids, bias, np.int64(n), np.int32(rows.shape[1])))

    def gather_rows(self, x, order, k, out):
        """out [N, H]: out[i] = x[order[i] // k]; order int32 [N]."""
        self._launch(self._ops("gather_rows"), (len(order),), self._threads(x.shape[1]),
                     (x, order, out, np.int32(k), np.int32(x.shape[1])))

    def decode_tiles(self, ids, slot_map, tiles):
        """One token's routing ids int32 [1, K] and slot_map int32 [E] -> tiles int32 [4, K] (see ops.cu)."""
        k = ids.shape[1]
        self._launch(self._ops("decode_tiles"), (1,), self._threads(k), (ids, slot_map, np.int32(k), tiles))

    def pack_decode(self, ids, weights, x, packed):
        """packed f32 [2K + H] = ids int32 [1, K] (as bits), weights [1, K], x [1, H]."""
        k, hidden = ids.shape[1], x.shape[1]
        n = 2 * k + hidden
        self._launch(self._ops("pack_decode"), ((n + MAX_THREADS - 1) // MAX_THREADS,), MAX_THREADS,
                     (ids, weights, x, packed, np.int32(k), np.int32(hidden)))

    def publish_decode(self, packed, box, flag, step, times):
        """The decode relay's post (ops.cu): packed f32 [n] (device) copied to box, then the device clock to
        times[0] and the step number step int64 [1] (device) holds to flag; box, flag, times: device addresses
        (np.uint64) of mapped host memory."""
        n = packed.size
        self._launch(self._ops("publish_decode"), (1,), self._threads(n), (packed, box, np.int32(n), flag, step,
                                                                             times))

    def await_host_add(self, out, rows, flag, step, timeout_ns, error, layer, times, add=True):
        """The decode relay's wait (ops.cu): once the host posts the step number step int64 [1] (device) holds on
        flag, out f32 [n] += rows [n] (add False: out = rows); after timeout_ns, or at once where error holds an
        earlier wait's failure, error [2] = (step, layer) instead. rows, flag, error, times: device addresses of
        mapped host memory (np.uint64)."""
        n = out.size
        self._launch(self._ops("await_host_add"), (1,), self._threads(n),
                     (out, rows, np.int32(n), flag, step, np.int64(timeout_ns), error, np.int32(layer), times,
                      np.int32(bool(add))))

    def add_into(self, out, src):
        """out += src, elementwise over contiguous arrays of one size; src may be a device address (np.uint64) of
        host memory the device reads directly."""
        n = out.size
        self._launch(self._ops("add_into"), ((n + MAX_THREADS - 1) // MAX_THREADS,), MAX_THREADS,
                     (out, src, np.int64(n)))

    def add_bias(self, x, bias):
        """x [T, R] += bias [R] in place (contiguous x)."""
        n = x.size
        self._launch(self._ops("add_bias"), ((n + MAX_THREADS - 1) // MAX_THREADS,), MAX_THREADS,
                     (x, bias, np.int64(n), np.int32(bias.shape[0])))
