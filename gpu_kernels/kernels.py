"""Python launchers of the GPU kernels: arrays and ints in, results written into caller-owned arrays.

Device arrays are the runtime's (CuPy). Shape legend: T tokens, H hidden, R output rows,
C columns, B bytes per row, nH heads, D head dim, Hq / Hkv query / kv heads, S cache positions,
E experts, K top-k, N pair rows, W work tiles, M gathered rows.
"""
import numpy as np
from gguf import GGMLQuantizationType as Q

from .sources import MATMUL_KERNELS, OPS_KERNELS, module_name, module_source

TILE_TOKENS = 8  # common.cuh's TILE_TOKENS: tokens per work tile of the tiled matmuls
UNIT_WEIGHTS = {Q.F32: 1, Q.F16: 1, Q.BF16: 1, Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16}
SLICE_WEIGHTS = {Q.F32: 4, Q.F16: 8, Q.BF16: 8, Q.Q8_0: 8, Q.Q4_0: 16, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 32}
MAX_THREADS = 256
MATMUL_THREADS = 256  # a matmul block: groups of `tpr` lanes, each on its own rows
DECODE_ROWS = 2  # rows a lane group of the one-token kernels works on (common.cuh's DECODE_ROWS)
LANE_SLICES = 2  # slices each lane of a group takes, about: sets the group's width (tpr)


def _pow2_at_least(n):
    return 1 << max(0, int(n) - 1).bit_length()


