"""Work split, argument checks, random blocks and the public wrappers shared by every format.

A work item is (expert, first row, first token, end token, token chunk, end row): output rows
of one expert for at most TOKENS_PER_ITEM of its tokens (integer prefill on long rows: a whole group's,
prefill_span). Prefill items (several tokens) take
ROWS_PER_ITEM rows, unpack them to float32 once and multiply them with every token of the item
(`prefill`). Decode items (one token) dot each row straight from its blocks and take more rows
while the threads still get DECODE_ITEMS_PER_THREAD items each: an item costs ~170 ns of calls
and views besides its dots (1 thread, Q4_K, hot cache), a tenth of a 16-row item's time.
A group of at most DECODE_MAX_TOKENS tokens (a verification step's 1 + k tokens of one sequence, an
expert's few tokens) is split into decode items, one token each, the tokens of one row range next to
each other so that its rows are read from cache after the first: a prefill item computes 16 or 32
token columns whatever its count (2 tokens cost 8x one), and each token's dots are then the very
ones a one-token step computes, so scoring drafts gives plain decoding's logits bit for bit.

Shape legend: R output rows, C columns, B bytes per row, T tokens, E experts,
N (token, expert) rows sorted by group, G groups, W work items.
"""
import numpy as np
from numba import njit, prange

from .act_quant import FLOAT, act_quant_code
from .simd import num_threads
from .twins import serial_twin

ROWS_PER_ITEM = 16  # output rows of a prefill work item (and the fewest of a decode item)
DECODE_MAX_ROWS_PER_ITEM = 128  # most output rows of a decode (one-token) work item of long rows
DECODE_MAX_ITEM_BYTES = 512 << 10  # short rows: a decode item grows to this many weight bytes
DECODE_ITEMS_PER_THREAD = 4  # decode items grow while each thread keeps at least this many
TOKENS_PER_ITEM = 64  # tokens per work item: each unpacked weight row serves up to 64 tokens
WHOLE_SHARES = 4  # on several threads whole-group prefill items span at most 1 / (4 threads) of a call's rows
WHOLE_MIN_ROW_BYTES = 1024  # and only for rows of this many bytes or more: short rows unpack cheaply, and one token
# chunk's panel (128 bytes a column) of a few hundred columns stays near L1 across that chunk's items (Q6_K [2048, 512]
# measured slower with whole-group items)
WHOLE_PANEL_BYTES = 5 << 18  # and at most so many tokens that an item's token panels (2.25 bytes a token and column:
# int16 x, and a float scale and sum per 32 columns) fit 1.25 MiB, most of a 2 MiB L2 (256 tokens of 2048 columns do):
# every item of 16 rows reads them all (256 tokens of 4096 columns, 2.3 MB, from L3: Q4_K [2048, 4096] 1.12x slower)
DECODE_MAX_TOKENS = 8  # groups of at most this many tokens are split into one-token (decode) items
PROMPT_ITEM_MAX_TOKENS = 12  # a prompt's int16 groups of at most this many tokens run as several-token decode items
# (PROMPT_ITEMS): a 9-12-token group's prefill tile fills 9-12 of its 16 token lanes and unpacks its rows for them
# alone (Q4_K [512, 2048] 27 GMAC/s, Q6_K [2048, 512] 26, 1 thread), where passes of 4 tokens run ~40 and ~34
NO_CHUNK = -1  # the token chunk of a decode item: no panel (a 256-token prompt over 512 experts, top-10, made
# ~2,500 one-token panels of 300 KB each when decode items had chunks: 60 % of its experts' time)
PROMPT_ITEMS = 4  # added to an act_quant code: a prompt's call, whose int16 groups of a few tokens run as decode items
# of all their tokens (cpu_kernels/tokens_dot.py: the rows unpacked once for them; rounds ~1e-7 apart from the
# one-token dots, so a verification step, which must give one-token steps' logits bit for bit, does not ask it)
PARALLEL_MIN_SUM_ROWS = 256  # sub_block_sums of fewer rows run serially (no parallel region to open)

