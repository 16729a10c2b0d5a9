"""Python launchers of the routers (src/routing.cu) and the fused launches of a decode step (src/ops.cu, the expert
matmuls' pair and SwiGLU kernels of src/matmul.cu), a mixin of gpu_kernels.kernels.Kernels: device arrays in, results
written into caller-owned arrays.

Shape legend: T tokens, E experts, K top-k, H hidden, nH heads, D head dim, S expert slots, R rows, C columns, B bytes
a row, N pair rows, P pairs, n one-token sequences (slots), Hq / Hkv query / kv heads, NB pool blocks, BT tokens a block,
nb table entries a slot.
"""
import numpy as np

from .attention_plan import PA_THREADS, slots_plan

MATMUL_THREADS = 256  # common.cuh's MATMUL_THREADS: a matmul block, groups of `tpr` lanes each on its own rows

ROUTE_LANES = 32  # routing.cu's ROUTE_LANES: lanes routing a token
ROUTE_MAX_EXPERTS = 32 * 16  # ROUTE_LANES * routing.cu's ROUTE_HELD
ROUTE_TOKENS = 4  # tokens a router block
NORM_MAX_THREADS = 1024  # a norm block's threads (ops.cu norm_row): a float4 each up to rows of 4096
COMBINE_THREADS = 128  # a combine_rows block's threads (4 columns each): a one-token row over several blocks


