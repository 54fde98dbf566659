"""A stand-in for the Kubernetes API server, for the `--k8s-report` tests: a threaded `http.server` on loopback
that answers the two requests the reporter's client sends - PATCH of a pod (strategic merge of
metadata.annotations) and POST of a core/v1 Event - and records every request as it came.

No API server can run here; this is the only fake of the reporter's tests, kept to what the client sends. It is
pinned to the client version of the test extra (CLIENT_VERSION): another version may send other paths or
content types, and the stand-in must be checked against it before the pin moves.

Modes, per kind of request: "ok" (answer as the API server would), "500" (an internal error), "hang" (hold the
request until `release()` or `HANG_MAX_S`, then close it unanswered).
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

#: the `kubernetes` client version this stand-in answers (pyproject.toml's test extra pins it)
CLIENT_VERSION = "36.0.3"
#: the longest a "hang" request is held
HANG_MAX_S = 60.0

POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)$")
EVENTS_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:   # a client that hung up: not news
        pass


class StandIn:
    """The server, what it received, and the pod annotations its patches left."""

    def __init__(self, patch_mode: str = "ok", event_mode: str = "ok") -> None:
        self.modes = {"patch": patch_mode, "event": event_mode}
        self.requests: list[dict[str, Any]] = []
        self.annotations: dict[str, dict[str, str]] = {}   # "ns/pod" -> its annotations
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def release(self) -> None:
        """Let every held request go (closed unanswered) and the ones after it too."""
        self._released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def write_kubeconfig(self, path: Any, token: str = "stand-in-token", namespace: str = "default") -> str:
        """A kubeconfig whose cluster is this stand-in (JSON is YAML)."""
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
                  "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                  "users": [{"name": "standin", "user": {"token": token}}],
                  "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin",
                                                               "namespace": namespace}}]}
        with open(path, "w") as fh:
            json.dump(config, fh)
        return str(path)

    # ---------------------------------------------------------------------------------------- views
    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["kind"] == kind]

    def events(self) -> list[dict[str, Any]]:
        return [r["body"] for r in self.of_kind("event")]

    def reasons(self) -> list[str]:
        return [e.get("reason") for e in self.events()]

    # ---------------------------------------------------------------------------------------- serving
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:   # quiet
                pass

            def do_PATCH(self) -> None:
                standin._serve(self, "PATCH")

            def do_POST(self) -> None:
                standin._serve(self, "POST")

            def do_GET(self) -> None:
                standin._serve(self, "GET")

        return Handler

    def _serve(self, req: BaseHTTPRequestHandler, method: str) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        body: Optional[Any] = json.loads(raw) if raw else None
        path = req.path.split("?", 1)[0]
        pod, events = POD_PATH.match(path), EVENTS_PATH.match(path)
        kind = "patch" if (pod and method == "PATCH") else "event" if (events and method == "POST") else "other"
        record = {"kind": kind, "method": method, "path": path, "content_type": req.headers.get("Content-Type"),
                  "authorization": req.headers.get("Authorization"), "body": body}
        with self._lock:
            self.requests.append(record)
        mode = self.modes.get(kind, "ok")
        if kind == "other":
            return self._answer(req, 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
        if mode == "hang":
            self._released.wait(HANG_MAX_S)
            req.close_connection = True
            return
        if mode == "500":
            return self._answer(req, 500, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                           "message": "stand-in: internal error", "code": 500})
        if pod is not None:
            key = f"{pod.group(1)}/{pod.group(2)}"
            with self._lock:
                ann = self.annotations.setdefault(key, {})
                ann.update(((body or {}).get("metadata") or {}).get("annotations") or {})
                answer = {"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": pod.group(2), "namespace": pod.group(1), "annotations": dict(ann)}}
            return self._answer(req, 200, answer)
        return self._answer(req, 201, body or {})

    @staticmethod
    def _answer(req: BaseHTTPRequestHandler, code: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
