"""Waitress on sockets the caller bound, with Strata's limits rather than waitress's.

- Threads: every request the engine admits (running or queued) holds a thread while it waits, so there are
  `parallel + max_queue` of them plus a few spare: the request past the queue reaches the engine and gets
  its 429 with Retry-After at once, instead of waiting in waitress's own task queue.
- At most `max_connections` open connections; an idle one is closed after `idle_timeout_s`, and one whose
  request is not fully received `request_timeout_s` after it began (slow-loris) is closed too. At the limit,
  connections that have sent no whole request for PRESSURE_GRACE_S are closed at once, so slow clients
  cannot keep others out.
- A body over `max_body_bytes` is refused by its Content-Length before it is read (chunked: once it passes
  the limit), and waitress's own errors (a malformed request, a body too large) are OpenAI error JSON.
- `Expect: 100-continue` on a request without a body is answered (waitress would wait for a body forever).
"""
import logging
import threading
import time

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ErrorTask, ThreadedTaskDispatcher

from .body import DEFAULT_MAX_BODY_BYTES
from .errors import error_body

log = logging.getLogger(__name__)

SPARE_THREADS = 4  # /health, /metrics, /slots and 429 answers while every admitted request holds a thread
DEFAULT_REQUEST_TIMEOUT_S = 30
DEFAULT_IDLE_TIMEOUT_S = 60
PRESSURE_GRACE_S = 2  # at the connection limit, how long a connection may wait to send a whole request


class JsonErrorTask(ErrorTask):
    """Waitress's error response (e.g. 400 for a malformed request line, 413 for a long body) as JSON."""

    def execute(self):
        error = self.request.error
        if error.code == 413:
            limit = self.channel.adj.max_request_body_size - 1
            body = error_body(413, f"the request body is larger than the limit of {limit} bytes",
                              code="request_too_large")
        else:
            body = error_body(error.code, f"{error.reason}: {error.body}")
        self.status = f"{error.code} {error.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class Channel(HTTPChannel):
    """One connection; notes when its current request began."""

    error_task_class = JsonErrorTask
    request_started = 0.0

    def received(self, data):
        before = self.request
        result = super().received(data)
        if self.request is not None and self.request is not before:
            self.request_started = time.monotonic()
        return result

    def send_continue(self):
        if self.request.completed:  # no body to wait for: waitress would mark the request unfinished, and hang
            self.request.expect_continue = False
            return
        super().send_continue()


class Server(TcpWSGIServer):
    channel_class = Channel
    request_timeout_s = DEFAULT_REQUEST_TIMEOUT_S

    def readable(self):
        if self.accepting and len(self._map) >= self.adj.connection_limit:
            self._shed_waiting()
        return super().readable()

    def _shed_waiting(self):
        """At the connection limit, close the connections that nobody is answering and that have not sent a
        whole request for PRESSURE_GRACE_S (idle, or slow-loris), so that new clients get in at once."""
        now, wall = time.monotonic(), time.time()  # waitress keeps last_activity in wall time
        waiting = [c for c in self.active_channels.values() if not c.requests and not c.will_close and (
            c.request_started < now - PRESSURE_GRACE_S if c.request is not None
            else c.last_activity < wall - PRESSURE_GRACE_S)]
        for channel in waiting:
            channel.will_close = True
        if waiting:
            log.info("at the connection limit: closed %d connections that sent no whole request in %d s",
                     len(waiting), PRESSURE_GRACE_S)

    def maintenance(self, now):
        """Waitress closes idle connections; this also closes those whose request arrives too slowly."""
        super().maintenance(now)
        cutoff = time.monotonic() - self.request_timeout_s
        slow = [c for c in self.active_channels.values()  # one still answering a request is left alone
                if c.request is not None and not c.requests and c.request_started < cutoff]
        for channel in slow:
            channel.will_close = True
        if slow:
            log.info("closing %d connections whose request was not received within %d s", len(slow),
                     self.request_timeout_s)


class HttpServer:
    """Waitress serving `app` on listening `sockets` (see the module's docstring for the limits)."""

    def __init__(self, app, sockets, *, parallel, max_queue, max_connections, max_body_bytes=DEFAULT_MAX_BODY_BYTES,
                 request_timeout_s=DEFAULT_REQUEST_TIMEOUT_S, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S):
        self.adj = Adjustments(
            sockets=sockets, threads=parallel + max_queue + SPARE_THREADS, connection_limit=max_connections,
            max_request_body_size=max_body_bytes + 1,  # waitress refuses a body of this size or more
            channel_timeout=idle_timeout_s, cleanup_interval=max(1, min(request_timeout_s, idle_timeout_s) // 6),
            channel_request_lookahead=4,  # reads ahead so that a client's disconnect is seen while it waits
            asyncore_use_poll=True, ident="strata", clear_untrusted_proxy_headers=True)
        self.map = {}
        self.dispatcher = ThreadedTaskDispatcher()
        self.dispatcher.set_thread_count(self.adj.threads)
        self.servers = [self._server(app, sock, request_timeout_s) for sock in self.adj.sockets]
        self._stopping = threading.Event()

    def _server(self, app, sock, request_timeout_s):
        server = Server(app, self.map, True, sock, dispatcher=self.dispatcher, adj=self.adj, bind_socket=False,
                        sockinfo=(sock.family, sock.type, sock.proto, sock.getsockname()))
        server.request_timeout_s = request_timeout_s
        return server

    def run(self):
        """Serve until KeyboardInterrupt or SystemExit (which end it, as they end `waitress.serve`)."""
        try:
            while self.map and not self._stopping.is_set():
                wasyncore.loop(timeout=self.adj.asyncore_loop_timeout, map=self.map, use_poll=True, count=1)
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.dispatcher.shutdown()
            wasyncore.close_all(self.map)

    def stop(self):
        """Ends `run` from any other thread."""
        self._stopping.set()
        self.servers[0].pull_trigger()


def serve_http(app, sockets, *, parallel, max_queue, max_connections, max_body_bytes=DEFAULT_MAX_BODY_BYTES,
               request_timeout_s=DEFAULT_REQUEST_TIMEOUT_S, idle_timeout_s=DEFAULT_IDLE_TIMEOUT_S):
    """Serve `app` on the listening `sockets` until KeyboardInterrupt or SystemExit; returns then."""
    server = HttpServer(app, sockets, parallel=parallel, max_queue=max_queue, max_connections=max_connections,
                        max_body_bytes=max_body_bytes, request_timeout_s=request_timeout_s,
                        idle_timeout_s=idle_timeout_s)
    log.info("http: %d threads, at most %d connections, bodies up to %.1f MiB, requests within %d s, idle "
             "connections closed after %d s", server.adj.threads, max_connections, max_body_bytes / (1 << 20),
             request_timeout_s, idle_timeout_s)
    server.run()
