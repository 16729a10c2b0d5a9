"""The experts' integer prompt kernels on a prompt's group sizes: G (token, expert) groups of T tokens each, the
weights of distinct experts (from memory) or of one expert (hot), one process, CPU time.

A group of more than DECODE_MAX_TOKENS tokens runs as prefill tiles (cpu_kernels/prefill_i16.py), fewer as
several-token decode items (tokens_dot.py). The rate of each is set by the group size: lanes a pass fills, rows
unpacked per token chunk. `--sizes` takes a .npy of group sizes (one prompt's, saved by `--save-sizes` of a model
read) or `GxT` items.

    python bench/prefill_groups.py --sizes 40x12,40x20,24x103,1x256
    python bench/prefill_groups.py --model /tmp/compiled/bench-qwen3next-80b.gguf --save-sizes /tmp/sizes.npy
    python bench/prefill_groups.py --sizes /tmp/sizes.npy --layers
    # against an older tree, one process, round by round (git archive OLD | tar -x -C /tmp/old):
    python bench/prefill_groups.py --sizes /tmp/sizes.npy --layers --runs 9 --baseline /tmp/old
    # the exact (float x) projections of a linear-attention layer, a 256-token chunk:
    python bench/prefill_groups.py --dense --sizes 1x256 --act-quant float --baseline /tmp/old

Prints per weight shape and group set: ms a call (median and min of `--runs`, process CPU time) and G
multiply-adds a second; with --baseline both trees, the baseline's time over this tree's, and whether their
outputs are equal.
"""
import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NUM_EXPERTS = 512
SHAPES = (("q4_k", 512, 2048, True), ("q6_k", 2048, 512, False))  # format, rows, columns, gate+up pair
DENSE_SHAPES = (("q4_k", 8192, 2048, False), ("q4_k", 4096, 2048, False), ("q4_k", 2048, 4096, False),
                ("q6_k", 2048, 4096, False))  # the linear-attention layer's attn_qkv, attn_gate, ssm_out, the attention
# layer's attn_output (--dense: one weight, a 1xT group; with --act-quant float the exact projections' prefill tiles)


def parse_sizes(text, layers, num_layer_pairs):
    """[(label, sizes int64 [G])] from `text` (GxT,... or a .npy of group sizes), split into MoE layers of
    num_layer_pairs pairs each with `layers`."""
    if text.endswith(".npy"):
        sizes = np.load(text).astype(np.int64)
        if not layers:
            return [(f"{Path(text).name} ({len(sizes)} groups)", sizes)]
        bounds = np.searchsorted(np.cumsum(sizes), np.arange(num_layer_pairs, sizes.sum(), num_layer_pairs),
                                 side="right")
        return [(f"layer {i} ({len(part)} groups)", part) for i, part in enumerate(np.split(sizes, bounds))]
    sets = []
    for item in text.split(","):
        g, t = (int(v) for v in item.split("x"))
        sets.append((f"{g}x{t}", np.full(g, t, dtype=np.int64)))
    return sets


def save_sizes(model_path, path, num_tokens):
    """Record the group sizes of one prompt's routed experts (every MoE layer) to `path`."""
    import hybrid.backends.cpu as cpu_backend
    from bench.cpu_prefill_profile import read_prompt
    from hybrid.llm import LLM, PREFILL_CHUNK

    sizes = []
    plain = cpu_backend.CpuBackend.grouped_experts

    def recorded(self, x, weights, groups, *args, **kwargs):
        sizes.append(np.diff(groups[2]))
        return plain(self, x, weights, groups, *args, **kwargs)

    cpu_backend.CpuBackend.grouped_experts = recorded
    llm = LLM(model_path, device="cpu", threads=1, max_context=num_tokens + 64)
    ids = np.random.default_rng(0).integers(1, llm.config.vocab_size, size=num_tokens)
    read_prompt(llm.model, ids, PREFILL_CHUNK)
    np.save(path, np.concatenate(sizes))


