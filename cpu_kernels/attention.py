"""Causal grouped-query attention of one sequence segment against its paged KV cache.

The cache is a pool of blocks of BT positions; position j of the sequence sits in
pool block table[j // BT], row j % BT. Query t sits at position start_pos+t and
attends to keys key_lo..start_pos+t, only those below key_hi: a range that leaves
out keys attended elsewhere gives a partial result, with its log-sum-exp (`lse`)
for a merge. A sliding window W > 0 also leaves out keys before start_pos+t+1-W
(the query and the W-1 keys before it, as HF's sliding_window mask). Query head h
reads kv head h // (Hq // Hkv). Attention sinks (gpt-oss: a learned logit per head
in the softmax's denominator, attending nothing) apply once to the merged result
(`apply_sinks`), so partial ranges merge as without them.

The cache may hold K/V as float32, as f16 or bf16 bits, or as int8 with one
float32 scale per (position, kv head) (see `load_row`); rows are widened to
float32 as they are read.

One work item is (token, kv head, key split): the Hq // Hkv query heads of a kv
head share every K/V row it loads. At decode (few items) the keys are split and
the partial softmaxes merged, as flash-decoding does; the split count depends
only on the shapes, so results do not depend on the thread count.

Shape legend: T tokens, Hq query heads, Hkv kv heads, G = Hq // Hkv, D head dim,
NB pool blocks, BT positions per block, nb blocks of the sequence, P key splits.
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .half import half_bits_to_f32, u32_as_f32
from .twins import serial_twin

NO_SCALES = np.ones((1, 1, 1), dtype=np.float32)  # the scales argument of caches that have none
NO_LSE = np.empty((0, 0), dtype=np.float32)  # the lse argument when the caller wants none


@njit(nogil=True, cache=True)
def write_rows(pool, layer, table, start, rows):
    """Positions start .. start + n - 1 of a sequence whose blocks are table [nb] get rows [n, ...] in
    pool [L, NB, BT, ...] (K/V data [.., Hkv, D] or int8 scales [.., Hkv]) at `layer`: one compiled call,
    where NumPy slicing per block cost ~6 us a tensor at decode. Element by element: the broadcasting
    assignment of a row compiled in ~4 s (its shape-error message), this in ~0.3 s."""
    block_tokens = pool.shape[2]
    for i in range(rows.shape[0]):
        position = start + i
        dst = pool[layer, table[position // block_tokens], position % block_tokens].reshape(-1)  # a view
        src = rows[i].ravel()
        if dst.size != src.size:
            raise ValueError("write_rows: the rows' shape differs from the pool's")
        for j in range(src.size):
            dst[j] = src[j]


def load_row(cache, scales, block, row, kv, buf):
    """Row [D] of kv head `kv` at (pool block, row) as float32 (a view for float32 caches, else decoded into buf).

    The storage is told by the cache's dtype: float32; uint16 = f16 bits; int16 = bf16 bits
    (an int16 array so that Numba can tell them from f16 by type); int8 = q * scales[block, row, kv].
    """
    raise NotImplementedError("only called from Numba kernels")


@overload(load_row, jit_options={"fastmath": True})
def _load_row(cache, scales, block, row, kv, buf):
    dtype = cache.dtype
    if dtype == types.float32:
        return lambda cache, scales, block, row, kv, buf: cache[block, row, kv]

    if dtype == types.uint16:
        def f16(cache, scales, block, row, kv, buf):
            for d in range(buf.size):
                buf[d] = half_bits_to_f32(cache[block, row, kv, d])
            return buf
        return f16

    if dtype == types.int16:
        def bf16(cache, scales, block, row, kv, buf):
            for d in range(buf.size):
                buf[d] = u32_as_f32(np.uint32(np.uint16(cache[block, row, kv, d])) << np.uint32(16))
            return buf
        return bf16

    if dtype == types.int8:
        def int8(cache, scales, block, row, kv, buf):
            s = scales[block, row, kv]
            for d in range(buf.size):
                buf[d] = np.float32(cache[block, row, kv, d]) * s
            return buf
        return int8

MIN_SPLIT_KEYS = 256  # a split shorter than this does not pay for its merge
TARGET_ITEMS = 64  # work items wanted to keep a many-core CPU busy


@njit(nogil=True, cache=True)
def num_key_splits(num_items, max_keys):
    by_work = max(1, TARGET_ITEMS // num_items)
    by_keys = max(1, (max_keys + MIN_SPLIT_KEYS - 1) // MIN_SPLIT_KEYS)
    return min(by_work, by_keys)


@njit(fastmath=True, nogil=True, cache=True)
def _partial(q, k_cache, v_cache, k_scale, v_scale, table, t, kv, j0, j1, scale, acc, stats):
    """Keys j0..j1-1 for the G heads of kv head `kv`: acc [G, D] = sum exp(s - max) v, stats [G, 2] = (max, sum)."""
    group, head_dim = acc.shape
    block_tokens = k_cache.shape[1]
    q_rows = q[t, kv * group:(kv + 1) * group]  # [G, D]
    scores = np.empty((group, j1 - j0), dtype=np.float32)  # [G, keys]
    buf = np.empty(head_dim, dtype=np.float32)  # a decoded K or V row
    for j in range(j1 - j0):
        pos = j0 + j
        k_row = load_row(k_cache, k_scale, table[pos // block_tokens], pos % block_tokens, kv, buf)  # [D]
        for g in range(group):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += q_rows[g, d] * k_row[d]
            scores[g, j] = dot * scale
    for g in range(group):
        best = scores[g, 0]
        for j in range(1, j1 - j0):
            best = max(best, scores[g, j])
        total = 0.0  # float64 accumulator
        for j in range(j1 - j0):
            p = np.exp(scores[g, j] - best)
            scores[g, j] = p
            total += p
        stats[g, 0] = best
        stats[g, 1] = total
    acc[:] = 0.0
    for j in range(j1 - j0):
        pos = j0 + j
        v_row = load_row(v_cache, v_scale, table[pos // block_tokens], pos % block_tokens, kv, buf)  # [D]
        for g in range(group):
            p = scores[g, j]
            for d in range(head_dim):
                acc[g, d] += p * v_row[d]


@njit(parallel=True, fastmath=True, nogil=True, cache=True)
def attention(q, k_cache, v_cache, table, start_pos, key_lo, key_hi, scale, out, lse=NO_LSE, k_scale=NO_SCALES,
              v_scale=NO_SCALES, window=0):
    """q [T, Hq, D], k_cache/v_cache [NB, BT, Hkv, D] through table int32 [nb] (k_scale/v_scale [NB, BT, Hkv]
    for int8 caches) -> out [T, Hq, D] over keys max(key_lo, start_pos+t+1-window)..min(start_pos+t, key_hi-1)
    (window 0: from key_lo); lse [T, Hq] too unless it is NO_LSE (an empty key range gives out 0 and lse -inf).
    Callers that want a cached kernel pass every argument: Numba keys an omitted array default by its id(), so
    each new process compiles it anew."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_keys = min(start_pos + num_tokens, key_hi) - key_lo
    if window > 0:
        max_keys = min(max_keys, window)
    num_splits = num_key_splits(num_tokens * num_kv_heads, max(max_keys, 1))
    acc = np.empty((num_tokens, num_kv_heads, num_splits, group, head_dim), dtype=np.float32)  # [T, Hkv, P, G, D]
    stats = np.empty((num_tokens, num_kv_heads, num_splits, group, 2), dtype=np.float64)  # [T, Hkv, P, G, 2]
    scale32 = np.float32(scale)
    for item in prange(num_tokens * num_kv_heads * num_splits):
        s = item % num_splits
        kv = (item // num_splits) % num_kv_heads
        rank = item // (num_splits * num_kv_heads)
        t = rank // 2 if rank % 2 == 0 else num_tokens - 1 - rank // 2  # zigzag: balances causal work
        lo = key_lo if window <= 0 else max(key_lo, start_pos + t + 1 - window)
        num_keys = max(min(start_pos + t + 1, key_hi) - lo, 0)
        j0 = lo + s * num_keys // num_splits
        j1 = lo + (s + 1) * num_keys // num_splits
        if j1 > j0:
            _partial(q, k_cache, v_cache, k_scale, v_scale, table, t, kv, j0, j1, scale32, acc[t, kv, s],
                     stats[t, kv, s])
        else:
            stats[t, kv, s, :, 1] = 0.0  # empty split
    want_lse = lse.shape[0] > 0
    if num_tokens == 1:  # one token's merge is a few us: on this thread, no second region to open
        for h in range(num_q_heads):
            total_lse = _merge(acc[0, h // group, :, h % group], stats[0, h // group, :, h % group], out[0, h])
            if want_lse:
                lse[0, h] = total_lse
    else:
        for th in prange(num_tokens * num_q_heads):
            t = th // num_q_heads
            h = th % num_q_heads
            total_lse = _merge(acc[t, h // group, :, h % group], stats[t, h // group, :, h % group], out[t, h])
            if want_lse:
                lse[t, h] = total_lse


@njit(fastmath=True, nogil=True, cache=True)
def _merge(acc, stats, out):
    """acc [P, D], stats [P, 2] of one head's key splits -> out [D], the normalized softmax average;
    returns the log-sum-exp of the scores (-inf, and out 0, when every split is empty)."""
    num_splits, head_dim = acc.shape
    best, found = 0.0, False  # no infinities here: fastmath assumes there are none
    for s in range(num_splits):
        if stats[s, 1] > 0.0:
            best = stats[s, 0] if not found else max(best, stats[s, 0])
            found = True
    for d in range(head_dim):
        out[d] = 0.0
    if not found:
        return np.float32(-np.inf)
    total = 0.0
    for s in range(num_splits):
        if stats[s, 1] > 0.0:
            total += stats[s, 1] * np.exp(stats[s, 0] - best)
    for s in range(num_splits):
        if stats[s, 1] > 0.0:
            w = np.float32(np.exp(stats[s, 0] - best) / total)
            for d in range(head_dim):
                out[d] += w * acc[s, d]  # [D]
    return np.float32(best + np.log(total))


attention_serial = serial_twin(attention)


@njit(nogil=True, cache=True)
def apply_sinks(out, lse, sinks):
    """Each head's sink logit joins the softmax's denominator, as a key of value 0 would: out [T, Hq, D] *=
    1 / (1 + exp(sinks[h] - lse[t, h])) and lse [T, Hq] becomes log(exp(lse) + exp(sinks[h])), so the result
    still merges with a part over other keys. An empty range (lse -inf) keeps out 0. Not fastmath: lse may be
    -inf."""
    num_tokens, num_heads, head_dim = out.shape
    for t in range(num_tokens):
        for h in range(num_heads):
            sink, before = np.float64(sinks[h]), np.float64(lse[t, h])
            keep = np.float32(1.0 / (1.0 + np.exp(sink - before)))
            lse[t, h] = np.float32(np.logaddexp(before, sink))
            for d in range(head_dim):
                out[t, h, d] *= keep
