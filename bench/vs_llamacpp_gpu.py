"""Strata's hybrid GPU + CPU serving against llama.cpp's CUDA build with experts on the CPU (`--n-cpu-moe`).

The same GGUF, the same CPU threads, the same VRAM for experts: at each share of expert bytes in VRAM,
llama.cpp keeps the experts of its first N layers on the CPU (`-ngl 99 --n-cpu-moe N`, N = layers x (1 -
share)); Strata's expert cache holds the same bytes, filled layer by layer as llama.cpp's ("layers": the
last L - N layers whole), and chosen by the planner from a profile ("profile": `plan_slots` on a profile
of --profile-prompts random prompts read with 4 generated tokens each, made once on the CPU). Each run is
a fresh process per engine, the engines alternating; medians over --runs runs; each Strata process measures
after one warm-up run of each test, as llama-bench does. Measured: decode tok/s of one user (--decode-tokens
after a 32-token prompt), prompt read tok/s of each --prompt-tokens, and total decode tok/s of --users users at once
(llama.cpp: `llama-batched-bench -npl USERS`).

Build llama.cpp first (the commit and flags go into the results):
    cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j 16 --target llama-bench llama-batched-bench
    python bench/vs_llamacpp_gpu.py --model /tmp/q30b.gguf --llama-bin build/bin --threads 16 \
        --shares 0,25,50,75,100 --runs 2 --output bench/results/vs_llamacpp_gpu.md
"""
import argparse
import ctypes
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.vs_llamacpp_gpu")
PLACEMENTS = ("layers", "profile")


def cpu_layers(num_layers, share):
    """llama.cpp's --n-cpu-moe for `share` percent of expert bytes in VRAM (every layer's experts the same size)."""
    return num_layers - int(round(share / 100 * num_layers))


def layer_mask(num_layers, num_experts, share):
    """bool [L, E]: the experts llama.cpp keeps in VRAM at `share`: every expert of the last layers."""
    mask = np.zeros((num_layers, num_experts), bool)
    mask[cpu_layers(num_layers, share):] = True
    return mask


def llama_bench(args, n_cpu_moe):
    """{("prompt", n) or ("decode", n): tok/s} from one llama-bench process."""
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", args.model, "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe),
           "-t", str(args.threads), "-p", ",".join(map(str, args.prompt_tokens)), "-n", str(args.decode_tokens),
           "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=True,
                         preexec_fn=die_with_parent).stdout
    result = {}
    for test in json.loads(out):
        kind, n = ("prompt", test["n_prompt"]) if test["n_gen"] == 0 else ("decode", test["n_gen"])
        result[(kind, n)] = float(test["avg_ts"])
    return result


def llama_users(args, n_cpu_moe):
    """Total decode tok/s of --users sequences at once (llama-batched-bench's S_TG)."""
    cmd = [str(Path(args.llama_bin) / "llama-batched-bench"), "-m", args.model, "-ngl", "99", "--n-cpu-moe",
           str(n_cpu_moe), "-t", str(args.threads), "-c", str(args.users * (32 + args.decode_tokens) + 64),
           "-npp", "32", "-ntg", str(args.decode_tokens), "-npl", str(args.users)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=True,
                          preexec_fn=die_with_parent)
    out = proc.stdout + proc.stderr  # its table goes through llama.cpp's log
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0]) and cells[2] == str(args.users):
            return float(cells[7])  # PP, TG, B, N_KV, T_PP, S_PP, T_TG, S_TG
    raise RuntimeError(f"no S_TG row for {args.users} users in llama-batched-bench's output:\n{out[-2000:]}")


