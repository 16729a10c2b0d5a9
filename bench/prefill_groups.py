"""The experts' integer prompt kernels on a prompt's group sizes: G (token, expert) groups of T tokens each, the
weights of distinct experts (from memory) or of one expert (hot), one process, CPU time.

A group of more than DECODE_MAX_TOKENS tokens runs as prefill tiles (cpu_kernels/prefill_i16.py), fewer as
several-token decode items (tokens_dot.py). The rate of each is set by the group size: lanes a pass fills, rows
unpacked per token chunk. `--sizes` takes a .npy of group sizes (one prompt's, saved by `--save-sizes` of a model
read) or `GxT` items.

    python bench/prefill_groups.py --sizes 40x12,40x20,24x103,1x256
    python bench/prefill_groups.py --model /tmp/compiled/bench-qwen3next-80b.gguf --save-sizes /tmp/sizes.npy
    python bench/prefill_groups.py --sizes /tmp/sizes.npy --layers

Prints per weight shape and group set: ms a call and G multiply-adds a second (median and min of `--runs`).
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NUM_EXPERTS = 512
SHAPES = (("q4_k", 512, 2048, True), ("q6_k", 2048, 512, False))  # format, rows, columns, gate+up pair


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


def time_calls(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return np.median(times), min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="40x12,40x20,24x103,1x256")
    p.add_argument("--layers", action="store_true", help="split a .npy's sizes into MoE layers of 10 x --tokens pairs")
    p.add_argument("--tokens", type=int, default=256, help="the prompt's tokens (with --layers, top-10)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--hot", action="store_true", help="every group on expert 0 (weights from cache)")
    p.add_argument("--act-quant", default="int16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", help="with --save-sizes: the GGUF whose prompt's group sizes are recorded")
    p.add_argument("--save-sizes")
    args = p.parse_args(argv)
    if args.save_sizes:
        save_sizes(args.model, args.save_sizes, args.tokens)
        return
    import importlib

    import numba

    numba.set_num_threads(args.threads)
    from cpu_kernels.act_quant import act_quant_code
    from cpu_kernels.tiles import PROMPT_ITEMS
    from cpu_kernels.tiles import KERNELS

    rng = np.random.default_rng(0)
    code = act_quant_code(args.act_quant)
    code += PROMPT_ITEMS if args.act_quant == "int16" else 0
    sets = parse_sizes(args.sizes, args.layers, 10 * args.tokens)
    print("| weight | groups | ms a call (median, min) | GMAC/s (median) |\n|---|---|---|---|")
    for fmt_name, rows, cols, pair in SHAPES:
        fmt = importlib.import_module(f"cpu_kernels.{fmt_name}")
        raws = tuple(fmt.random_blocks(rng, (NUM_EXPERTS, rows, cols), 0.02) for _ in range(2 if pair else 1))
        kernel = KERNELS[fmt.__name__][0]
        for label, sizes in sets:
            num_pairs = int(sizes.sum())
            x = rng.standard_normal((num_pairs, cols)).astype(np.float32)
            outs = tuple(np.empty((num_pairs, rows), np.float32) for _ in raws)
            experts = np.zeros(len(sizes), np.int64) if args.hot else \
                rng.choice(NUM_EXPERTS, size=len(sizes), replace=False).astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            med, best = time_calls(lambda: kernel(raws, x, experts, starts, outs, code), args.runs)
            macs = num_pairs * rows * cols * len(raws)
            name = f"{fmt_name} [{rows}, {cols}]" + (" x2" if pair else "")
            print(f"| {name} | {label} | {med * 1e3:.2f}, {best * 1e3:.2f} | {macs / med / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
