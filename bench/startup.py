"""Start-up benchmark of `strata serve`: cold and warm start to serving, first and second request latency.

Every run is a fresh `strata serve` process on a free port. A cold run gets an empty Numba cache
(NUMBA_CACHE_DIR set to a new temporary directory), so it measures compilation; a warm run reuses the
cache a cold run filled. The model file is made beforehand, outside the timings: the demo model is
built into this run's own STRATA_CACHE_DIR, the Q4_K_M model by bench/make_model.py. Start to serving
is from the process's start to the first 200 from /health; then two chat requests of the same length
(different words, so nothing is reused) are timed end to end over HTTP. The Numba cache's files are
counted before and after each warm run: a warm start that writes a new one missed the cache.

    python bench/startup.py --model demo --runs 3 --profile
    python bench/startup.py --model q4km --runs 3 --profile
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("memory expert layer token model cache server prompt stream thread kernel batch vector matrix "
         "python agent session context router tensor quant block decode prefill latency budget").split()
PROMPT_STARTS = (1, 24)  # the two requests' first words: 37 tokens each at 10 words with the demo tokenizer
Q4KM_DIMS = ["--layers", "8", "--context", "4096"]  # make_model.py's defaults otherwise (~0.8 GB)
START_TIMEOUT_S = 1800
PROFILE_ROWS = 15  # the longest compilations listed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def chat(base, words, max_tokens):
    """Seconds of one non-streamed chat request, and its prompt tokens."""
    body = json.dumps({"messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as resp:
        answer = json.loads(resp.read())
    return time.perf_counter() - start, answer["usage"]["prompt_tokens"]


def cache_files(directory):
    return sum(len(files) for _, _, files in os.walk(directory))


def serve_run(model_args, env, log_path, prompt_words, max_tokens):
    """One fresh `strata serve`: {start_s, first_s, second_s, prompt_tokens}."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hybrid.cli", "serve", "--port", str(port), *model_args]
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"strata serve exited with {proc.returncode}: see {log_path}")
                if time.perf_counter() - start > START_TIMEOUT_S:
                    raise RuntimeError(f"strata serve did not answer /health in {START_TIMEOUT_S} s: see {log_path}")
                try:
                    if get(base + "/health", timeout=1)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.05)
            start_s = time.perf_counter() - start
            first_s, tokens = chat(base, prompt_words[0], max_tokens)
            second_s, _ = chat(base, prompt_words[1], max_tokens)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"start_s": start_s, "first_s": first_s, "second_s": second_s, "prompt_tokens": tokens}


def prepare_model(kind, work):
    """(serve's model arguments, env additions): the model made now, before any timing."""
    env = dict(os.environ, STRATA_CACHE_DIR=os.path.join(work, "strata-cache"))
    if kind == "demo":
        subprocess.run([sys.executable, "-c", "from hybrid.config import EngineConfig; from hybrid.demo import demo_model_path; "
                        "demo_model_path(EngineConfig.resolve().cache_dir)"],
                       cwd=ROOT, env=env, check=True)
        return [], env
    path = os.path.join(work, "bench-q4km.gguf")
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_model.py"), "--type", "Q4_K_M", *Q4KM_DIMS,
                    "-o", path], cwd=ROOT, env=env, check=True)
    return ["--model", path], env


def compile_times():
    """A numba:compile listener whose `times` gather (seconds, phase, kernel) of each top-level compilation
    (its nested ones inside it); its `phase` names the part of the start it is in."""
    from numba.core import event

    class CompileTimes(event.Listener):
        def __init__(self):
            self.phase, self.depth, self.started, self.times = "load", 0, 0.0, []

        def on_start(self, ev):
            if self.depth == 0:
                self.started = time.perf_counter()
            self.depth += 1

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0:
                fn = ev.data["dispatcher"].py_func
                self.times.append((time.perf_counter() - self.started, self.phase,
                                   f"{fn.__module__}.{fn.__qualname__}"))

    return CompileTimes()


