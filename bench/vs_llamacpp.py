"""Strata against llama.cpp on the CPU: the same GGUF, the same threads, alternating runs.

Each run is a fresh process per engine (Strata from this interpreter, llama.cpp through the
`llama-cpp-python` package in its own virtual environment, see bench/requirements.txt):
it reads a `--prompt-tokens` prompt in one batch (prompt read tok/s), then from a short
prompt decodes `--decode-tokens` tokens one at a time (decode tok/s). Both engines get the
same token ids (a fixed pseudo-random sequence), so they route to the same experts.
Effective bandwidth = weight bytes one decode token reads (dense tensors + top-k of each
layer's experts) x decode tok/s, next to the DRAM read bandwidth measured in the same run
with the same thread count. Medians over `--runs` runs.

    python bench/vs_llamacpp.py --model /tmp/bm-q4km.gguf --model /tmp/bm-q8.gguf --threads 1,2 \
        --llama-python /work/benchvenv/bin/python

Prints the table; --output also writes it to a file (bench/results/vs_llamacpp*.md keep the history by hand).
"""
import argparse
import json
import logging
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("bench.vs_llamacpp")
ROOT = Path(__file__).resolve().parent.parent
SHORT_PROMPT = 8
WARM_PROMPT = 96  # past the CPU backend's serial-twin thresholds (attention, norms, swiglu)


def token_ids(count, vocab_size, seed):
    """A fixed pseudo-random token sequence, the same for both engines."""
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab_size, size=count)]


def strata_worker(model, threads, prompt_tokens, decode_tokens):
    """(prompt read tok/s, decode tok/s) of Strata's CPU backend."""
    sys.path.insert(0, str(ROOT))
    from hybrid.batch import Batch, SeqChunk
    from hybrid.llm import LLM

    llm = LLM(model, device="cpu", threads=threads, max_context=prompt_tokens + decode_tokens + SHORT_PROMPT + 8)
    vocab = llm.config.vocab_size

    def read(kv, ids, logits="last"):
        return llm.model.forward(Batch([SeqChunk(kv, kv.length, np.asarray(ids, dtype=np.int64), logits)]))

    # Warm-up: every kernel compiled or loaded from Numba's cache, the parallel variants of the small
    # ops included (a short prompt runs their serial twins; WARM_PROMPT tokens cross the thresholds), and
    # one read of the measured prompt's length (other tokens), as llama-bench warms up on the test it times:
    # the first read of that size pays for its work arrays' pages.
    warm_tokens = max(WARM_PROMPT, prompt_tokens)
    warm = llm.model.new_sequence(SHORT_PROMPT + 1 + warm_tokens)
    read(warm, token_ids(SHORT_PROMPT, vocab, 1))
    read(warm, token_ids(1, vocab, 1))
    read(warm, token_ids(warm_tokens, vocab, 1))
    prompt = token_ids(prompt_tokens, vocab, 2)
    kv = llm.model.new_sequence(prompt_tokens + 8)
    start = time.perf_counter()
    read(kv, prompt)
    prompt_s = time.perf_counter() - start
    kv = llm.model.new_sequence(SHORT_PROMPT + decode_tokens + 8)
    read(kv, token_ids(SHORT_PROMPT, vocab, 3))
    steps = token_ids(decode_tokens, vocab, 4)
    start = time.perf_counter()
    for tok in steps:
        read(kv, [tok])
    decode_s = time.perf_counter() - start
    return prompt_tokens / prompt_s, decode_tokens / decode_s


LLAMA_WORKER = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama

model, threads, prompt_tokens, decode_tokens, short = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=prompt_tokens + decode_tokens + 64,
            n_batch=prompt_tokens, n_ubatch=prompt_tokens, verbose=False)
vocab = llm.n_vocab()
def ids(count, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(1, vocab, size=count)]
llm.eval(ids(short, 1)); llm.reset()
prompt = ids(prompt_tokens, 2)
start = time.perf_counter(); llm.eval(prompt); prompt_s = time.perf_counter() - start
llm.reset()
llm.eval(ids(short, 3))
steps = ids(decode_tokens, 4)
start = time.perf_counter()
for tok in steps:
    llm.eval([tok])
