"""serve_http's waitress over a real socket: JSON errors from the transport, the body limit, Expect on a GET,
slow clients that cannot hold every connection, and a queue limit that answers 429 instead of waiting."""
import contextlib
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import falcon
import pytest

from server import create_app
from server.errors import serialize_error
from server.http import HttpServer


class Echo:
    def on_get(self, req, resp):
        resp.media = {"ok": True}

    def on_post(self, req, resp):
        resp.media = {"bytes": len(req.bounded_stream.read())}


def echo_app():
    app = falcon.App()
    app.set_error_serializer(serialize_error)
    app.add_route("/", Echo())
    return app


@contextlib.contextmanager
def serving(app, **limits):
    """`app` served by HttpServer on a free loopback port; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    options = {"parallel": 1, "max_queue": 1, "max_connections": 16, "max_body_bytes": 1000, **limits}
    server = HttpServer(app, [sock], **options)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        server.stop()
        thread.join(10)
        assert not thread.is_alive()


def exchange(port, data, timeout=5.0):
    """Send raw bytes; the raw answer, read until the server closes or `timeout` passes quietly."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        answer = b""
        with contextlib.suppress(socket.timeout):
            while chunk := conn.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    break
    return answer


def status_and_json(answer):
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer
    return int(head.split()[1]), json.loads(body)


def test_transport_errors_are_json():
    with serving(echo_app()) as port:
        status, body = status_and_json(exchange(port, b"NOT HTTP AT ALL\r\n\r\n"))
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        too_long = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"  # refused before any body is sent
        status, body = status_and_json(exchange(port, too_long))
        assert status == 413 and body["error"]["code"] == "request_too_large"
        chunk = b"3e8\r\n" + b"a" * 1000 + b"\r\n"
        chunked = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3 + b"0\r\n\r\n"
        assert status_and_json(exchange(port, chunked))[0] == 413
        fits = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"b" * 1000
        assert status_and_json(exchange(port, fits)) == (200, {"bytes": 1000})


def test_expect_continue_on_a_get_is_answered():
    with serving(echo_app()) as port:
        answer = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n", timeout=3)
        assert status_and_json(answer.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"")) == (200, {"ok": True})


def test_slow_clients_cannot_hold_every_connection():
    with serving(echo_app(), max_connections=8) as port:
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
        for conn in slow:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends the head
        t0 = time.perf_counter()
        answer = exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=15)
        waited = time.perf_counter() - t0
        assert status_and_json(answer) == (200, {"ok": True})
        assert waited < 5, f"served after {waited:.1f} s"  # the default request timeout is 30 s
        for conn in slow:
            conn.close()


def test_a_request_that_never_ends_is_cut_off():
    with serving(echo_app(), request_timeout_s=1) as port, socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")  # 5 bytes short
        conn.settimeout(10)
        t0 = time.perf_counter()
        assert conn.recv(100) == b""  # closed by the server
        assert time.perf_counter() - t0 < 5


def test_requests_past_the_queue_get_429_at_once(llm):
    from hybrid.engine import Engine

    usage = llm.model.usage  # a new engine takes the model's usage counters over: hand them back after
    engine = Engine(llm, num_slots=1, max_queue=8).start()
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "temperature": 0})

    def ask(port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = (response.status, response.getheader("Retry-After"), json.loads(response.read()),
                  time.perf_counter())
        conn.close()
        return answer

    try:
        # 1 running + 8 queued + 3 past the queue: with waitress's 2 x parallel + 4 threads, the admitted ones
        # held every thread and the rest waited for one, then for a slot, and none was refused
        with serving(create_app(engine, "demo"), max_queue=8, max_connections=32) as port, \
                ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, [port] * 12))
    finally:
        engine.stop()
        llm.model.usage = usage
    busy = [a for a in answers if a[0] == 429]
    done = [a for a in answers if a[0] == 200]
    assert len(busy) == 3 and len(done) == 9, [a[:2] for a in answers]
    assert all(a[1] and a[2]["error"]["type"] == "rate_limit_error" for a in busy)
    assert max(a[3] for a in busy) < min(a[3] for a in done)  # refused at once, not after waiting for a thread


@pytest.mark.parametrize("api_key", [None, "secret"])
def test_health_needs_no_key(engine, api_key):
    with serving(create_app(engine, "demo", api_key=api_key)) as port:
        status, body = status_and_json(exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        assert (status, body) == (200, {"status": "ok"})
