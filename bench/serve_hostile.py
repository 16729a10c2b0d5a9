"""The hostile requests of issue 31 against a real `strata serve` on a free loopback port, one probe each:
what the client gets, how long it takes, and how much the server's peak memory (VmHWM) grows.

- a 10 MiB prompt (completion and chat), with --max-body-mib 16 so that it reaches the context check
- a 100 MiB body announced by Content-Length (the answer must come before the body is sent)
- `Expect: 100-continue` on a GET
- more concurrent requests than the slots and the queue admit: those past the queue get 429 at once
- more slow clients (a request head that never ends) than --max-connections: when a normal request is served

    python bench/serve_hostile.py [--model M.gguf] [--parallel 4] [--slow-clients 150]
"""
import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

MIB = 1 << 20


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.command = ["serve", "--port", str(self.port), "--parallel", str(args.parallel), "--max-body-mib", "16"]
        if args.model:
            self.command += ["--model", args.model]
        self.process = subprocess.Popen([sys.executable, "-m", "hybrid.cli", *self.command],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_healthy(self, timeout_s=900):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise SystemExit(f"the server did not answer /health within {timeout_s} s")

    def peak_mib(self):
        with open(f"/proc/{self.process.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

    def post(self, path, body, timeout=600):
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


def raw(port, data, timeout=60):
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        return conn.recv(65536)


def probe_huge_prompts(server):
    rows = []
    for name, path, body in (
            ("10 MiB completion prompt", "/v1/completions", {"prompt": "word " * (2 * MIB), "max_tokens": 1}),
            ("10 MiB chat message", "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "word " * (2 * MIB)}], "max_tokens": 1})):
        before, t0 = server.peak_mib(), time.perf_counter()
        status, answer = server.post(path, body)
        error = json.loads(answer)["error"]
        rows.append((name, f"{status} {error['code']}", time.perf_counter() - t0, server.peak_mib() - before))
    before, t0 = server.peak_mib(), time.perf_counter()
    answer = raw(server.port, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {100 * MIB}\r\n\r\n"
                 .encode())
    rows.append(("100 MiB body (Content-Length, body not sent)", answer.split(b"\r\n")[0].decode(),
                 time.perf_counter() - t0, server.peak_mib() - before))
    return rows


def probe_expect_on_get(server):
    t0 = time.perf_counter()
    answer = raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n", timeout=10)
    return [("Expect: 100-continue on GET /health", answer.split(b"\r\n")[0].decode(), time.perf_counter() - t0, 0)]


def probe_queue(server, num_requests):
    body = {"prompt": "Once upon a time", "max_tokens": 32, "ignore_eos": True}

    def ask(_):
        t0 = time.perf_counter()
        status, _ = server.post("/v1/completions", body)
        return status, time.perf_counter() - t0

    with ThreadPoolExecutor(num_requests) as pool:
        answers = list(pool.map(ask, range(num_requests)))
    busy = [s for status, s in answers if status == 429]
    done = [s for status, s in answers if status == 200]
    return [(f"{num_requests} requests at once: {len(done)} x 200, {len(busy)} x 429",
             f"429 after at most {max(busy, default=0):.2f} s", max(done, default=0), 0)]


def probe_slow_clients(server, num_slow):
    slow = []
    for _ in range(num_slow):
        conn = socket.create_connection(("127.0.0.1", server.port))
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
        slow.append(conn)
    t0 = time.perf_counter()
    answer = raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=300)
    row = (f"a normal request while {num_slow} slow clients connect", answer.split(b"\r\n")[0].decode(),
           time.perf_counter() - t0, 0)
    for conn in slow:
        conn.close()
    return [row]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a GGUF file or HF directory (default: the built-in demo model)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--slow-clients", type=int, default=150)
    parser.add_argument("--queue-requests", type=int, default=90, help="default: past 4 slots + a queue of 64")
    args = parser.parse_args()
    server = Server(args)
    try:
        server.wait_healthy()
        rows = probe_huge_prompts(server) + probe_expect_on_get(server) + probe_queue(server, args.queue_requests) \
            + probe_slow_clients(server, args.slow_clients)
    finally:
        server.process.terminate()
        server.process.wait(120)
    print(f"`strata {' '.join(server.command)}`\n")
    print("| probe | answer | seconds | server peak memory growth (MiB) |\n|---|---|---:|---:|")
    for name, answer, seconds, grown in rows:
        print(f"| {name} | {answer} | {seconds:.2f} | {grown:.0f} |")


if __name__ == "__main__":
    main()
