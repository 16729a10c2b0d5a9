"""Serving benchmark against any OpenAI-compatible base URL (Strata, llama.cpp's llama-server, ...).

The method of the tester report in shared/seeds/ (one warm-up request first):
- decode alone: 6 runs of a ~1,500-token prompt, seeds 1-6, mean decode tok/s of runs 2-6
- short prompt reads: 3 unique prompts each of ~500 / 1,000 / 2,000 tokens, median prompt_ms
- 1 / 2 / 4 different prompts at once: total tok/s = all generated tokens / wall time
- mixed: a ~1,500-token request, then a short one sent 3 s later: wall time of each
- decode during a long prompt read: while one client sends a prompt 16x longer than the
  decoding clients' prompts, their decode rate as a fraction of their rate just before it,
  with the speed of that prompt read beside it.
Rates come from the server's `timings` when it sends them, else from the client's clock.

    python bench/serve.py --base-url http://127.0.0.1:8080/v1 [--api-key KEY] [--quick]
"""
import argparse
import json
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

WORDS = ("memory expert layer token model cache server prompt stream thread kernel batch vector matrix "
         "python agent session context router tensor quant block decode prefill latency budget").split()


class Client:
    def __init__(self, base_url, api_key=None, model=None):
        self.base_url, self.api_key = base_url.rstrip("/"), api_key
        self.model = model or self._get("/models")["data"][0]["id"]

    def _request(self, path, body=None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.urlopen(urllib.request.Request(self.base_url + path, data, headers), timeout=3600)

    def _get(self, path):
        with self._request(path) as response:
            return json.load(response)

    def complete(self, prompt, max_tokens, seed=0, ignore_eos=True, on_token=None):
        """Stream one completion; returns sent time, token arrival times, usage and the server's timings."""
        body = {"model": self.model, "prompt": prompt, "temperature": 0.6, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
        if max_tokens is not None:  # None: until the context ends or `on_token` returns True
            body["max_tokens"] = max_tokens
        run = {"sent": time.perf_counter(), "times": [], "usage": {}, "timings": {}}
        with self._request("/completions", body) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                run["usage"] = chunk.get("usage") or run["usage"]
                run["timings"] = chunk.get("timings") or run["timings"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    run["times"].append(time.perf_counter())
                    if on_token and on_token():
                        break
        run["done"] = time.perf_counter()
        return run


def decode_rate(run):
    if run["timings"].get("predicted_per_second"):
        return run["timings"]["predicted_per_second"]
    times = run["times"]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def prompt_ms(run):
    return run["timings"].get("prompt_ms") or (run["times"][0] - run["sent"]) * 1e3


class Prompts:
    """Unique prompts of about a number of tokens (calibrated with the server's tokenizer)."""

    def __init__(self, client):
        self.rng = random.Random(0)
        probe = client.complete(self._words(400), 1)
        self.tokens_per_word = probe["usage"].get("prompt_tokens", 520) / 400

    def _words(self, n):
        return f"[{self.rng.getrandbits(64):x}] " + " ".join(self.rng.choice(WORDS) for _ in range(n))

    def make(self, num_tokens):
        return self._words(max(1, int(num_tokens / self.tokens_per_word)))


def bench_decode(client, prompts, size, max_tokens):
    rates = [decode_rate(client.complete(prompts.make(size), max_tokens, seed=seed)) for seed in range(1, 7)]
    return statistics.mean(rates[1:])


def bench_prompt_reads(client, prompts, sizes):
    return {n: statistics.median(prompt_ms(client.complete(prompts.make(n), 1)) for _ in range(3)) for n in sizes}


def bench_concurrency(client, prompts, size, max_tokens):
    totals = {}
    for n in (1, 2, 4):
        texts = [prompts.make(size) for _ in range(n)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda p: client.complete(p, max_tokens), texts))
        totals[n] = sum(r["usage"].get("completion_tokens", len(r["times"])) for r in runs) / (time.perf_counter() - t0)
    return totals


def bench_mixed(client, prompts, long_size, max_tokens):
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(client.complete, prompts.make(long_size), max_tokens)
        time.sleep(3)
        short = pool.submit(client.complete, prompts.make(50), max_tokens // 4)
        long, short = long.result(), short.result()
    return short["done"] - short["sent"], long["done"] - long["sent"]


def bench_decode_during_read(client, prompts, size, num_decoding):
    """Decode rate of `num_decoding` clients while another reads a 16x longer prompt, over their rate before."""
    ready, stop, lock = threading.Event(), threading.Event(), threading.Lock()
    count = [0]

    def on_token():
        with lock:
            count[0] += 1
            if count[0] >= 8 * num_decoding:
                ready.set()
        return stop.is_set()  # True: this client hangs up

    with ThreadPoolExecutor(num_decoding) as pool:
        decoding = [pool.submit(client.complete, prompts.make(size), None, on_token=on_token)
                    for _ in range(num_decoding)]
        ready.wait()
        time.sleep(1.0)  # the baseline window
        long = client.complete(prompts.make(16 * size), 1)
        read_s = long["times"][0] - long["sent"] if long["times"] else long["done"] - long["sent"]
        stop.set()
        runs = [f.result() for f in decoding]
    before = _window_rate(runs, long["sent"] - 1.0, long["sent"])
    during = _window_rate(runs, long["sent"], long["sent"] + read_s)
    prompt_tokens = long["usage"].get("prompt_tokens", 16 * size)
    return during / before if before else 0.0, prompt_tokens / read_s, prompt_tokens


def _window_rate(runs, start, end):
    """Mean per-client tokens per second inside [start, end]."""
    return statistics.mean(sum(start <= t <= end for t in r["times"]) / (end - start) for r in runs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    parser.add_argument("--quick", action="store_true", help="fewer generated tokens (a smoke run)")
    parser.add_argument("--read-size", type=int, default=None,
                        help="prompt tokens of the decoding clients in the last test; the long one reads 16x "
                             "(default 1024, --quick 128)")
    parser.add_argument("--label", default="", help="what was measured (server, model, machine)")
    parser.add_argument("--out", default=None, help="append the markdown result to this file")
    args = parser.parse_args(argv)
    client = Client(args.base_url, args.api_key, args.model)
    gen = 64 if args.quick else 800
    prompts = Prompts(client)
    client.complete(prompts.make(16), 4)  # warm-up
    decode = bench_decode(client, prompts, 1500, gen // 2)
    reads = bench_prompt_reads(client, prompts, (500, 1000, 2000))
    concurrency = bench_concurrency(client, prompts, 200, gen)
    mixed = bench_mixed(client, prompts, 1500, gen // 2)
    read_size = args.read_size or (128 if args.quick else 1024)
    share, read_speed, long_tokens = bench_decode_during_read(client, prompts, read_size, 2)
    report = "\n".join([
        f"## {args.label or client.model} ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {args.base_url})", "",
        "| decode alone tok/s | prompt read 500 / 1,000 / 2,000 tokens (ms) | 1 / 2 / 4 at once, total tok/s "
        "| mixed: short / long (s) | decode during a long read (fraction) | that read (tokens, tok/s) |",
        "|---:|---|---|---|---:|---|",
        f"| {decode:.1f} | {' / '.join(f'{ms:,.0f}' for ms in reads.values())} "
        f"| {' / '.join(f'{v:.1f}' for v in concurrency.values())} | {mixed[0]:.1f} / {mixed[1]:.1f} "
        f"| {share:.2f} | {long_tokens:,} at {read_speed:,.0f} |", ""])
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