class OpsLaunchers:
    """Kernels' launchers of the routers, norms and fused ops (uses Kernels' rt, _ops, _launch, _threads, _mm_launch,
    _mm_grid_x, _x_arg)."""

    def norm_threads(self, hidden):
        """Threads of a norm block over rows of `hidden` values (ops.cu norm_row: a float4 a thread up to 1024 threads
        where hidden % 4 == 0)."""
        return self._threads(hidden // 4 if hidden % 4 == 0 else hidden, cap=NORM_MAX_THREADS)

    def rmsnorm(self, x, weight, eps, out):
        """x [rows, H], weight [H] -> out [rows, H]; out may be x."""
        num_rows, hidden = x.shape
        threads = self.norm_threads(hidden)
        self._launch(self._ops("rmsnorm"), (num_rows,), threads, (x, weight, out, np.int32(hidden), np.float32(eps)),
                     shared_mem=threads // 8)

    def combine_rows(self, expert_out, row_of_pair, weights, k, out):
        """out [T, H] = per token the weighted sum of its pair rows held in expert_out [N, H]."""
        num_tokens, hidden = out.shape
        threads = self._threads(-(-hidden // 4), cap=COMBINE_THREADS)
        self._launch(self._ops("combine_rows"), (num_tokens, -(-hidden // (4 * threads))), threads,
                     (expert_out, row_of_pair, weights, out, np.int32(k), np.int32(hidden)), shared_mem=8 * k)

    def _route(self, name, logits, k, arrays, after=()):
        """A router launch (routing.cu), arguments (logits, *arrays, T, E, K, *after): a group of ROUTE_LANES lanes a
        token, ROUTE_TOKENS tokens a block."""
        num_tokens, num_experts = logits.shape
        if not (1 <= k <= min(ROUTE_LANES, num_experts) and num_experts <= ROUTE_MAX_EXPERTS):
            raise ValueError(f"{name}: top {k} of {num_experts} experts (at most {ROUTE_MAX_EXPERTS} experts and "
                             f"top {ROUTE_LANES})")
        if num_tokens == 0:
            return
        per_block = min(ROUTE_TOKENS, num_tokens)
        self._launch(self._ops(name), (-(-num_tokens // per_block),), ROUTE_LANES * per_block,
                     (logits, *arrays, np.int32(num_tokens), np.int32(num_experts), np.int32(k), *after))

    def route_topk(self, logits, k, normalize, ids, weights):
        """logits [T, E] -> ids int32 [T, K], weights f32 [T, K]."""
        self._route("route_topk", logits, k, (ids, weights), (np.int32(bool(normalize)),))

    def route_topk_softmax(self, logits, k, ids, weights):
        """logits [T, E] -> the K largest (ids int32 [T, K]) and the softmax over those K (weights f32 [T, K])."""
        self._route("route_topk_softmax", logits, k, (ids, weights))

    def route_sigmoid(self, logits, bias, k, num_groups, topk_groups, normalize, scale, ids, weights):
        """logits [T, E], choice bias [E] -> ids int32 [T, K], weights f32 [T, K] (routing.cu route_sigmoid)."""
        num_experts = logits.shape[1]
        if num_groups > 64 or num_experts % num_groups:
            raise ValueError(f"route_sigmoid: {num_experts} experts in {num_groups} groups (at most 64 equal ones)")
        self._route("route_sigmoid", logits, k, (bias, ids, weights),
                    (np.int32(num_groups), np.int32(topk_groups), np.int32(bool(normalize)), np.float32(scale)))

    def add_rmsnorm(self, x, y, weight, eps, out):
        """x [T, H] += y [T, H], then out [T, H] = rmsnorm(x) (weight [H]): add_into and rmsnorm in one launch."""
        num_rows, hidden = x.shape
        threads = self.norm_threads(hidden)
        self._launch(self._ops("add_rmsnorm"), (num_rows,), threads,
                     (x, y, weight, out, np.int32(hidden), np.float32(eps)), shared_mem=threads // 8)

    def qk_norm_rope(self, x, q_weight, k_weight, num_q_heads, eps, positions, inv_freq, scale=1.0):
        """In place over x [T, nH, D] (contiguous): each head RMSNormed (the first num_q_heads with q_weight [D], the
        rest with k_weight [D]), then rope_neox's rotation of its first 2 * len(inv_freq) dims; positions int64 [T],
        inv_freq f32 [R/2] on the device. rmsnorm over the heads, then rope_neox, in one launch."""
        num_tokens, num_heads, head_dim = x.shape
        threads = self._threads(head_dim)
        self._launch(self._ops("qk_norm_rope"), (num_tokens * num_heads,), threads,
                     (x, q_weight, k_weight, np.int32(num_heads), np.int32(num_q_heads), np.int32(head_dim),
                      np.float32(eps), positions, inv_freq, np.int32(inv_freq.shape[0]), np.float32(scale)),
                     shared_mem=4 * (threads + head_dim))

    def decode_pairs(self, ids, slot_map, k, tiles, x, xs):
        """decode_tiles(ids, slot_map, tiles) over ids int32 [1, P] and gather_rows(x, arange(P), k, xs) (x [P / k, H]
        -> xs [P, H]) in one launch (a float4 a thread where H % 4 == 0)."""
        num_pairs, hidden = ids.shape[1], x.shape[1]
        self._launch(self._ops("decode_pairs"), (num_pairs,), self._threads(-(-hidden // 4), cap=512),
                     (ids, slot_map, np.int32(num_pairs), np.int32(k), tiles, x, xs, np.int32(hidden)))

    def decode_groups(self, ids, slot_map, tile_tokens, order, tiles):
        """A decode step's resident pairs grouped by expert (moe_parts.cu decode_groups): ids int32 [1, P], slot_map
        int32 [E] -> order int32 [P] (the pair of each row) and tiles int32 [4, P] (work tiles of at most tile_tokens
        rows of one expert, then each pair's row), for gather_rows and the tiled expert matmuls."""
        num_pairs = ids.shape[1]
        threads = self._threads(num_pairs, cap=1024)
        self._launch(self._ops("decode_groups"), (1,), threads,
                     (ids, slot_map, np.int32(num_pairs), np.int32(tile_tokens), order, tiles), shared_mem=16 * threads)

    def moe_matmul2(self, raw, raw2, qtype, x, out, out2, tile_slot, tile_row, tile_count):
        """moe_matmul's one-row kernel of raw and of raw2 (one format and shape [S, R, B]: gate and up) over the same
        x and tiles into out and out2 [N, R], in one launch."""
        fn, num_blocks, scalars, shared = self._mm_launch(qtype, "moe_matmul2_1", raw.shape[1], x.shape[1],
                                                          raw.shape[-1], True, num_tiles=2 * len(tile_slot))
        grid_x, chunks = self._mm_grid_x(fn, num_blocks, 2 * len(tile_slot), shared, True)
        self._launch(fn, (grid_x, 2 * len(tile_slot)), MATMUL_THREADS,
                     (raw, raw2, self._x_arg(fn, qtype, x), out, out2, tile_slot, tile_row, tile_count) + scalars
                     + (chunks,),
                     shared_mem=shared)

    def moe_matmul_glu(self, raw, qtype, gate, up, out, tile_slot, tile_row, tile_count):
        """moe_matmul's one-row kernel over silu(gate) * up (gate, up [N, C]: the swiglu kernel's values) into out
        [N, R], in one launch; only where fuses_glu(act_quant, qtype, C)."""
        fn, num_blocks, scalars, shared = self._mm_launch(qtype, "moe_matmul_glu_1", raw.shape[1], gate.shape[1],
                                                          raw.shape[-1], True, num_tiles=len(tile_slot))
        grid_x, chunks = self._mm_grid_x(fn, num_blocks, len(tile_slot), shared, True)
        x = (self._x_arg(fn, qtype, gate, up),) if fn in self._xq_kernels else (gate, up)  # moe_matmul_1qx's
        self._launch(fn, (grid_x, len(tile_slot)), MATMUL_THREADS,
                     (raw, *x, out, tile_slot, tile_row, tile_count) + scalars + (chunks,), shared_mem=shared)

    def paged_attention_slots(self, kv_dtype, q, k_pool, v_pool, k_scale, v_scale, tables, positions, bound, scale,
                              out, lse=None, window=0, scratch=None):
        """out [n, Hq, D] = each slot t's one-token causal GQA attention: q [n, Hq, D]'s row t at position
        positions[t] (int64 [n] on the device, below `bound`) over keys [0, positions[t]] (the last `window` where
        > 0) of the paged cache k_pool / v_pool [NB, BT, Hkv, D] (k_scale / v_scale [NB, BT, Hkv] for int8, else
        None) through tables int32 [n, nb]'s row t; lse [n, Hq] gets each row's log-sum-exp where given. One launch of
        the one-token kernel attention_plan.slots_plan gives (a slot's kv heads a run of grid y), and where its keys
        split, one merge: scratch = (parts f32 [S * n * Hq * D], their lse [S * n * Hq]), which a captured step
        keeps (split_scratch_sizes with n tokens gives the sizes)."""
        num_slots, num_q_heads, head_dim = q.shape
        _, block_tokens, num_kv_heads, _ = k_pool.shape
        plan = slots_plan(num_q_heads, num_kv_heads, head_dim, bound, self.warp, self.max_splits,
                          self.attention_rows, self.short_attention_keys)
        if plan is None:
            raise ValueError(f"paged_attention_slots: one token of head dim {head_dim} takes the tiled kernel")
        num_rows = num_slots * num_q_heads
        if plan.splits == 1:
            target, target_lse, want_lse = out, self._or_dummy(lse), int(lse is not None)
        elif scratch is None or scratch[0].size < plan.splits * num_rows * head_dim:
            raise ValueError(f"paged_attention_slots: {plan.splits} key splits need their scratch")
        else:
            (target, target_lse), want_lse = scratch, 1
        args = (q, k_pool, v_pool, *map(self._or_dummy, (k_scale, v_scale)), tables,
                *map(self._or_dummy, (None,) * 4), target, target_lse, np.int32(want_lse),
                np.int32(num_q_heads), np.int32(num_kv_heads), np.int32(head_dim), np.int32(block_tokens),
                np.int32(bound - 1), np.int32(0), np.float32(scale), np.int32(plan.rows), np.int32(plan.width),
                np.int32(plan.split_keys), positions, np.int32(window), np.int32(tables.shape[1]))
        self._launch(self._kv(kv_dtype, plan.kernel), (plan.num_tiles, num_kv_heads * num_slots, plan.splits),
                     PA_THREADS, args, shared_mem=plan.shared_mem)
        if plan.splits > 1:
            self._launch(self._kv(kv_dtype, "paged_attention_merge"), (num_rows,), self._threads(head_dim),
                         (target, target_lse, out, self._or_dummy(lse), np.int32(lse is not None),
                          np.int32(plan.splits), np.int32(num_rows), np.int32(head_dim)), shared_mem=4 * plan.splits)
