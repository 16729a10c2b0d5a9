"""GPU time of each kernel of a one-token decode step at the Qwen3-30B-A3B shapes, as a step graph runs it: each
kernel captured `--reps` times back to back in one CUDA graph, replayed, the best replay's time over reps. Beside
the kernels of the tree: the ones they replaced (tests/gpu_kernels/previous_ops.cu) and the attention's plans
(heads a block, fewest keys a split) at several context lengths. The `few` group times the dense matmuls and the
expert pair kernels at --few-tokens tokens (users decoding at once) with x rounded to int16 in every block or once a
launch (Kernels.xq_per_launch), the dense ones also by the tiled kernel.

    python3 bench/gpu_decode_ops.py [--reps 100] [--groups small,attention,matmuls,overlap,few] [--few-tokens 1,4]
        [--output FILE]
"""
import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from hybrid.setup.attention_time import best_replay_seconds  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, MOE_FF, EPS = 2048, 32, 4, 128, 128, 8, 768, 1e-6
DENSE_MATMULS = (("q+k Q4_K", Q.Q4_K, 4608, HIDDEN), ("v Q6_K", Q.Q6_K, 512, HIDDEN),  # (label, format, rows, cols)
                 ("output Q6_K", Q.Q6_K, HIDDEN, HEADS * HEAD_DIM), ("router F32", Q.F32, EXPERTS, HIDDEN))
PREVIOUS = ("prev_rmsnorm", "prev_add_rmsnorm", "prev_combine_rows", "prev_route_topk")


def graph_us(rt, stream, queue, reps, replays=5):
    """Microseconds a launch of queue()'s work, captured reps times in one graph, best of `replays` replays (run once
    before: compiles and scratch buffers come before the capture)."""
    queue()
    stream.synchronize()
    graph = rt.capture(stream, lambda: [queue() for _ in range(reps)])
    graph.launch(stream)
    stream.synchronize()
    return best_replay_seconds(rt, stream, graph, replays) * 1e6 / reps


def previous_module(rt):
    from gpu_kernels.sources import SRC

    source = (SRC / "common.cuh").read_text() + (ROOT / "tests/gpu_kernels/previous_ops.cu").read_text()
    return rt.compile("previous_ops", source, PREVIOUS)


def small_ops(rt, kn, prev, rng):
    """[(name, {variant: launch})] of the norms, the router's top-k and the expert rows' combine."""
    dev = rt.to_device
    x, y, w = (dev(rng.standard_normal((1, HIDDEN)).astype(np.float32)) for _ in range(3))
    w = w.reshape(-1)
    out = rt.empty((1, HIDDEN), np.float32)
    h, eps = np.int32(HIDDEN), np.float32(EPS)
    logits = dev(rng.standard_normal((1, EXPERTS)).astype(np.float32))
    ids, weights = rt.empty((1, TOP_K), np.int32), rt.empty((1, TOP_K), np.float32)
    rows, row_of_pair = dev(rng.standard_normal((TOP_K, HIDDEN)).astype(np.float32)), dev(np.arange(TOP_K,
                                                                                                    dtype=np.int32))
    pair_w = dev(rng.random(TOP_K).astype(np.float32))
    heads = dev(rng.standard_normal((1, HEADS + KV_HEADS, HEAD_DIM)).astype(np.float32))
    hw = dev(rng.standard_normal(HEAD_DIM).astype(np.float32))
    from cpu_kernels.rope import inv_freq_f32

    pos, freq = dev(np.array([40], np.int64)), dev(inv_freq_f32(1e6, HEAD_DIM))

    def prev_launch(name, grid, block, args, shared):
        return lambda: rt.launch(prev[name], grid, (block,), args, shared_mem=shared, stream=kn.stream)

    return [
        ("add_into [1, 2048] (a floor)", {"tree": lambda: kn.add_into(x, y)}),
        ("rmsnorm [1, 2048]", {"tree": lambda: kn.rmsnorm(x, w, EPS, out),
                               "previous": prev_launch("prev_rmsnorm", (1,), 256, (x, w, out, h, eps), 1024)}),
        ("add_rmsnorm [1, 2048]", {"tree": lambda: kn.add_rmsnorm(x, y, w, EPS, out),
                                   "previous": prev_launch("prev_add_rmsnorm", (1,), 256, (x, y, w, out, h, eps),
                                                           1024)}),
        ("qk_norm_rope [1, 36, 128]", {"tree": lambda: kn.qk_norm_rope(heads, hw, hw, HEADS, EPS, pos, freq)}),
        ("route_topk 128 experts top 8", {
            "tree": lambda: kn.route_topk(logits, TOP_K, True, ids, weights),
            "previous": prev_launch("prev_route_topk", (1,), 32, (logits, ids, weights, np.int32(1), np.int32(EXPERTS),
                                                                  np.int32(TOP_K), np.int32(1)), 0)}),
        ("combine_rows 8 rows of 2048", {
            "tree": lambda: kn.combine_rows(rows, row_of_pair, pair_w, TOP_K, out),
            "previous": prev_launch("prev_combine_rows", (1,), 256, (rows, row_of_pair, pair_w, out, np.int32(TOP_K),
                                                                     h), 0)}),
    ]