class Kernels:
    """decode_rows, lane_slices: tuning of the matmuls (the benchmark sweeps them)."""

    def __init__(self, runtime, stream=None, decode_rows=DECODE_ROWS, lane_slices=LANE_SLICES):
        self.rt, self.stream = runtime, stream
        self.warp = runtime.warp_size
        self.decode_rows, self.lane_slices = decode_rows, lane_slices
        self._functions = {}  # (qtype, kernel name) -> compiled function

    def _threads(self, work, cap=MAX_THREADS):
        """A power-of-two block size: enough for `work` items, at least one warp, at most `cap`."""
        return int(min(cap, max(self.warp, _pow2_at_least(work))))

    def _ops(self, name):
        return self.rt.compile("ops", module_source("ops"), OPS_KERNELS)[name]

    def _mm(self, qtype, name):
        key = (qtype, name)
        if key not in self._functions:  # the lookup runs at every launch: keep it to one dict read
            mod = module_name(qtype)
            source = f"#define DECODE_ROWS {self.decode_rows}\n" + module_source(mod)
            self._functions[key] = self.rt.compile(f"{mod}_r{self.decode_rows}", source, MATMUL_KERNELS)[name]
        return self._functions[key]

    def _launch(self, fn, grid, block, args, shared_mem=0):
        self.rt.launch(fn, grid, (block,), args, shared_mem=shared_mem, stream=self.stream)

    def _mm_threads(self, qtype, num_cols):
        return self._threads(num_cols // UNIT_WEIGHTS[Q(qtype)], cap=128)

    def _mm_shape(self, qtype, num_rows, num_cols, rows_per_group):
        """(lanes per group, blocks over the rows) of a matmul launch."""
        slices, rem = divmod(num_cols, SLICE_WEIGHTS[Q(qtype)])
        if rem:
            raise ValueError(f"{Q(qtype).name} matmul: {num_cols} columns, not a multiple of "
                             f"{SLICE_WEIGHTS[Q(qtype)]}")
        tpr = int(min(self.warp, _pow2_at_least(-(-slices // self.lane_slices))))
        per_block = MATMUL_THREADS // tpr * rows_per_group
        return tpr, (num_rows + per_block - 1) // per_block

    def matmul(self, raw, qtype, x, out):
        """out [T, R] = x [T, C] @ dequant(raw [R, B]).T; x and out contiguous."""
        num_tokens, num_cols = x.shape
        num_rows = raw.shape[0]
        one = num_tokens == 1
        tpr, num_blocks = self._mm_shape(qtype, num_rows, num_cols, self.decode_rows if one else 1)
        grid = (num_blocks, 1 if one else (num_tokens + TILE_TOKENS - 1) // TILE_TOKENS)
        self._launch(self._mm(qtype, "matmul_1" if one else "matmul"), grid, MATMUL_THREADS,
                     (raw, x, out, np.int32(num_tokens), np.int32(num_rows), np.int32(num_cols),
                      np.int64(raw.shape[-1]), np.int32(tpr)))

    def moe_matmul(self, raw, qtype, x, out, tile_slot, tile_row, tile_count, tile_tokens=TILE_TOKENS):
        """out [N, R] = per work tile w: x[rows of w] @ dequant(raw [S, R, B][tile_slot[w]]).T; tiles int32 [W]
        of at most `tile_tokens` rows (1: the one-row kernel, else TILE_TOKENS)."""
        num_rows, num_cols = raw.shape[1], x.shape[1]
        one = tile_tokens == 1
        tpr, num_blocks = self._mm_shape(qtype, num_rows, num_cols, self.decode_rows if one else 1)
        self._launch(self._mm(qtype, "moe_matmul_1" if one else "moe_matmul"), (num_blocks, len(tile_slot)),
                     MATMUL_THREADS, (raw, x, out, tile_slot, tile_row, tile_count, np.int32(num_rows),
                                      np.int32(num_cols), np.int64(raw.shape[-1]), np.int32(tpr)))

    def dequant_rows(self, raw, qtype, row_ids, out):
        """out [M, C] = dequant(raw [rows, B][row_ids]); row_ids int64 [M] on the device."""
        num_cols = out.shape[1]
        self._launch(self._mm(qtype, "dequant_rows"), (len(row_ids),), self._mm_threads(qtype, num_cols),
                     (raw, row_ids, out, np.int32(num_cols), np.int64(raw.shape[-1])))

    def rmsnorm(self, x, weight, eps, out):
        """x [rows, H], weight [H] -> out [rows, H]; out may be x."""
        num_rows, hidden = x.shape
        threads = self._threads(hidden)
        self._launch(self._ops("rmsnorm"), (num_rows,), threads, (x, weight, out, np.int32(hidden), np.float32(eps)),
                     shared_mem=threads * 4)

    def rope_neox(self, x, positions, inv_freq):
        """In place over x [T, nH, D]; positions int64 [T], inv_freq f32 [D/2] on the device."""
        num_tokens, num_heads, head_dim = x.shape
        self._launch(self._ops("rope_neox"), (num_tokens,), self._threads(num_heads * head_dim // 2),
                     (x, positions, inv_freq, np.int32(num_heads), np.int32(head_dim)))

    def attention(self, q, k_cache, v_cache, start, scale, out):
        """q [T, Hq, D], k_cache / v_cache [S, Hkv, D] -> out [T, Hq, D], causal from position `start`."""
        num_tokens, num_q_heads, head_dim = q.shape
        threads = max(self._threads(start + num_tokens), _pow2_at_least(head_dim))
        self._launch(self._ops("attention"), (num_tokens * num_q_heads,), threads,
                     (q, k_cache, v_cache, out, np.int32(num_q_heads), np.int32(k_cache.shape[1]),
                      np.int32(head_dim), np.int32(start), np.float32(scale)),
                     shared_mem=(head_dim + 2 * threads) * 4)

    def swiglu(self, gate, up, out):
        """out = silu(gate) * up, elementwise; out may alias gate or up."""
        n = gate.size
        threads = MAX_THREADS
        self._launch(self._ops("swiglu"), ((n + threads - 1) // threads,), threads, (gate, up, out, np.int64(n)))

    def route_topk(self, logits, k, normalize, ids, weights):
        """logits [T, E] -> ids int32 [T, K], weights f32 [T, K]."""
        num_tokens, num_experts = logits.shape
        threads = self._threads(num_tokens, cap=128)
        self._launch(self._ops("route_topk"), ((num_tokens + threads - 1) // threads,), threads,
                     (logits, ids, weights, np.int32(num_tokens), np.int32(num_experts), np.int32(k),
                      np.int32(bool(normalize))))

    def gather_rows(self, x, order, k, out):
        """out [N, H]: out[i] = x[order[i] // k]; order int32 [N]."""
        self._launch(self._ops("gather_rows"), (len(order),), self._threads(x.shape[1]),
                     (x, order, out, np.int32(k), np.int32(x.shape[1])))

    def decode_tiles(self, ids, slot_map, tiles):
        """One token's routing ids int32 [1, K] and slot_map int32 [E] -> tiles int32 [4, K] (see ops.cu)."""
        k = ids.shape[1]
        self._launch(self._ops("decode_tiles"), (1,), self._threads(k), (ids, slot_map, np.int32(k), tiles))

    def add_into(self, out, src):
        """out += src, elementwise over contiguous arrays of one size."""
        n = out.size
        self._launch(self._ops("add_into"), ((n + MAX_THREADS - 1) // MAX_THREADS,), MAX_THREADS,
                     (out, src, np.int64(n)))

    def combine_rows(self, expert_out, row_of_pair, weights, k, out):
        """out [T, H] = per token the weighted sum of its pair rows held in expert_out [N, H]."""
        self._launch(self._ops("combine_rows"), (out.shape[0],), self._threads(out.shape[1]),
                     (expert_out, row_of_pair, weights, out, np.int32(k), np.int32(out.shape[1])))

