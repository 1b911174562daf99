"""A request that meets a kept-alive upstream connection the engine has just closed goes
once more on a fresh one (proxy/mitm/upstream_retry.py), through a real mitmdump with
crosstalk's addon and the real ``openai`` SDK, against an engine stand-in that closes
kept-alive connections as real ones do.

Two ways to bring the failure about on purpose: the engine closes a connection when its
second request arrives (the close and the request crossing, made certain), and the
engine closes idle connections after a second while the proxy's event loop is busy as
the next request arrives (the race as it happens in front of llama-server). With
``crosstalk_upstream_retry`` off, as in bare mitmdump, the first gives a 502.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
from conftest import read_events, run_mitmdump

COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "text": "Fine.", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class KeepAliveEngine:
    """An HTTP/1.1 engine stand-in on loopback: answers every POST with one completion,
    keeps connections alive (``Connection: close`` only when asked, echoed as
    cpp-httplib does), closes one after ``idle`` seconds without a request, or, with
    ``close_on_second``, when a connection's second request arrives, unanswered."""

    def __init__(self, *, idle: float = 30.0, close_on_second: bool = False) -> None:
        self.idle, self.close_on_second = idle, close_on_second
        self.connections = 0
        self.requests = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                self.connections += 1
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(self.idle)
        buffer, served = b"", 0
        with conn, contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)  # socket.timeout: idle, closed by `with`
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                     if line.startswith(b"content-length:")), 0,
                )  # fmt: skip
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                served += 1
                self.requests += 1
                if self.close_on_second and served == 2:
                    return
                body = json.dumps(COMPLETION).encode()
                close = b"connection: close" in head.lower()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + (b"Connection: close\r\n" if close else b"")
                    + b"Content-Length: %d\r\n\r\n" % len(body)
                    + body
                )
                if close:
                    return

    def close(self) -> None:
        self._listener.close()


@contextlib.contextmanager
def engine(**kw) -> Iterator[KeepAliveEngine]:
    e = KeepAliveEngine(**kw)
    try:
        yield e
    finally:
        e.close()


BUSY_ADDON = '''
import time

class Busy:
    """Holds the event loop as a busy detector would, when asked to."""

    def request(self, flow):
        if flow.request.headers.get("x-busy"):
            time.sleep(float(flow.request.headers["x-busy"]))

addons = [Busy()]
'''


def complete(client: openai.OpenAI, rid: str, **headers: str) -> int:
    """One completion; its HTTP status (a 502 raises in the SDK)."""
    try:
        client.completions.create(
            model="m", prompt="Hi", extra_headers={"X-Request-ID": rid, **headers}
        )
        return 200
    except openai.APIStatusError as e:
        return e.status_code


def test_a_connection_closed_as_the_request_crosses_it_is_retried_once(tmp_path: Path):
    with engine(close_on_second=True) as e, run_mitmdump(tmp_path, e.url) as p:
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-x", max_retries=0, timeout=30)
        statuses = [complete(client, f"r-{i}") for i in range(4)]
        retried = [ev for ev in read_events(p.log) if ev["event"] == "upstream.retried"]
    assert statuses == [200] * 4
    # r-0 opens a connection; each later request meets it closing, goes again on a new
    # one and is that one's first: retried once each, never twice.
    assert sorted(ev["request_id"] for ev in retried) == ["r-1", "r-2", "r-3"]
    assert {ev["reason"] for ev in retried} == {"server closed connection"}
    assert e.connections == 4 and e.requests == 7


def test_without_the_retry_the_closed_connection_is_a_502(tmp_path: Path):
    """The control: mitmproxy's own behaviour, and the bare mitmdump's."""
    with (
        engine(close_on_second=True) as e,
        run_mitmdump(tmp_path, e.url, "crosstalk_upstream_retry=false") as p,
    ):
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-x", max_retries=0, timeout=30)
        statuses = [complete(client, f"r-{i}") for i in range(2)]
    assert statuses == [200, 502]


def test_an_idle_close_while_the_loop_is_busy_is_retried(tmp_path: Path):
    """The engine closes idle connections after 1 s; the next request comes 0.7 s after
    the first answer and the loop is busy for 0.6 s as it arrives, so the close can land
    after the proxy read the request and before it read the close (the research for
    this test saw a 502 every time without the retry). Whether it lands there on a busy
    machine or not, the client gets its answer."""
    busy = tmp_path / "busy.py"
    busy.write_text(BUSY_ADDON)
    with engine(idle=1.0) as e, run_mitmdump(tmp_path, e.url, scripts=[busy]) as p:
        client = openai.OpenAI(base_url=f"{p.url}/v1", api_key="sk-x", max_retries=0, timeout=30)
        first = complete(client, "r-1")
        threading.Event().wait(0.7)  # the client's pause: the engine's idle clock runs
        second = complete(client, "r-2", **{"x-busy": "0.6"})
    assert (first, second) == (200, 200)
    assert e.requests == 2  # the engine answered each request once
