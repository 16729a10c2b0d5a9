"""One engine against an earlier version of itself: decode and prompt-read speed, alternating runs.

Each run is a fresh process importing the engine from a source tree (this checkout, and `--before`, a
tree of the earlier commit, e.g. `git archive <commit> hybrid cpu_kernels gpu_kernels placement server |
tar -x -C /tmp/before`). A run warms up (every kernel compiled or loaded from Numba's cache), reads a
`--prompt-tokens` prompt (prompt read tok/s), then decodes `--decode-tokens` tokens greedily after a short
prompt (decode tok/s), through the public API (`hybrid.LLM(...).generate`), which both versions have.
With `--device gpu`, `--shares` picks the share of each layer's experts resident in VRAM (the first
experts of each layer). Medians over `--runs` runs; the ratio is after / before.

    python bench/before_after.py --model /tmp/bench-q4km.gguf --before /tmp/before --threads 2 --runs 5
    python bench/before_after.py --model /tmp/bench-q4km.gguf --before /tmp/before --device gpu --shares 0,50,100
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT = 16

WORKER = r"""
import json, sys
import numpy as np
from hybrid import LLM

model, device, threads, share, prompt_tokens, decode_tokens, short = sys.argv[1:8]
threads, share, prompt_tokens, decode_tokens, short = int(threads), float(share), int(prompt_tokens), int(decode_tokens), int(short)
settings = dict(device=device, threads=threads, max_context=prompt_tokens + decode_tokens + short + 64)
if device == "gpu":
    from hybrid.formats import load_model
    config = load_model(model).config
    resident = np.zeros((config.num_layers, config.num_experts), bool)
    resident[:, : round(share / 100 * config.num_experts)] = True
    settings["resident"] = resident
llm = LLM(model, **settings)
vocab = llm.config.vocab_size
def ids(count, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, size=count)]
for warm in (ids(short, 1), ids(prompt_tokens, 1)):  # every kernel variant a run reaches: compiled or loaded
    llm.generate(warm, max_tokens=4, temperature=0, ignore_eos=True)
read = llm.generate(ids(prompt_tokens, 2), max_tokens=1, temperature=0, ignore_eos=True).timings
decode = llm.generate(ids(short, 3), max_tokens=decode_tokens, temperature=0, ignore_eos=True).timings
llm.close()
print(json.dumps({"prompt_tps": read["prompt_per_second"], "decode_tps": decode["predicted_per_second"]}))
"""


def run(tree, args, share):
    """One fresh process of the engine in `tree`: {"prompt_tps", "decode_tps"}."""
    path = os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-c", WORKER, args.model, args.device, str(args.threads), str(share),
           str(args.prompt_tokens), str(args.decode_tokens), str(SHORT_PROMPT)]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--before", required=True, help="source tree of the earlier version")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--shares", default="50", help="GPU only: comma-separated resident shares, percent")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--output", help="also write the table here")
    args = p.parse_args()
    shares = [float(s) for s in args.shares.split(",")] if args.device == "gpu" else [0.0]
    trees = {"before": Path(args.before).resolve(), "after": ROOT}
    lines = [f"model {Path(args.model).name}, device {args.device}, {args.threads} threads, "
             f"median of {args.runs} alternating runs", "",
             "| resident % | metric | before tok/s | after tok/s | after / before |", "|---|---|---|---|---|"]
    for share in shares:
        results = {name: [] for name in trees}
        for i in range(args.runs):
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                results[name].append(run(trees[name], args, share))
                print(f"share {share:g} run {i + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
        for metric, label in (("decode_tps", "decode"), (("prompt_tps"), f"prompt read {args.prompt_tokens}")):
            before = statistics.median(r[metric] for r in results["before"])
            after = statistics.median(r[metric] for r in results["after"])
            shown = f"{share:g}" if args.device == "gpu" else "-"
            lines.append(f"| {shown} | {label} | {before:.2f} | {after:.2f} | {after / before:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")


if __name__ == "__main__":
    main()