def packages(baseline):
    """{label: cpu_kernels package}: this tree's, and with `baseline` (another tree's root, e.g. a `git archive`
    export) a copy of that tree's cpu_kernels imported as package cpu_kernels_baseline (its modules import each
    other relatively), so one process times both."""
    import importlib

    found = {"this tree": importlib.import_module("cpu_kernels")}
    if baseline:
        copy = Path(tempfile.mkdtemp(prefix="prefill_groups_"))
        shutil.copytree(Path(baseline) / "cpu_kernels", copy / "cpu_kernels_baseline",
                        ignore=shutil.ignore_patterns("__pycache__"))
        sys.path.insert(0, str(copy))
        found["baseline"] = importlib.import_module("cpu_kernels_baseline")
    return found


def time_rounds(calls, runs):
    """{label: (median, min) seconds of CPU time}: each call once to compile, then `runs` rounds calling each
    in turn (the order alternating), so that every label sees the same load."""
    times = {label: [] for label in calls}
    for fn in calls.values():
        fn()
    for r in range(runs):
        for label in list(calls)[::1 if r % 2 else -1]:
            start = time.process_time()
            calls[label]()
            times[label].append(time.process_time() - start)
    return {label: (np.median(t), min(t)) for label, t in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="40x12,40x20,24x103,1x256")
    p.add_argument("--layers", action="store_true", help="split a .npy's sizes into MoE layers of 10 x --tokens pairs")
    p.add_argument("--tokens", type=int, default=256, help="the prompt's tokens (with --layers, top-10)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hot", action="store_true", help="every group on expert 0 (weights from cache)")
    p.add_argument("--dense", action="store_true", help="DENSE_SHAPES (one weight each) instead of the experts'")
    p.add_argument("--act-quant", default="int16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", help="another tree's root: its cpu_kernels timed beside this tree's, round by round")
    p.add_argument("--model", help="with --save-sizes: the GGUF whose prompt's group sizes are recorded")
    p.add_argument("--save-sizes")
    args = p.parse_args(argv)
    if args.save_sizes:
        save_sizes(args.model, args.save_sizes, args.tokens)
        return
    import importlib

    import numba

    numba.set_num_threads(args.threads)
    trees = packages(args.baseline)
    rng = np.random.default_rng(0)
    sets = parse_sizes(args.sizes, args.layers, 10 * args.tokens)
    print("| weight | groups | " + " | ".join(f"{label}: ms a call (median, min), GMAC/s" for label in trees)
          + (" | ratio (median) | outputs" if args.baseline else "") + " |")
    print("|---|---|" + "---|" * (len(trees) + (2 if args.baseline else 0)))
    num_experts = 1 if args.dense else NUM_EXPERTS
    for fmt_name, rows, cols, pair in DENSE_SHAPES if args.dense else SHAPES:
        fmts = {label: importlib.import_module(f"{pkg.__name__}.{fmt_name}") for label, pkg in trees.items()}
        raws = tuple(fmts["this tree"].random_blocks(rng, (num_experts, rows, cols), 0.02)
                     for _ in range(2 if pair else 1))
        for label, sizes in sets:
            num_pairs = int(sizes.sum())
            x = rng.standard_normal((num_pairs, cols)).astype(np.float32)
            experts = np.zeros(len(sizes), np.int64) if args.hot or args.dense else \
                rng.choice(NUM_EXPERTS, size=len(sizes), replace=False).astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            outs, calls = {}, {}
            for tree, pkg in trees.items():
                kernel = pkg.tiles.KERNELS[fmts[tree].__name__][0]
                code = pkg.act_quant.act_quant_code(args.act_quant)
                code += pkg.tiles.PROMPT_ITEMS if args.act_quant == "int16" else 0
                outs[tree] = tuple(np.empty((num_pairs, rows), np.float32) for _ in raws)
                calls[tree] = functools.partial(kernel, raws, x, experts, starts, outs[tree], code)
            timed = time_rounds(calls, args.runs)
            macs = num_pairs * rows * cols * len(raws)
            name = f"{fmt_name} [{rows}, {cols}]" + (" x2" if pair else "")
            cells = [f"{med * 1e3:.2f}, {best * 1e3:.2f}, {macs / med / 1e9:.1f}" for med, best in timed.values()]
            if args.baseline:
                same = all(np.array_equal(a, b) for a, b in zip(outs["this tree"], outs["baseline"]))
                cells += [f"{timed['baseline'][0] / timed['this tree'][0]:.3f}x", "equal" if same else "differ"]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
