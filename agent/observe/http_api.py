"""`--metrics-port`: the agent's HTTP server - Prometheus metrics, Kubernetes probes, and the operator's status API
(docs/monitoring.md).

    GET  /metrics   Prometheus text (agent/observe/metrics.py)
    GET  /healthz   200 while the agent's loop comes round; 503 only when it is stuck (LoopBeat)
    GET  /readyz    200 while this node's workers are running (agent/observe/status_view.py)
    GET  /status    JSON: generation, phase, ranks and pids, the last fault and its recovery timeline
    POST /stop      graceful stop of this node's part of the job (exit code 82), with `Authorization: Bearer
                    <token>`; the token is read from --api-token-file at start and compared in constant time;
                    a missing or wrong token: 401 and nothing changes; no --api-token-file: 403, always

Why its own thread (stdlib http.server, one short-lived thread per request): a scrape or a probe must never
wait for the agent's loop, and the loop must never wait for a client. The server reads only what the event
sinks keep under their locks; the one call that changes anything (POST /stop) sets a flag and wakes the
loop, which carries the stop out on its own thread (agent/control/api_stop.py). Why /healthz looks only at
the loop: a failed liveness probe kills the pod and every rank's in-memory state with it, so a fault, a
restart round, a slow API server or a stuck worker must not fail it - only an agent that no longer runs its
loop, which nothing but a restart of the pod can help.

It listens on --metrics-host, 127.0.0.1 unless given: nothing off the host reaches it until the user says so
(in a pod: --metrics-host 0.0.0.0 for the kubelet's probes and Prometheus; docs/security.md).
"""
from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from hyperpodrun.errors import HyperpodrunError

log = logging.getLogger("hyperpodrun.agent")

#: a loop that has not come round for this long (plus two --monitor-interval) is stuck: /healthz answers 503
STUCK_AFTER_S = 120.0
#: seconds a client may take to send its request (a client that trickles bytes cannot hold a thread for long)
REQUEST_TIMEOUT_S = 5.0
#: the largest request body read (POST /stop takes none; anything past this is refused)
MAX_BODY = 4096


class LoopBeat:
    """When the agent's loop last came round. `beat` is called by the loop on each pass, `leave` when it ends;
    outside the loop (rendezvous, the hooks, the cleanup) the agent is not stuck, it waits on purpose."""

    def __init__(self, monitor_interval: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = STUCK_AFTER_S + 2 * monitor_interval
        self._clock = clock
        self._at: Optional[float] = None   # None: not in the loop

    def beat(self) -> None:
        self._at = self._clock()

    def leave(self) -> None:
        self._at = None

    def stuck_for(self) -> Optional[float]:
        """Seconds since the loop last came round, when that is past the limit; else None (healthy)."""
        at = self._at
        if at is None:
            return None
        since = self._clock() - at
        return since if since > self.limit else None


class StatusApi:
    """What the request handler reads and calls: the metrics, the status view, the loop beat, the token and the
    stop request (a callable that returns the exit code the stop ends the node with, or None: nothing to stop)."""

    def __init__(self, metrics: Any, status: Any, beat: LoopBeat, token: Optional[bytes],
                 stop: Callable[[], Optional[int]]) -> None:
        self.metrics, self.status, self.beat, self.token, self.stop = metrics, status, beat, token, stop

    def authorized(self, header: Optional[str]) -> bool:
        """`Authorization: Bearer <token>` with this agent's token, compared in constant time."""
        if self.token is None or not header:
            return False
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token)