def attention_ops(rt, kn, rng, contexts):
    """[(name, {variant: launch})] of the one-token attention at each context: heads a block 1..8, splits from 64
    or 256 keys (gpu_kernels.attention_plan.SPLIT_MIN_KEYS)."""
    import gpu_kernels.attention_plan as kmod

    block_tokens, longest = 16, max(contexts)
    num_blocks = -(-longest // block_tokens)
    dev = rt.to_device
    k_pool, v_pool = (dev(rng.standard_normal((num_blocks, block_tokens, KV_HEADS, HEAD_DIM)).astype(np.float32))
                      for _ in range(2))
    table = dev(rng.permutation(num_blocks).astype(np.int32))
    q = dev(rng.standard_normal((1, HEADS, HEAD_DIM)).astype(np.float32))
    out = rt.empty((1, HEADS, HEAD_DIM), np.float32)
    scale = 1.0 / np.sqrt(HEAD_DIM)

    def launch(keys, rows, split_min, short=0):
        def run():
            kn.attention_rows, saved, kmod.SPLIT_MIN_KEYS = rows, kmod.SPLIT_MIN_KEYS, split_min
            kn.short_attention_keys = short
            try:
                kn.paged_attention("f32", q, k_pool, v_pool, None, None, table, keys - 1, 0, scale, out)
            finally:
                kmod.SPLIT_MIN_KEYS, kn.short_attention_keys = saved, 0
        return run

    found = []
    for keys in contexts:
        variants = {f"{rows} heads, splits from {split_min}": launch(keys, rows, split_min)
                    for split_min in (256, 64) for rows in (8, 4, 2, 1)
                    if split_min == 256 or keys >= 2 * 64}
        if keys <= 4 * kmod.SHORT_ATTENTION_KEYS:
            variants["short kernel (a block a head)"] = launch(keys, 8, kmod.SPLIT_MIN_KEYS, short=keys)
        variants["tree default"] = launch(keys, kmod.PD_MAX_ROWS, kmod.SPLIT_MIN_KEYS, kmod.SHORT_ATTENTION_KEYS)
        found.append((f"paged_attention one token, {keys} keys", variants))
    kn.attention_rows = kmod.PD_MAX_ROWS
    return found


def patched_kernels(rt, stream, patches, tag, **tuning):
    """Kernels whose matmul modules compile from their source with `patches` ((old, new) text pairs) applied, under
    module names ending in `tag` (a source-level variant timed beside the tree's)."""
    from gpu_kernels import kernels as kmod

    class Patched(kmod.Kernels):
        def _mm(self, qtype, name, rows=None, prefetch=None):  # the tree's prefetch: the default double buffer
            key = (qtype, name, rows)
            if key not in self._functions:
                tuned_rows, _, blocks = self.tuning(qtype)
                rows = rows or tuned_rows
                source = kmod.tuned_source(qtype, rows, blocks)
                for old, new in patches:
                    if old not in source:
                        raise SystemExit(f"patch {old!r}: not in the source of {qtype!r}")
                    source = source.replace(old, new)
                module = kmod.tuned_module_name(qtype, rows, blocks) + tag
                self._functions[key] = self.rt.compile(module, source, kmod.matmul_kernels(qtype))[name]
            return self._functions[key]

    return Patched(rt, stream, **tuning)


def matmul_variants(rt, stream):
    """{name: Kernels} of the one-token matmuls' settings to time: the default, fill_sms, smaller lane groups' work
    (rows a group, slices a lane) for launches too small to fill the GPU, x staged in one batch of loads, more
    slices in flight a lane (matmul.cu's DECODE_PREFETCH)."""
    from gpu_kernels.kernels import XQ_KERNELS, Kernels

    found = {"tree default": Kernels(rt, stream), "format tuning": Kernels(rt, stream, small_tuning=None),
             "fill_sms": Kernels(rt, stream, fill_sms=True, small_tuning=None)}
    for rows, slices in ((1, 1), (1, 2), (1, 4)):
        found[f"rows {rows} slices {slices}"] = Kernels(rt, stream, decode_rows=rows, lane_slices=slices)
    found["xq 16 loads"] = patched_kernels(rt, stream, [("#define XQ_LOADS 4", "#define XQ_LOADS 16")], "_xq16")
    found["prefetch 4"] = Kernels(rt, stream, prefetch=4)
    found["prefetch 4, rows 1 slices 2"] = Kernels(rt, stream, prefetch=4, decode_rows=1, lane_slices=2)
    found["prefetch 8, rows 1"] = Kernels(rt, stream, prefetch=8, decode_rows=1)
    found["x rounded once a launch"] = per_launch = Kernels(rt, stream)
    per_launch.xq_per_launch = frozenset(XQ_KERNELS)
    return found


def few_token_ops(rt, stream, rng, num_tokens):
    """[(name, {variant: launch})] of the dense matmuls at num_tokens tokens (a decode step of that many users) and the
    expert pair kernels at 8 pairs a token: x rounded in every block (the tree's default), once a launch
    (Kernels.xq_per_launch), the dense ones also by the tiled kernel (float x; multi_tokens 0)."""
    from gpu_kernels.kernels import XQ_KERNELS, Kernels
    from hybrid.formats.synthetic import encode

    dev = rt.to_device
    variants = {"x rounded in every block": Kernels(rt, stream), "x rounded once a launch": Kernels(rt, stream),
                "tiled kernel": Kernels(rt, stream)}
    variants["x rounded once a launch"].xq_per_launch = frozenset(XQ_KERNELS)
    variants["tiled kernel"].multi_tokens = 0

    def raw(qtype, shape):
        return dev(encode("w", rng.standard_normal(shape).astype(np.float32), qtype, rng).raw)

    found = []
    for label, qtype, rows, cols in DENSE_MATMULS:
        w, x = raw(qtype, (rows, cols)), dev(rng.standard_normal((num_tokens, cols)).astype(np.float32))
        out = rt.empty((num_tokens, rows), np.float32)
        found.append((f"matmul {label} {rows} x {cols}, {num_tokens} tokens",
                      {name: (lambda k=k, w=w, x=x, out=out, q=qtype: k.matmul(w, q, x, out))
                       for name, k in variants.items() if name != "tiled kernel" or num_tokens > 1}))
    pairs = TOP_K * num_tokens
    gate, up = raw(Q.Q4_K, (EXPERTS, MOE_FF, HIDDEN)), raw(Q.Q4_K, (EXPERTS, MOE_FF, HIDDEN))
    down = raw(Q.Q6_K, (EXPERTS, HIDDEN, MOE_FF))
    xs = dev(rng.standard_normal((pairs, HIDDEN)).astype(np.float32))
    g, u = (dev(rng.standard_normal((pairs, MOE_FF)).astype(np.float32)) for _ in range(2))
    d = rt.empty((pairs, HIDDEN), np.float32)
    tiles = [dev(np.ascontiguousarray(t)) for t in np.stack([rng.integers(0, EXPERTS, pairs), np.arange(pairs),
                                                             np.ones(pairs)]).astype(np.int32)]
    experts = {name: k for name, k in variants.items() if name != "tiled kernel"}
    found.append((f"moe_matmul2 gate+up Q4_K {pairs} pairs", {
        name: (lambda k=k: k.moe_matmul2(gate, up, Q.Q4_K, xs, g, u, *tiles)) for name, k in experts.items()}))
    found.append((f"moe_matmul_glu down Q6_K {pairs} pairs", {
        name: (lambda k=k: k.moe_matmul_glu(down, Q.Q6_K, g, u, d, *tiles)) for name, k in experts.items()}))
    return found


def matmul_ops(rt, variants, rng):
    """[(name, {variant: launch})] of the dense one-token matmuls and the expert pair kernels in each variant."""
    from hybrid.formats.synthetic import encode

    dev = rt.to_device

    def raw(qtype, shape):
        return dev(encode("w", rng.standard_normal(shape).astype(np.float32), qtype, rng).raw)

    found = []
    for label, qtype, rows, cols in DENSE_MATMULS:
        w, x, out = raw(qtype, (rows, cols)), dev(rng.standard_normal((1, cols)).astype(np.float32)), \
            rt.empty((1, rows), np.float32)
        found.append((f"matmul {label} {rows} x {cols}",
                      {name: (lambda k=k, w=w, x=x, out=out, q=qtype: k.matmul(w, q, x, out))
                       for name, k in variants.items()}))
    gate, up = raw(Q.Q4_K, (16, MOE_FF, HIDDEN)), raw(Q.Q4_K, (16, MOE_FF, HIDDEN))
    down = raw(Q.Q6_K, (16, HIDDEN, MOE_FF))
    xs = dev(rng.standard_normal((TOP_K, HIDDEN)).astype(np.float32))
    g, u = (dev(rng.standard_normal((TOP_K, MOE_FF)).astype(np.float32)) for _ in range(2))
    d = rt.empty((TOP_K, HIDDEN), np.float32)
    tiles = [dev(np.ascontiguousarray(t)) for t in np.stack([rng.permutation(16)[:TOP_K], np.arange(TOP_K),
                                                             np.ones(TOP_K)]).astype(np.int32)]
    found.append(("moe_matmul2 gate+up Q4_K 8 pairs", {name: (lambda k=k: k.moe_matmul2(gate, up, Q.Q4_K, xs, g, u,
                                                                                          *tiles))
                                                       for name, k in variants.items()}))
    found.append(("moe_matmul_glu down Q6_K 8 pairs", {name: (lambda k=k: k.moe_matmul_glu(down, Q.Q6_K, g, u, d,
                                                                                             *tiles))
                                                       for name, k in variants.items()}))
    return found


def overlap_ops(rt, stream, rng):
    """[(name, {variant: launch})] of the attention's q+k (Q4_K) and v (Q6_K) one-token matmuls of the same x: each
    alone, in order on one stream (a step graph's today), and v on a second stream beside q+k (a fork and a join by
    events, as a graph captures them: two nodes without an edge, which the GPU may run at once)."""
    from gpu_kernels.kernels import Kernels
    from hybrid.formats.synthetic import encode

    dev = rt.to_device
    side = rt.stream()
    main_kn, side_kn = Kernels(rt, stream), Kernels(rt, side)
    w_qk, w_v = (dev(encode("w", rng.standard_normal(shape).astype(np.float32), qtype, rng).raw)
                 for qtype, shape in ((Q.Q4_K, (4608, HIDDEN)), (Q.Q6_K, (512, HIDDEN))))
    x = dev(rng.standard_normal((1, HIDDEN)).astype(np.float32))
    qk, v = rt.empty((1, 4608), np.float32), rt.empty((1, 512), np.float32)
    fork, join = rt.event(), rt.event()

    def in_order():
        main_kn.matmul(w_qk, Q.Q4_K, x, qk)
        main_kn.matmul(w_v, Q.Q6_K, x, v)

    def beside():
        fork.record(stream)
        rt.wait_event(side, fork)
        side_kn.matmul(w_v, Q.Q6_K, x, v)
        main_kn.matmul(w_qk, Q.Q4_K, x, qk)
        join.record(side)
        rt.wait_event(stream, join)

    return [("q+k Q4_K 4608 x 2048 and v Q6_K 512 x 2048", {
        "q+k alone": lambda: main_kn.matmul(w_qk, Q.Q4_K, x, qk), "v alone": lambda: main_kn.matmul(w_v, Q.Q6_K, x, v),
        "in order": in_order, "v on a second stream": beside})]


GROUPS = ("small", "attention", "matmuls", "overlap", "few")


def main(argv=None, runtime=None):
    """runtime: a runtime to time on (a dry run's stand-in), else the GPU's."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--contexts", default="8,40,128,256,1024,4096", help="keys of the attention timings")
    p.add_argument("--skip-matmuls", action="store_true")
    p.add_argument("--few-tokens", default="1,4", help="tokens of the few group's launches (users decoding at once)")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"kernel groups timed, of {', '.join(GROUPS)}")
    p.add_argument("--output")
    args = p.parse_args(argv)
    from gpu_kernels.kernels import Kernels
    from gpu_kernels.runtime import probe

    rt = runtime or probe().runtime
    if rt is None:
        raise SystemExit("no GPU")
    stream = rt.stream()
    kn = Kernels(rt, stream)
    rng = np.random.default_rng(0)
    chosen = set(args.groups.split(",")) - ({"matmuls"} if args.skip_matmuls else set())
    if chosen - set(GROUPS):
        raise SystemExit(f"--groups: unknown {', '.join(sorted(chosen - set(GROUPS)))}")
    groups = small_ops(rt, kn, previous_module(rt), rng) if "small" in chosen else []
    if "attention" in chosen:
        groups += attention_ops(rt, kn, rng, [int(c) for c in args.contexts.split(",")])
    if "matmuls" in chosen:
        groups += matmul_ops(rt, matmul_variants(rt, stream), rng)
    if "overlap" in chosen:
        groups += overlap_ops(rt, stream, rng)
    if "few" in chosen:
        for num_tokens in (int(t) for t in args.few_tokens.split(",")):
            groups += few_token_ops(rt, stream, rng, num_tokens)
    lines = [f"{rt.device_name}: us a launch, {args.reps} launches back to back in one graph (best of 5 replays)", "",
             "| kernel | variant | us |", "|---|---|---|"]
    for name, variants in groups:
        for variant, run in variants.items():
            lines.append(f"| {name} | {variant} | {graph_us(rt, stream, run, args.reps):.2f} |")
        print("\n".join(lines[-len(variants):]), flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
