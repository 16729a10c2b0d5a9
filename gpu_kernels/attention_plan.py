"""The paged attention's launch plans (kv.cu's paged_attention and paged_attention_1, kv_prefill.cu's paged_prefill):
which kernel, heads a block, key splits. Shape legend: T tokens, G query heads a kv head, Hkv kv heads, D head dim.
"""
from dataclasses import dataclass

PA_THREADS = 128  # kv.cu's PA_THREADS: threads of a paged attention block
PA_OUTS = 16  # kv.cu's PA_OUTS: output values a thread of the tiled kernel holds (rows * D <= PA_OUTS * PA_THREADS)
PA_MAX_ROWS = 16  # query rows (token, head) of a tiled block, sharing each K/V tile it loads
PA_MAX_HEAD_DIM = 256  # shared memory stays under 48 KiB up to here
PD_KEYS = 32  # kv.cu's PD_KEYS: keys a tile of the one-token kernel
PD_MAX_ROWS = 8  # heads of a one-token block
PD_MAX_HEAD_DIM = 128  # the one-token kernel's lane groups hold 4 values a lane, 32 lanes at most
SPLIT_BLOCKS = 512  # keys are split (flash-decoding) until a launch has about this many blocks
SPLIT_MIN_KEYS = 64  # fewest keys a split takes (a one-token block's key tiles are slow: the fewer a block the
# better, bench/results/vs_llamacpp_gpu.md)
MAX_SPLITS = 64
# One token over at most this many keys takes paged_attention_1s, a block a query head with rolled loops, without
# splits (faster than paged_attention_1 up to here: bench/results/vs_llamacpp_gpu.md); 0: never. A step graph plans
# for a power-of-two bound from 256 keys (hybrid/backends/gpu_step.py): its first one takes it.
SHORT_ATTENTION_KEYS = 256
PF_ROWS = 64  # kv_prefill.cu's PF_ROWS: query rows a block of the tensor-core prompt kernel
PF_KEYS = 32  # keys a split's length is a multiple of: kv_prefill.cu's PF_KEYS (32, f32 K/V 16)
PF_HEAD_DIMS = (64, 128)  # head dims paged_prefill takes
# A chunk of at least this many tokens takes paged_prefill where the GPU has its tensor-core path (prefill_mma): from
# 8 tokens (the fewest measured) on faster than paged_attention at the Qwen3-30B-A3B shape
# (bench/results/vs_llamacpp_gpu.md, session 50)
PREFILL_MIN_TOKENS = 8


def _pow2_at_least(n):
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class AttentionPlan:
    """A paged attention launch: which kernel, its rows (token, query head) a block and its key splits."""

    kernel: str  # "paged_attention_1(s)" (one token), "paged_attention" (tiles of rows), "paged_prefill" (mma)
    rows: int  # rows a block, of one kv head's T * G
    width: int  # lanes a key (one-token) or keys a tile (tiled, paged_prefill)
    num_tiles: int  # blocks over a kv head's rows
    splits: int  # key splits (1: the kernel writes `out` itself)
    split_keys: int  # keys a split
    shared_mem: int  # bytes


def prefill_mma(runtime):
    """Whether paged_prefill runs on `runtime`'s GPU: CUDA with mma.sync .tf32 (sm_80+), not HIP nor the NumPy
    stand-in (kv_prefill.cu's PF_MMA)."""
    device = getattr(runtime, "device", None)
    if getattr(runtime, "is_hip", True) or device is None:
        return False
    return int(getattr(device, "compute_capability", "0") or 0) >= 80