class _Handler(BaseHTTPRequestHandler):
    server_version = "hyperpodrun"
    sys_version = ""
    timeout = REQUEST_TIMEOUT_S
    api: StatusApi   # set on the class made for each server

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 (the base class's name)
        log.debug("status API: %s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              headers: Optional[dict[str, str]] = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, value: Any, headers: Optional[dict[str, str]] = None) -> None:
        self._send(code, (json.dumps(value, default=str) + "\n").encode(), "application/json", headers)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        api = self.api
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
            self._send(200, generate_latest(api.metrics.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            stuck = api.beat.stuck_for()
            if stuck is None:
                self._send(200, b"ok\n")
            else:
                self._send(503, f"the agent's loop has not come round for {stuck:.0f}s\n".encode())
        elif path == "/readyz":
            ready = api.status.ready
            self._send(200 if ready else 503, b"ready\n" if ready else b"workers not running\n")
        elif path == "/status":
            self._json(200, api.status.snapshot())
        elif path == "/stop":
            self._json(405, {"error": "use POST /stop"}, {"Allow": "POST"})
        else:
            self._json(404, {"error": f"no such path; try /metrics, /healthz, /readyz, /status"})

    do_HEAD = do_GET

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            self._json(400, {"error": "a Content-Length that is a number"})
            return
        if int(length) > MAX_BODY:
            self._json(413, {"error": f"a request body of at most {MAX_BODY} bytes"})
            return
        self.rfile.read(int(length))
        if path != "/stop":
            self._json(404, {"error": "no such path; the one call that changes anything is POST /stop"})
            return
        api = self.api
        if api.token is None:
            self._json(403, {"error": "the status API has no token (--api-token-file): calls that change the job "
                                      "are refused"})
            return
        if not api.authorized(self.headers.get("Authorization")):
            log.warning("status API: POST /stop from %s refused: no or wrong bearer token", self.address_string())
            self._json(401, {"error": "a bearer token is required (Authorization: Bearer <token>)"},
                       {"WWW-Authenticate": 'Bearer realm="hyperpodrun"'})
            return
        code = api.stop()
        self._json(202, {"stopping": code is not None, "exit_code": code})

    def do_PUT(self) -> None:
        self._json(405, {"error": "GET /metrics, /healthz, /readyz, /status; POST /stop"})

    do_DELETE = do_PATCH = do_PUT


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-answer (or a bug in a handler): one debug line, not a traceback on the
        agent's stderr (socketserver's default prints one)."""
        log.debug("status API: a request from %s failed", client_address, exc_info=True)


class StatusServer:
    """The server on its own daemon thread: `close` stops it (the agent's cleanup)."""

    def __init__(self, host: str, port: int, api: StatusApi) -> None:
        handler = type("Handler", (_Handler,), {"api": api})
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("Server", (_Server,), {"address_family": family})
        try:
            self.httpd = server_class((host, port), handler)
        except OSError as exc:
            raise HyperpodrunError(f"--metrics-host {host} --metrics-port {port}: cannot listen there "
                                   f"({exc.strerror or exc})") from None
        self.address = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="hyperpodrun-status-api", daemon=True)
        self._thread.start()

    def close(self, wait: bool = False) -> None:
        """Stop serving. The server's loop notices within its poll interval (0.5 s): the agent does not wait for
        that (its exit follows, and a job's end must not take longer for a metrics port) unless `wait`."""
        stopper = threading.Thread(target=self._stop, name="hyperpodrun-status-api-stop", daemon=True)
        stopper.start()
        if wait:
            stopper.join(5.0)

    def _stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start(host: str, port: int, events: Any, beat: LoopBeat, token_file: Optional[str],
          stop: Callable[[], Optional[int]]) -> tuple[StatusServer, Any]:
    """The metrics sink and the status view on `events` (the EventLog), and the server on host:port. Returns the
    server and the metrics sink (whose `read_steps` the agent gives the ranks' steps once it has them)."""
    from hyperpodrun import auth
    from hyperpodrun.agent.observe.metrics import MetricsSink
    from hyperpodrun.agent.observe.status_view import JobStatus
    token = auth.read_api_token(token_file) if token_file else None
    metrics, status = MetricsSink(), JobStatus()
    events.add_sink(metrics)
    events.add_sink(status)
    server = StatusServer(host, port, StatusApi(metrics, status, beat, token, stop))
    log.info("metrics, probes and status API on http://%s:%d (/metrics /healthz /readyz /status; POST /stop %s)",
             host if ":" not in host else f"[{host}]", server.address[1],
             "with the bearer token of --api-token-file" if token else "refused: no --api-token-file")
    return server, metrics
