"""Load test: a real `strata serve` on a free loopback port, N concurrent clients for a bounded time.

Each client sends, until the time is up (or its request cap), a seeded mix of short and long prompts,
chat and plain completions, streaming and not, with `ignore_eos` so that every answer's length is known.
It checks what a user would: no request lost (every one answered, no connection error or timeout), none
truncated (a whole body, or a stream that ends with [DONE]; `max_tokens` tokens, finish_reason "length"),
no 5xx, and afterwards every slot idle and the queue empty (/slots). The server is then stopped with
SIGTERM and must exit cleanly.

    python bench/serve_load.py --clients 16 --minutes 10 [--parallel 4] [--model M.gguf] [--results FILE]
"""
import argparse
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

WORDS = ("memory expert layer token model cache server prompt stream thread kernel batch vector matrix "
         "python agent session context router tensor quant block decode prefill latency budget").split()
REQUEST_TIMEOUT_S = 600


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args, port, log_file):
    command = [sys.executable, "-m", "hybrid.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(args.parallel)]
    if args.model:
        command += ["--model", args.model]
    return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT), "strata " + " ".join(command[3:])


def wait_healthy(base, server, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it served")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server did not answer /health within {timeout_s} s")


class Outcome:
    """What one client saw; merged at the end."""

    def __init__(self):
        self.kinds, self.problems, self.latency, self.statuses = Counter(), [], {"short": [], "long": []}, Counter()
        self.tokens = 0


def make_request(rng, long_words):
    """(path, body, kind) of one request of the mix."""
    long = rng.random() < 0.2
    words = " ".join(rng.choice(WORDS) for _ in range(long_words if long else rng.randint(3, 40)))
    body = {"max_tokens": rng.randint(4, 48), "ignore_eos": True, "temperature": rng.choice([0, 0.7]),
            "seed": rng.randint(0, 1000), "stream": rng.random() < 0.5}
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}, long
    return "/v1/completions", {**body, "prompt": words}, long


def check_answer(path, body, status, raw):
    """'' when the answer is whole, else what is wrong with it."""
    if status != 200:
        return f"status {status}: {raw[:200]!r}"
    if body["stream"]:
        events = [e for e in raw.decode().split("\n\n") if e]
        if not events or events[-1] != "data: [DONE]":
            return "a stream without [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        usage = chunks[-1].get("usage") or {}
        finish = chunks[-2]["choices"][0]["finish_reason"] if len(chunks) > 1 else None
    else:
        answer = json.loads(raw)
        usage, finish = answer["usage"], answer["choices"][0]["finish_reason"]
    if finish != "length" or usage.get("completion_tokens") != body["max_tokens"]:
        return f"truncated: finish_reason {finish}, {usage.get('completion_tokens')} of {body['max_tokens']} tokens"
    return ""


def client_loop(base, seed, deadline, max_requests, long_words):
    rng, seen = random.Random(seed), Outcome()
    for _ in range(max_requests):
        if time.monotonic() >= deadline:
            break
        path, body, long = make_request(rng, long_words)
        kind = f"{'chat' if 'messages' in body else 'completion'} {'stream' if body['stream'] else 'whole'} " \
               f"{'long' if long else 'short'}"
        request = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:  # refused, reset, timed out: lost
            seen.problems.append(f"{kind}: lost ({type(exc).__name__}: {exc})")
            continue
        seen.statuses[status] += 1
        seen.kinds[kind] += 1
        problem = check_answer(path, body, status, raw)
        if problem:
            seen.problems.append(f"{kind}: {problem}")
        else:
            seen.tokens += body["max_tokens"]
            seen.latency["long" if long else "short"].append(time.perf_counter() - t0)
    return seen


def run_clients(base, args):
    deadline = time.monotonic() + args.minutes * 60
    with ThreadPoolExecutor(args.clients) as pool:
        outcomes = list(pool.map(lambda i: client_loop(base, args.seed + i, deadline, args.max_requests,
                                                       args.long_words), range(args.clients)))
    total = Outcome()
    for seen in outcomes:
        total.kinds.update(seen.kinds)
        total.statuses.update(seen.statuses)
        total.problems += seen.problems
        total.tokens += seen.tokens
        for key in total.latency:
            total.latency[key] += seen.latency[key]
    return total


def idle_after(base):
    with urllib.request.urlopen(base + "/slots", timeout=30) as response:
        slots = json.load(response)
    busy = [s for s in slots["slots"] if s["state"] != "idle"]
    return not busy and slots["queue_length"] == 0, slots


def percentile(values, q):
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def report(args, command, total, elapsed_s, idle, slots, exit_code, tracebacks):
    answered = sum(total.statuses.values())
    lost = sum("lost" in p for p in total.problems)
    truncated = sum("truncated" in p or "[DONE]" in p for p in total.problems)
    server_errors = sum(n for status, n in total.statuses.items() if status >= 500)
    lines = [
        f"## Load: {args.clients} clients for {args.minutes:g} min, `{command}` "
        f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        "| requests answered | lost | truncated | 5xx | other non-200 | tokens generated | short p50 / p95 (s) "
        "| long p50 / p95 (s) | slots idle after | exit on SIGTERM | tracebacks in the log |",
        "|---:|---:|---:|---:|---:|---:|---|---|---|---:|---:|",
        f"| {answered:,} | {lost} | {truncated} | {server_errors} | "
        f"{sum(n for s, n in total.statuses.items() if s != 200 and s < 500)} | {total.tokens:,} | "
        f"{percentile(total.latency['short'], 50):.2f} / {percentile(total.latency['short'], 95):.2f} | "
        f"{percentile(total.latency['long'], 50):.2f} / {percentile(total.latency['long'], 95):.2f} | "
        f"{'yes' if idle else 'NO: ' + json.dumps(slots)} | {exit_code} | {tracebacks} |",
        "",
        f"Mix ({elapsed_s:.0f} s): " + ", ".join(f"{k} {n}" for k, n in sorted(total.kinds.items())) + ".",
    ]
    if total.problems:
        lines += ["", "Problems (first 10):", *[f"- {p}" for p in total.problems[:10]]]
    return "\n".join(lines) + "\n", not (lost or truncated or server_errors or not idle or exit_code)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--model", help="a GGUF file or HF directory (default: the built-in demo model)")
    parser.add_argument("--max-requests", type=int, default=10_000, help="per client: a bound besides the time")
    parser.add_argument("--long-words", type=int, default=600, help="words of a long prompt (~1,800 demo tokens)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-timeout-s", type=int, default=900, help="cold Numba compiles take minutes")
    parser.add_argument("--results", help="append the markdown section to this file")
    args = parser.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="serve-load-", suffix=".log", delete=False) as log_file:
        server, command = start_server(args, port, log_file)
        try:
            wait_healthy(base, server, args.start_timeout_s)
            t0 = time.monotonic()
            total = run_clients(base, args)
            elapsed_s = time.monotonic() - t0
            idle, slots = idle_after(base)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                exit_code = server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                exit_code = "killed"
        log_file.seek(0)
        tracebacks = log_file.read().count("Traceback")
    section, ok = report(args, command, total, elapsed_s, idle, slots, exit_code, tracebacks)
    print(section + f"\nserver log: {log_file.name}")
    if args.results:
        with open(args.results, "a") as out:
            out.write("\n" + section)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