ONE_EXPERT = np.zeros(1, dtype=np.int64)  # expert_ids of a plain matmul
ONE_ROW = np.array([0, 1], dtype=np.int64)  # row_starts of a plain matvec
KERNELS = {}  # format module name: (moe_kernel, moe_kernel_serial), as format_api got them


@njit(nogil=True, cache=True)
def work_items(expert_ids, row_starts, num_experts, num_rows, row_bytes=0, several=False, whole=False, num_cols=0):
    """Split every group into (rows, tokens) tiles: [W, 6] of (expert, first row, first token, end token,
    token chunk, end row), the token chunk numbering the distinct (first token, end token) ranges of the prefill
    items from 0 (their token panels: prefill.token_panels). Groups of at most DECODE_MAX_TOKENS tokens get
    one-token (decode) items of decode_rows_per_item rows (rows of row_bytes bytes: 0 unknown), each row range's
    tokens in a row, token chunk NO_CHUNK (they read x, no panel), or with `several` groups of at most
    PROMPT_ITEM_MAX_TOKENS one decode item of all the group's tokens a row range (PROMPT_ITEMS); the others
    ROWS_PER_ITEM rows by TOKENS_PER_ITEM tokens, or with `whole` (integer prefill: its tiles unpack an item's rows
    once for all its token chunks) by prefill_span tokens (rows of num_cols columns; 0 unknown), an item's token
    chunks numbered one after another from its token chunk."""
    decode_max = PROMPT_ITEM_MAX_TOKENS if several else DECODE_MAX_TOKENS
    num_decode = 0
    for g in range(expert_ids.shape[0]):
        if not 0 <= expert_ids[g] < num_experts or row_starts[g + 1] < row_starts[g]:
            raise ValueError("moe_matmul: expert_ids out of range or row_starts decreasing")
        num_tokens = row_starts[g + 1] - row_starts[g]
        if num_tokens <= decode_max:
            num_decode += 1 if several else num_tokens
    decode_rows = decode_rows_per_item(num_decode, num_rows, num_threads(), row_bytes)
    whole = whole and row_bytes >= WHOLE_MIN_ROW_BYTES
    span = prefill_span(row_starts, num_threads(), num_cols) if whole else TOKENS_PER_ITEM
    num_items = 0
    for g in range(expert_ids.shape[0]):
        num_tokens = row_starts[g + 1] - row_starts[g]
        if num_tokens <= decode_max:
            num_items += (num_rows + decode_rows - 1) // decode_rows * (1 if several else num_tokens)
        else:
            num_items += (num_rows + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM * ((num_tokens + span - 1) // span)
    items = np.empty((num_items, 6), dtype=np.int64)  # [W, 6]
    i = 0
    chunk = 0
    for g in range(expert_ids.shape[0]):
        t0, t1 = row_starts[g], row_starts[g + 1]
        if t1 - t0 <= decode_max and several:
            for r0 in range(0, num_rows, decode_rows):
                _set_item(items, i, expert_ids[g], r0, t0, t1, NO_CHUNK, min(r0 + decode_rows, num_rows))
                i += 1
            continue
        if t1 - t0 <= DECODE_MAX_TOKENS:
            for r0 in range(0, num_rows, decode_rows):
                for t in range(t0, t1):
                    _set_item(items, i, expert_ids[g], r0, t, t + 1, NO_CHUNK, min(r0 + decode_rows, num_rows))
                    i += 1
            continue
        for c0 in range(t0, t1, span):
            c1 = min(c0 + span, t1)
            for r0 in range(0, num_rows, ROWS_PER_ITEM):
                _set_item(items, i, expert_ids[g], r0, c0, c1, chunk, min(r0 + ROWS_PER_ITEM, num_rows))
                i += 1
            chunk += (c1 - c0 + TOKENS_PER_ITEM - 1) // TOKENS_PER_ITEM
    return items


@njit(nogil=True, cache=True)
def prefill_span(row_starts, threads, num_cols=0):
    """Tokens of a whole-group prefill item (work_items' `whole`), a multiple of TOKENS_PER_ITEM: every group
    whole on one thread; on several at most 1 / (WHOLE_SHARES threads) of the call's (token, expert) rows, at
    least TOKENS_PER_ITEM (a parallel region hands each thread a run of items, and an item costs its token
    count: a run of a few whole large groups would hold up the others); for rows of num_cols columns (0 unknown)
    at most the tokens whose panels fit WHOLE_PANEL_BYTES."""
    num_rows = row_starts[-1] - row_starts[0]
    share = num_rows if threads == 1 else num_rows // (WHOLE_SHARES * threads)
    if num_cols > 0:
        share = min(share, 4 * WHOLE_PANEL_BYTES // (9 * num_cols) // TOKENS_PER_ITEM * TOKENS_PER_ITEM)
    return max(TOKENS_PER_ITEM, (share + TOKENS_PER_ITEM - 1) // TOKENS_PER_ITEM * TOKENS_PER_ITEM)


@njit(inline="always", nogil=True)
def _set_item(items, i, expert, r0, t0, t1, chunk, r1):
    items[i, 0], items[i, 1], items[i, 2], items[i, 3], items[i, 4], items[i, 5] = expert, r0, t0, t1, chunk, r1


@njit(nogil=True, cache=True)
def decode_rows_per_item(num_groups, num_rows, threads, row_bytes=0):
    """Rows of a decode item: ROWS_PER_ITEM, doubled up to DECODE_MAX_ROWS_PER_ITEM (for rows of row_bytes bytes,
    up to DECODE_MAX_ITEM_BYTES where that is more rows) while the num_groups one-token groups of num_rows rows
    still give each of `threads` threads DECODE_ITEMS_PER_THREAD items. An item's rows are read as four streams
    (simd.row_streams), which the prefetchers take a while to follow: short rows in 128-row items made streams
    too short (Q6_K rows of 512 weights, one thread: 1024-row items 20 % faster)."""
    most = DECODE_MAX_ROWS_PER_ITEM
    if row_bytes > 0:
        most = max(most, DECODE_MAX_ITEM_BYTES // row_bytes)
    span = ROWS_PER_ITEM
    while (2 * span <= most
           and num_groups * ((num_rows + 2 * span - 1) // (2 * span)) >= DECODE_ITEMS_PER_THREAD * threads):
        span *= 2
    return span


@njit(nogil=True, cache=True)
def sub_block_sums(x):
    """x f32 [N, C] -> [N, C/32], the sums over each 32-column sub-block (K-quants' min terms)."""
    if x.shape[0] >= PARALLEL_MIN_SUM_ROWS:
        return _sub_block_sums(x)
    return _sub_block_sums_serial(x)


@njit(nogil=True, cache=True)
def decode_sub_block_sums(x, act_quant):
    """sub_block_sums(x) where the K-quants' float decode dots use them (act_quant FLOAT), else empty
    [0, C/32]: the integer dots carry their own sums, and prefill tiles unpack whole rows."""
    if act_quant == FLOAT:
        return sub_block_sums(x)
    return np.empty((0, x.shape[1] // 32), dtype=np.float32)


@njit(parallel=True, nogil=True, cache=True)
def _sub_block_sums(x):
    out = np.empty((x.shape[0], x.shape[1] // 32), dtype=np.float32)  # [N, C/32]
    for n in prange(x.shape[0]):
        _row_sub_block_sums(x[n], out[n])
    return out


@njit(nogil=True, fastmath=True, cache=True)
def _row_sub_block_sums(row, out):
    for j in range(row.shape[0] // 32):
        s = np.float32(0)
        for c in range(32 * j, 32 * j + 32):
            s += row[c]
        out[j] = s


_sub_block_sums_serial = serial_twin(_sub_block_sums)


def num_cols(raw, block_size, block_bytes, name):
    """C of raw uint8 [..., B]; raises unless B is whole blocks."""
    if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % block_bytes:
        raise ValueError(f"{name}: raw {raw.dtype} {raw.shape} is not uint8 rows of {block_bytes}-byte blocks")
    return raw.shape[-1] // block_bytes * block_size


def check_dequantize(raw, out, block_size, block_bytes, name):
    """Raise unless out is f32 [..., C] matching raw [..., B]."""
    cols = num_cols(raw, block_size, block_bytes, name)
    if out.dtype != np.float32 or out.shape != (*raw.shape[:-1], cols):
        raise ValueError(f"{name}.dequantize: out {out.dtype} {out.shape} should be float32 {(*raw.shape[:-1], cols)}")


def kernels_of(fmt, raw):
    """(moe_kernel, moe_kernel_serial, C) of format module `fmt` for a weight raw [E, R, B] checked once here,
    for callers that then pass their own consistent x, groups and outs on every call (the decode hot path)."""
    cols = num_cols(raw, fmt.BLOCK_SIZE, fmt.BLOCK_BYTES, fmt.__name__)
    if raw.ndim != 3:
        raise ValueError(f"{fmt.__name__}: raw {raw.shape} is not [E, R, B]")
    return (*KERNELS[fmt.__name__], cols)


def check_moe(raw, x, expert_ids, row_starts, out, block_size, block_bytes, name):
    """Raise unless the moe_matmul arguments have consistent shapes and dtypes."""
    cols = num_cols(raw, block_size, block_bytes, name)
    if (
        raw.ndim != 3 or x.ndim != 2 or x.shape[1] != cols or out.shape != (x.shape[0], raw.shape[1])
        or x.dtype != np.float32 or out.dtype != np.float32
        or expert_ids.dtype != np.int64 or row_starts.dtype != np.int64
        or row_starts.shape != (expert_ids.shape[0] + 1,)
        or row_starts[0] != 0 or row_starts[-1] != x.shape[0]
    ):
        raise ValueError(
            f"{name}.moe_matmul: raw {raw.shape}, x {x.dtype} {x.shape}, expert_ids {expert_ids.dtype} "
            f"{expert_ids.shape}, row_starts {row_starts.dtype} {row_starts.shape}, out {out.dtype} {out.shape} "
            f"do not fit raw [E, R, B], x f32 [N, {cols}], int64 [G], int64 [G+1] from 0 to N, out f32 [N, R]"
        )


def format_api(name, block_size, block_bytes, unpack_rows, moe_kernel, moe_kernel_serial=None):
    """A format's public (dequantize, matvec, matmul, moe_matmul, moe_matmul_pair) around its two kernels.

    unpack_rows(raw uint8 [R, B], out f32 [R, C]) and moe_kernel(raws: tuple of raw [E, R, B],
    x f32 [N, C], expert_ids int64 [G], row_starts int64 [G+1], outs: tuple of f32 [N, R], act_quant)
    get checked arguments; moe_kernel runs every weight of the tuple in one parallel region.
    moe_kernel_serial (default: its serial twin) runs small matvecs without opening a region.
    act_quant: how decode rows multiply, "int16" or "float" (act_quant module); None: STRATA_ACT_QUANT.
    """
    moe_kernel_serial = moe_kernel_serial or serial_twin(moe_kernel)
    KERNELS[name] = (moe_kernel, moe_kernel_serial)

    def dequantize(raw, out):
        """raw uint8 [..., B] -> out f32 [..., C], bit-exact with gguf.quants.dequantize."""
        check_dequantize(raw, out, block_size, block_bytes, name)
        unpack_rows(raw.reshape(-1, raw.shape[-1]), out.reshape(-1, out.shape[-1]))

    def matvec(raw, x, out, serial=False, act_quant=None):
        """out [R] = W @ x [C] for raw uint8 [R, B] (decode); serial: on the calling thread only (small weights)."""
        if serial:
            x, out = x.reshape(1, -1), out.reshape(1, -1)
            check_moe(raw.reshape(1, *raw.shape), x, ONE_EXPERT, ONE_ROW, out, block_size, block_bytes, name)
            moe_kernel_serial((raw.reshape(1, *raw.shape),), x, ONE_EXPERT, ONE_ROW, (out,), act_quant_code(act_quant))
        else:
            matmul(raw, x.reshape(1, -1), out.reshape(1, -1), act_quant)

    def matmul(raw, x, out, act_quant=None):
        """out [T, R] = x [T, C] @ W.T for raw uint8 [R, B] (prefill)."""
        moe_matmul(raw.reshape(1, *raw.shape), x, ONE_EXPERT, np.array([0, x.shape[0]]), out, act_quant)

    def moe_matmul(raw, x, expert_ids, row_starts, out, act_quant=None):
        """out[row_starts[g]:row_starts[g+1]] = x[same rows] @ W[expert_ids[g]].T; raw [E, R, B], x [N, C], out [N, R]."""
        check_moe(raw, x, expert_ids, row_starts, out, block_size, block_bytes, name)
        moe_kernel((raw,), x, expert_ids, row_starts, (out,), act_quant_code(act_quant))

    def moe_matmul_pair(raw_a, raw_b, x, expert_ids, row_starts, out_a, out_b, act_quant=None):
        """moe_matmul of two weights of one shape (an expert's gate and up) on the same rows, in one parallel region."""
        check_moe(raw_a, x, expert_ids, row_starts, out_a, block_size, block_bytes, name)
        check_moe(raw_b, x, expert_ids, row_starts, out_b, block_size, block_bytes, name)
        if raw_a.shape != raw_b.shape or raw_a.flags.writeable != raw_b.flags.writeable:
            raise ValueError(f"{name}.moe_matmul_pair: raw_a {raw_a.shape} and raw_b {raw_b.shape} differ in shape "
                             "or writeability")
        moe_kernel((raw_a, raw_b), x, expert_ids, row_starts, (out_a, out_b), act_quant_code(act_quant))

    api = (dequantize, matvec, matmul, moe_matmul, moe_matmul_pair)
    for fn in api:
        fn.__module__, fn.__qualname__ = name, fn.__name__
    return api


def random_scales(rng, num_blocks, scale):
    """[num_blocks, 2] uint8: little-endian f16 block scales of about `scale` (0.5x to 1.5x, random sign)."""
    d = scale * rng.uniform(0.5, 1.5, size=num_blocks) * rng.choice([-1.0, 1.0], size=num_blocks)
    return d.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)


def random_weight(rng, shape, block_size, block_bytes, scale_offsets, unit_rms, scale):
    """Random raw bytes [..., C // block_size * B] with the f16 scales at `scale_offsets` set so values have rms ~ scale.

    scale_offsets: (byte offset, factor) of each f16 field, set to factor * d with d > 0.
    unit_rms: the rms of the dequantized values when those f16 scales are 1 (from the random quants).
    """
    *lead, cols = shape
    if cols % block_size:
        raise ValueError(f"random_blocks: {cols} columns is not a multiple of {block_size}")
    num_blocks = int(np.prod(lead, dtype=np.int64)) * (cols // block_size)
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)  # [blocks, B]
    d = (scale / unit_rms * rng.uniform(0.5, 1.5, size=num_blocks)).astype(np.float16)
    for offset, factor in scale_offsets:
        blocks[:, offset:offset + 2] = (d * np.float16(factor)).view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(*lead, cols // block_size * block_bytes)
