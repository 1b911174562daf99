"""Limits ([limits]), through a real mitmdump: a body over the size limit is 413 and a
body that trickles in too slowly 408, neither reaches the engine; beyond the concurrency
limit a request is 429 with Retry-After until an exchange in flight ends; an engine that
hangs mid-stream is cut off after the idle timeout; output past the scan limit passes
unscanned (and enforce mode stops holding it back). Errors in the API's own format."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import urllib.error

import httpx2
import openai
import pytest
from conftest import run_mitmdump, run_sim, wait_for_events


def client(url: str, rid: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-limits", max_retries=0, timeout=30,
        default_headers={"X-Request-ID": rid, **headers},
    )  # fmt: skip


def ask(url: str, rid: str, text: str = "Hello", **headers: str):
    return client(url, rid, **headers).chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}]
    )


def stream(url: str, rid: str, **headers: str) -> None:
    chunks = client(url, rid, **headers).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me a story"}], stream=True
    )
    for _ in chunks:
        pass


def eventually(read, timeout: float = 30):
    """``read()`` once it stops raising HTTPError (a 404 until the simulator knows)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read()
        except urllib.error.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def reached(sim, rid: str) -> None:
    """Wait (bounded) until the engine has the request."""
    eventually(lambda: sim.headers(rid))


@contextlib.contextmanager
def configured(tmp_path, toml: str):
    """The simulator and a mitmdump with crosstalk configured by ``toml``."""
    cfg = tmp_path / "crosstalk.toml"
    cfg.write_text(toml)
    with run_sim(tmp_path) as sim, run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as p:
        yield sim, p


@pytest.fixture
def limited(tmp_path):
    with configured(
        tmp_path, "[limits]\nmax_request_bytes = 2000\nmax_concurrent_exchanges = 2\n"
    ) as s:
        yield s


def test_a_body_over_the_limit_is_413_and_never_reaches_the_engine(limited):
    sim, proxy = limited
    with pytest.raises(openai.APIStatusError) as info:
        ask(proxy.url, "too-big", "x " * 2000)
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"
    with pytest.raises(urllib.error.HTTPError):
        sim.headers("too-big")
    assert ask(proxy.url, "small").choices[0].message.content  # the next one passes


def test_beyond_the_concurrency_limit_clients_are_told_to_retry(limited):
    sim, proxy = limited
    slow = {"x-sim-misbehave": "slow"}  # 0.2 s a chunk: these two stay in flight a while
    busy = [
        threading.Thread(target=stream, args=(proxy.url, f"busy-{i}"), kwargs=slow) for i in (1, 2)
    ]
    for t in busy:
        t.start()
    for i in (1, 2):
        reached(sim, f"busy-{i}")
    with pytest.raises(openai.APIStatusError) as info:
        ask(proxy.url, "third")
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "too_many_requests"
    for t in busy:
        t.join(60)
    assert ask(proxy.url, "after").choices[0].message.content
    events = wait_for_events(
        proxy.log, lambda ev: any(e.get("request_id") == "after" for e in ev), timeout=30
    )
    refused = [e for e in events if e["event"] == "limit.exceeded"]
    assert [e["status"] for e in refused] == [429]


@pytest.fixture
def timed(tmp_path):
    # An idle gap 20 times the trickle's pause: a busy machine does not make it idle.
    with configured(tmp_path, "[limits]\nmax_request_seconds = 2\nidle_timeout_seconds = 5\n") as s:
        yield s


def test_a_body_that_trickles_in_is_408_and_never_reaches_the_engine(timed):
    """The body in 16-byte pieces every 0.25 s: never idle for the 5 s idle timeout, but
    longer than max_request_seconds (2 s) in all (about 3.5 s; a slow machine only makes
    it longer)."""
    sim, proxy = timed
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]}
    ).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-ID: trickle\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as s:
        s.sendall(head)
        for i in range(0, len(body), 16):
            s.sendall(body[i : i + 16])
            time.sleep(0.25)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 408 " in status_line, reply[:300]
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    with pytest.raises(urllib.error.HTTPError):
        sim.headers("trickle")


def test_an_engine_that_hangs_mid_stream_is_cut_off(timed):
    """The simulator stops half way for 30 s; five seconds of silence close the
    connection: the client's stream ends early (mitmproxy ends the chunked body, so the
    SDK sees an end without ``[DONE]`` or an error), the engine sees the abort, and the
    exchange is logged as cut short, with its error."""
    sim, proxy = timed
    with contextlib.suppress(openai.APIError, httpx2.HTTPError):
        stream(proxy.url, "hung", **{"x-sim-misbehave": "stall"})
    outcome = eventually(lambda: sim.outcome("hung"))  # the engine notices as it wakes
    m = re.fullmatch(r"aborted after (\d+) of (\d+) events", outcome)
    assert m and int(m[1]) < int(m[2]), outcome
    events = wait_for_events(
        proxy.log, lambda ev: any(e.get("request_id") == "hung" for e in ev), timeout=30
    )
    (line,) = [e for e in events if e["event"] == "exchange" and e["request_id"] == "hung"]
    assert line["truncated"] is True and line["error"]


@pytest.mark.parametrize("mode", ["shadow", "enforce"])
def test_output_past_the_scan_limit_passes_unscanned(tmp_path, mode):
    """With 40 characters scanned at most, a long answer still arrives whole (enforce
    mode stops holding it back at the limit), and its exchange line says it was capped."""
    toml = f'[proxy]\nmode = "{mode}"\n[limits]\nmax_scanned_output_chars = 40\n'
    with configured(tmp_path, toml) as (sim, p):
        chunks = client(p.url, "long").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Tell me a long story"}], stream=True
        )
        received = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert received == sim.answer("long") and len(received) > 40
        events = wait_for_events(
            p.log, lambda ev: any(e["event"] == "exchange" for e in ev), timeout=30
        )
    (line,) = [e for e in events if e["event"] == "exchange"]
    assert line["scan_capped"] is True and line["output_chars"] == len(received)
    assert line["verdict"] == "clean"