decode_s = time.perf_counter() - start
import llama_cpp
features = llama_cpp.llama_print_system_info().decode().strip()
print(json.dumps({"prompt_tps": prompt_tokens / prompt_s, "decode_tps": decode_tokens / decode_s, "features": features}))
"""


def llama_bench(model, threads, args, env):
    """llama.cpp's own llama-bench on the CPU (no GPU visible to it, no layers offloaded): one fresh process."""
    cmd = [args.llama_bench, "-m", model, "-t", str(threads), "-p", str(args.prompt_tokens), "-n",
           str(args.decode_tokens), "-ngl", "0", "-r", "1", "-o", "json", *shlex.split(args.llama_args)]
    proc = subprocess.run(cmd, env={**env, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench on {model} failed:\n{proc.stderr[-3000:]}")
    result = {"features": "llama-bench"}
    for test in json.loads(proc.stdout):
        result["decode_tps" if test["n_gen"] else "prompt_tps"] = float(test["avg_ts"])
        result["features"] = test.get("cpu_info", result["features"])
    return result


def run_engine(engine, model, threads, args):
    """One fresh process of `engine`; returns {"prompt_tps", "decode_tps"}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "STRATA_THREADS": str(threads)}
    if engine == "llama.cpp" and args.llama_bench:
        return llama_bench(model, threads, args, env)
    if engine == "llama.cpp":
        cmd = [args.llama_python, "-c", LLAMA_WORKER, model, str(threads), str(args.prompt_tokens),
               str(args.decode_tokens), str(SHORT_PROMPT)]
    else:
        cmd = [sys.executable, __file__, "--worker", "--model", model, "--threads", str(threads),
               "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} on {model} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def decode_bytes_per_token(model):
    """Weight bytes one decode token reads: every dense tensor (no embedding table) and top-k of each layer's experts."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    top_k = int(reader.fields[f"{arch}.expert_used_count"].contents())
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            continue
        if "_exps." in t.name:
            total += int(t.n_bytes) * top_k // int(t.shape[-1])
        else:
            total += int(t.n_bytes)
    return total


def dram_gbps(threads, num_bytes=1 << 30, repeats=5):
    """Read bandwidth (GB/s) of a parallel float32 sum with `threads` Numba threads."""
    import numba
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, nogil=True)
    def parallel_sum(a):
        acc = np.float32(0)
        for i in prange(a.shape[0]):
            acc += a[i]
        return acc

    numba.set_num_threads(threads)
    a = np.ones(num_bytes // 4, dtype=np.float32)
    parallel_sum(a)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        parallel_sum(a)
        times.append(time.perf_counter() - start)
    return a.nbytes / float(np.median(times)) / 1e9


def measure(args):
    rows = []
    for model in args.model:
        touched = decode_bytes_per_token(model)
        for threads in args.threads:
            samples = {"strata": [], "llama.cpp": []}
            drams = []
            for run in range(args.runs):
                order = ("strata", "llama.cpp") if run % 2 == 0 else ("llama.cpp", "strata")
                for engine in order:
                    result = run_engine(engine, model, threads, args)
                    log.info("%s, %d thread(s), run %d, %s: prompt %.1f tok/s, decode %.1f tok/s",
                             os.path.basename(model), threads, run, engine, result["prompt_tps"], result["decode_tps"])
                    samples[engine].append(result)
                    args.llama_features = result.get("features", args.llama_features)
                drams.append(dram_gbps(threads))
            med = {e: {k: float(np.median([s[k] for s in v])) for k in ("prompt_tps", "decode_tps")}
                   for e, v in samples.items()}
            rows.append((os.path.basename(model), threads, touched, med, float(np.median(drams))))
    return rows


def markdown(rows, args):
    lines = [
        "# Strata vs llama.cpp, CPU",
        "",
        f"{platform.machine()}, {os.cpu_count()} CPUs ({cpu_name()}); llama.cpp = "
        + (f"`{args.llama_bench}` on the CPU (-ngl 0, no GPU visible), {args.llama_build}; "
           + (f"with `{args.llama_args}`; " if args.llama_args else "")
           if args.llama_bench else "llama-cpp-python built from its PyPI sdist, CPU only, "
           f"{args.llama_build}, no BLAS; ")
        + f"its CPU features: `{args.llama_features}`. "
        "Same GGUF and thread count for both, alternating fresh processes; medians of "
        f"{args.runs} runs. Prompt read: {args.prompt_tokens} tokens in one batch. Decode: {args.decode_tokens} tokens "
        f"one at a time after a {SHORT_PROMPT}-token prompt. Effective bandwidth = weight bytes read per decode token "
        "(dense tensors + top-k experts) x decode tok/s; DRAM = parallel float32 sum, same threads, same run.",
        "",
        "| model | threads | MB/token | decode tok/s strata | llama.cpp | ratio | prompt tok/s strata | llama.cpp | ratio "
        "| strata GB/s | llama.cpp GB/s | DRAM GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, threads, touched, med, dram in rows:
        s, l = med["strata"], med["llama.cpp"]
        lines.append(
            f"| {model} | {threads} | {touched / 1e6:.0f} | {s['decode_tps']:.1f} | {l['decode_tps']:.1f} "
            f"| {s['decode_tps'] / l['decode_tps']:.2f}x | {s['prompt_tps']:.1f} | {l['prompt_tps']:.1f} "
            f"| {s['prompt_tps'] / l['prompt_tps']:.2f}x | {touched * s['decode_tps'] / 1e9:.1f} "
            f"| {touched * l['decode_tps'] / 1e9:.1f} | {dram:.1f} |")
    return "\n".join(lines) + "\n"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="GGUF file (repeatable)")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--llama-python", default="/work/benchvenv/bin/python",
                   help="interpreter of the virtual environment that has llama-cpp-python")
    p.add_argument("--llama-build", default="GGML_NATIVE=ON without AMX (-mno-amx-tile -mno-amx-int8 -mno-amx-bf16; "
                                            "its AMX path crashed on our VM)",
                   help="how that llama-cpp-python was built, for the table's header")
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary, run instead of llama-cpp-python (CPU only: "
                                        "no GPU visible to it, -ngl 0); its decode starts from an empty context")
    p.add_argument("--llama-args", default="", help="more llama-bench options, one string (e.g. \"--repack 0\": "
                   "on an AVX-512 host without AMX its prompt read was faster without the Q4_K repacking)")
    p.add_argument("--output", help="also write the table here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        prompt_tps, decode_tps = strata_worker(args.model[0], int(args.threads), args.prompt_tokens, args.decode_tokens)
        print(json.dumps({"prompt_tps": prompt_tps, "decode_tps": decode_tps}))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.llama_features = "not reported"
    table = markdown(measure(args), args)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