def attention_plan(num_tokens, group, num_kv_heads, head_dim, num_keys, warp_size=32, max_splits=MAX_SPLITS,
                   one_token_rows=PD_MAX_ROWS, short_keys=SHORT_ATTENTION_KEYS, mma=False,
                   prefill_tokens=PREFILL_MIN_TOKENS):
    """The paged attention launch over T tokens of G query heads a kv head and `num_keys` keys (those
    of the longest row). One token: its G heads share each K/V row in registers; more: tiles of rows
    share K/V tiles in shared memory. Keys split while the blocks are few (decode, long contexts).
    one_token_rows: most heads a one-token block takes (1, 2, 4 or 8: fewer make more, shorter blocks).
    short_keys: one token over at most this many keys, without splits, takes paged_attention_1s.
    mma: the GPU runs paged_prefill (prefill_mma): chunks of at least prefill_tokens tokens of its head dims take it."""
    if mma and num_tokens >= prefill_tokens and head_dim in PF_HEAD_DIMS:
        kernel, rows, width = "paged_prefill", PF_ROWS, PF_KEYS
        num_tiles, tile_keys, shared = -(-num_tokens * group // rows), PF_KEYS, 0  # static shared memory
    elif num_tokens == 1 and head_dim <= 4 * min(32, warp_size):
        kernel, rows = "paged_attention_1", min(one_token_rows, _pow2_at_least(group))
        width, tile_keys, num_tiles = max(8, _pow2_at_least(-(-head_dim // 4))), PD_KEYS, -(-group // rows)
        shared = rows * PD_KEYS + 5 * rows + PA_THREADS // width * rows * head_dim
    else:
        kernel, rows = "paged_attention", min(PA_MAX_ROWS, PA_OUTS * PA_THREADS // head_dim, num_tokens * group)
        width = tile_keys = 32 if head_dim <= 128 else 16
        num_tiles = -(-num_tokens * group // rows)
        shared = rows * head_dim + tile_keys * (2 * head_dim + 1) + rows * tile_keys + 3 * rows
    blocks, num_keys = num_tiles * num_kv_heads, max(int(num_keys), 1)
    splits = min(max_splits, -(-SPLIT_BLOCKS // blocks), num_keys // SPLIT_MIN_KEYS)
    split_keys = -(-num_keys // max(1, splits) // tile_keys) * tile_keys if splits > 1 else num_keys
    if num_tokens == 1 and num_keys <= short_keys and (
            head_dim <= PA_THREADS or head_dim % 4 == 0 and head_dim <= PA_MAX_HEAD_DIM):  # kv.cu's PS_SPANS
        shared = head_dim + num_keys + PA_THREADS // 32 + 4 * PA_THREADS + num_keys + 2  # kv.cu paged_attention_1s
        return AttentionPlan("paged_attention_1s", 1, 0, group, 1, num_keys, 4 * shared)
    return AttentionPlan(kernel, rows, width, num_tiles, -(-num_keys // split_keys), split_keys, 4 * shared)


def split_scratch_sizes(num_tokens, num_q_heads, num_kv_heads, head_dim, num_keys, warp_size, max_splits,
                        one_token_rows=PD_MAX_ROWS, short_keys=SHORT_ATTENTION_KEYS):
    """(values, rows) of the split scratch paged_attention needs over num_keys keys (0, 0: no splits)."""
    plan = attention_plan(num_tokens, num_q_heads // num_kv_heads, num_kv_heads, head_dim, num_keys, warp_size,
                          max_splits, one_token_rows, short_keys)
    rows = num_tokens * num_q_heads
    return (0, 0) if plan.splits == 1 else (plan.splits * rows * head_dim, plan.splits * rows)


def slots_plan(num_q_heads, num_kv_heads, head_dim, bound, warp_size=32, max_splits=MAX_SPLITS,
               one_token_rows=PD_MAX_ROWS, short_keys=SHORT_ATTENTION_KEYS):
    """The plan of one launch over several one-token sequences below `bound` keys each (kv.cu's one-token kernels,
    a slot's kv heads a run of grid y: slot_of_block), each slot's splits as one token's, or None where one token
    takes the tiled kernel (its head dim)."""
    plan = attention_plan(1, num_q_heads // num_kv_heads, num_kv_heads, head_dim, bound, warp_size, max_splits,
                          one_token_rows, short_keys)
    return plan if plan.kernel.startswith("paged_attention_1") else None
