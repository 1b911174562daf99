"""The admin port: Prometheus ``/metrics``, ``/healthz`` (alive) and ``/readyz``
(the detector can scan), for load balancers and orchestrators. It is its own listener
(``[metrics]`` host and port), so none of these paths can ever reach the upstream.

Readiness is the detecting process's: the engine exists (the configuration loaded and
the detector started), and the shared index, when one is configured, is connected or
degraded. A degraded index still answers 200: each replica keeps detecting what it sees
itself, and the body says ``"index": "degraded"``; a load balancer that must not route
to it can read the body. With a detector process, that process serves this port: when it
is gone, nothing answers, which a probe reads as not ready.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

#: ``readiness()`` -> (ready, details for the body).
Readiness = Callable[[], tuple[bool, dict[str, Any]]]


def start_admin_server(
    host: str, port: int, registry: CollectorRegistry, readiness: Readiness
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve the admin paths on ``host:port`` in a daemon thread; OSError when the port
    cannot be bound. Stop with ``server.shutdown(); server.server_close()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            path = self.path.partition("?")[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._json(200, {"status": "alive"})
            elif path == "/readyz":
                ready, details = readiness()
                self._json(200 if ready else 503, {"ready": ready, **details})
            else:
                self._json(
                    404, {"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]}
                )

        def _json(self, status: int, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass  # probes every few seconds: not for the event log

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="crosstalk-admin", daemon=True)
    thread.start()
    return server, thread