def profile_child(model):
    """In this process (its NUMBA_CACHE_DIR empty): load `model` ("" for the demo) and warm it up; prints JSON
    {load_s, warm_up_s, compiles: [(seconds, phase, kernel)]}."""
    from numba.core import event

    sys.path.insert(0, ROOT)
    import hybrid

    times = compile_times()
    event.register("numba:compile", times)
    start = time.perf_counter()
    llm = hybrid.LLM(model or None, device="cpu")
    loaded = time.perf_counter()
    times.phase = "warm-up"
    llm.warm_up(progress=False)
    print(json.dumps({"load_s": loaded - start, "warm_up_s": time.perf_counter() - loaded, "compiles": times.times}))


def cold_profile(model_args, env, work):
    """Markdown lines: where a cold start's compile time goes (a fresh Numba cache, one in-process start)."""
    run_env = dict(env, NUMBA_CACHE_DIR=os.path.join(work, "numba-cache-profile"))
    model = model_args[1] if model_args else ""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--profile-child", model], cwd=ROOT,
                         env=run_env, check=True, capture_output=True, text=True).stdout
    found = json.loads(out.splitlines()[-1])
    compiles = sorted(found["compiles"], reverse=True)
    lines = [f"cold start in one process: load {found['load_s']:.1f} s, warm-up {found['warm_up_s']:.1f} s; "
             f"{len(compiles)} top-level compilations, {sum(c[0] for c in compiles):.1f} s in all", "",
             "| seconds | phase | kernel (its callees compiled inside it) |", "|---|---|---|"]
    lines += [f"| {seconds:.1f} | {phase} | {kernel} |" for seconds, phase, kernel in compiles[:PROFILE_ROWS]]
    return lines


def median_line(name, runs, key, digits=2):
    values = [r[key] for r in runs]
    return f"| {name} | {statistics.median(values):.{digits}f} | {', '.join(f'{v:.{digits}f}' for v in values)} |"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["demo", "q4km"], default="demo")
    p.add_argument("--runs", type=int, default=3, help="cold runs and warm runs each (medians over them)")
    p.add_argument("--words", type=int, default=10, help="words of each request's message (10: 37 tokens with the "
                   "demo tokenizer's chat template, the size of issue 31's first request)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--profile", action="store_true", help="then profile one cold start: its compilations by time")
    p.add_argument("--profile-child", metavar="MODEL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.profile_child is not None:
        profile_child(args.profile_child)
        return 0
    work = tempfile.mkdtemp(prefix="strata-startup-")
    model_args, env = prepare_model(args.model, work)
    words = [[WORDS[(start + j) % len(WORDS)] for j in range(args.words)] for start in PROMPT_STARTS]
    load_before = os.getloadavg()
    cold, warm, new_files = [], [], []
    for i in range(args.runs):
        cache = os.path.join(work, f"numba-cache-{i}")
        run_env = dict(env, NUMBA_CACHE_DIR=cache)
        cold.append(serve_run(model_args, run_env, os.path.join(work, f"cold-{i}.log"), words, args.max_tokens))
        print(f"cold {i}: {cold[-1]}", file=sys.stderr, flush=True)
    for i in range(args.runs):
        cache = os.path.join(work, f"numba-cache-{args.runs - 1}")
        before = cache_files(cache)
        run_env = dict(env, NUMBA_CACHE_DIR=cache)
        warm.append(serve_run(model_args, run_env, os.path.join(work, f"warm-{i}.log"), words, args.max_tokens))
        new_files.append(cache_files(cache) - before)
        print(f"warm {i}: {warm[-1]}, new cache files {new_files[-1]}", file=sys.stderr, flush=True)
    print("\n".join([
        f"model {args.model} ({' '.join(model_args) or 'built-in demo'}), {args.runs} cold + {args.runs} warm runs, "
        f"prompt {cold[0]['prompt_tokens']} tokens, {args.max_tokens} tokens generated; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; logs in {work}",
        "",
        "| seconds | median | runs |",
        "|---|---|---|",
        median_line("cold start to serving", cold, "start_s"),
        median_line("cold: first request", cold, "first_s", 3),
        median_line("cold: second request", cold, "second_s", 3),
        median_line("warm start to serving", warm, "start_s"),
        median_line("warm: first request", warm, "first_s", 3),
        median_line("warm: second request", warm, "second_s", 3),
        "",
        f"new Numba cache files written by each warm start: {new_files}",
    ]))
    if args.profile:
        print("\n".join(["", *cold_profile(model_args, env, work)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