def strata_worker(spec):
    """One fresh Strata process: the measurements of one placement at one share (spec: a JSON dict)."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_model import concurrent_rates, decode_rate, prompt
    from hybrid import LLM

    mask = np.array(spec["mask"], dtype=bool)
    llm = LLM(spec["model"], device="gpu", threads=spec["threads"], resident=mask,
              max_context=max(spec["prompt_tokens"]) + spec["decode_tokens"] + 64,
              kv_sequences=max(spec["users"], 1))
    llm.warm_up(progress=False)
    decode_rate(llm, spec["decode_tokens"])  # a warm-up run, as llama-bench makes one before its measured runs
    result = {"decode": decode_rate(llm, spec["decode_tokens"])}
    for n in spec["prompt_tokens"]:
        for seed in (3, 2):  # the first a warm-up (another prompt: a returning one would be restored, not read)
            out = llm.generate(prompt(llm, n, seed), max_tokens=1, temperature=0, ignore_eos=True)
        result[f"prompt {n}"] = out.timings["prompt_per_second"]
    if spec["users"] > 1:
        result["users"] = concurrent_rates(llm, spec["users"], spec["decode_tokens"])[2]  # as S_TG counts
    print("RESULT " + json.dumps(result), flush=True)


def die_with_parent():
    """In a child process (Linux): end it when the bench ends, also when a `timeout` kills the bench; else a worker
    left running takes the host's cores from whatever runs next."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_strata(args, mask):
    spec = {"model": args.model, "threads": args.threads, "mask": mask.tolist(), "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens, "users": args.users}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=args.timeout_s, preexec_fn=die_with_parent)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"Strata worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def make_profile(args, path):
    """A profile of --profile-prompts random prompts (64 tokens, 4 generated each), read on the CPU."""
    sys.path.insert(0, str(ROOT))
    from bench.gpu_model import prompt
    from hybrid import LLM
    from hybrid.expert_usage import ExpertUsage
    from placement.profile import model_id

    llm = LLM(args.model, device="cpu", threads=args.threads, max_context=256)
    llm.model.usage = ExpertUsage.for_config(llm.config)
    for i in range(args.profile_prompts):
        llm.generate(prompt(llm, 64, 100 + i), max_tokens=4, temperature=0.7, seed=i, ignore_eos=True)
    llm.model.usage.to_profile(model_id(llm.weights), source="vs_llamacpp_gpu").save(path)
    llm.close()


def profile_mask(args, profile_path, share, sizes):
    from placement.planner import plan_slots
    from placement.profile import ExpertProfile

    num_slots = int((sizes.num_layers - cpu_layers(sizes.num_layers, share)) * sizes.num_experts)
    placement = plan_slots(ExpertProfile.load(profile_path), sizes, num_slots, batch=1)
    return placement.resident_mask(sizes.num_layers, sizes.num_experts)


def measure(args):
    sys.path.insert(0, str(ROOT))
    from hybrid.formats import load_model
    from placement.budget import ModelSizes

    sizes = ModelSizes.from_weights(load_model(args.model))
    L, E = sizes.num_layers, sizes.num_experts
    profile_path = os.path.join(args.work_dir, "profile.npz")
    if "profile" in args.placements and not os.path.exists(profile_path):
        make_profile(args, profile_path)
    rows, earlier = {}, None
    if args.llama_results:  # llama.cpp's medians of an earlier run of this script (its vs_llamacpp_gpu.json)
        earlier = {int(k): v["llama.cpp"] for k, v in json.loads(Path(args.llama_results).read_text()).items()}
        missing = sorted(set(args.shares) - set(earlier))
        if missing:
            raise SystemExit(f"{args.llama_results}: no llama.cpp results at shares {missing}")
    for share in args.shares:
        n = cpu_layers(L, share)
        masks = {p: (layer_mask(L, E, share) if p == "layers" else profile_mask(args, profile_path, share, sizes))
                 for p in args.placements}
        samples = {**({} if earlier else {"llama.cpp": []}), **{f"strata {p}": [] for p in args.placements}}
        for run in range(args.runs):
            engines = list(samples) if run % 2 == 0 else list(samples)[::-1]
            for engine in engines:
                t0 = time.perf_counter()
                if engine == "llama.cpp":
                    bench = llama_bench(args, n)
                    result = {"decode": bench[("decode", args.decode_tokens)],
                              **{f"prompt {p}": bench[("prompt", p)] for p in args.prompt_tokens}}
                    if args.users > 1:
                        result["users"] = llama_users(args, n)
                else:
                    result = run_strata(args, masks[engine.split(" ", 1)[1]])
                samples[engine].append(result)
                log.info("share %d %% (n-cpu-moe %d), run %d, %s (%.0f s): %s", share, n, run + 1, engine,
                         time.perf_counter() - t0, result)
        rows[share] = {e: {k: float(np.median([s[k] for s in runs])) for k in runs[0]} for e, runs in samples.items()}
        if earlier:
            rows[share]["llama.cpp"] = earlier[share]
        save(args, rows)
    return rows


def save(args, rows):
    text = markdown(args, rows)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    with open(os.path.join(args.work_dir, "vs_llamacpp_gpu.json"), "w") as f:
        json.dump({str(k): v for k, v in rows.items()}, f, indent=1)


def markdown(args, rows):
    keys = ["decode"] + [f"prompt {p}" for p in args.prompt_tokens] + (["users"] if args.users > 1 else [])
    names = {"decode": "decode tok/s, 1 user", "users": f"decode tok/s, {args.users} users (total)",
             **{f"prompt {p}": f"prompt read {p} tok/s" for p in args.prompt_tokens}}
    lines = [f"Model `{os.path.basename(args.model)}`, {args.threads} threads, medians of {args.runs} runs "
             "(fresh processes, engines alternating).", ""]
    if args.llama_results:
        lines[-1:] = [f"llama.cpp's numbers come from an earlier run ({args.llama_results}), not this one.", ""]
    for key in keys:
        header = "| experts in VRAM | llama.cpp | " + " | ".join(f"strata {p} | ratio" for p in args.placements) + " |"
        lines += [f"### {names[key]}", "", header, "|---" * (2 + 2 * len(args.placements)) + "|"]
        for share, r in rows.items():
            base = r["llama.cpp"][key]
            cells = " | ".join(f"{r[f'strata {p}'][key]:.1f} | {r[f'strata {p}'][key] / base:.2f}x"
                               for p in args.placements)
            lines.append(f"| {share} % | {base:.1f} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model")
    parser.add_argument("--llama-bin", help="folder with llama-bench and llama-batched-bench")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--shares", default="0,25,50,75,100")
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--prompt-tokens", default="512,8192")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--profile-prompts", type=int, default=30)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--work-dir", default="/tmp/vs_llamacpp_gpu")
    parser.add_argument("--output")
    parser.add_argument("--llama-results", help="take llama.cpp's numbers from this vs_llamacpp_gpu.json of an earlier "
                        "run (same model, machine and settings) instead of running it; the table says so")
    args = parser.parse_args(argv)
    if args.worker:
        return strata_worker(json.loads(args.worker))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    args.shares = [int(s) for s in args.shares.split(",")]
    args.prompt_tokens = [int(p) for p in args.prompt_tokens.split(",") if p]
    args.placements = [p for p in args.placements.split(",") if p]
    os.makedirs(args.work_dir, exist_ok=True)
    measure(args)


if __name__ == "__main__":
    main()
