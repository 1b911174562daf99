"""The proxy core, for real: mitmdump + addon in front of the simulator, openai SDK clients."""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import openai
import pytest
from conftest import (
    ROOT,
    free_port,
    read_events,
    run_mitmdump,
    stop,
    wait_for_events,
    wait_for_port,
)


def client(url: str, tenant: str | None = None, **headers: str) -> openai.OpenAI:
    if tenant is not None:
        headers["X-Tenant-ID"] = tenant
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-test", default_headers=headers, max_retries=0, timeout=30
    )


def one_request(url: str, i: int) -> tuple[str, str, bool, str, bytes]:
    """Request ``i`` of the mixed load: returns (request id, tenant, stream, route, bytes)."""
    rng = random.Random(i)
    tenant = f"tenant-{i % 10}"
    rid = f"load-{i:03d}"
    stream = i % 2 == 0
    route = "chat" if i % 3 else "completions"
    c = client(url, tenant, **{"X-Request-ID": rid})
    text = f"Request {i}: summarise the {rng.choice(['Q3', 'Q4'])} plan for project {i * 7919}."
    if route == "chat":
        kwargs = dict(model="sim-llm-1", messages=[{"role": "user", "content": text}])
        api = c.chat.completions
    else:
        kwargs = dict(model="sim-llm-1", prompt=text)
        api = c.completions
    if stream:
        with api.with_streaming_response.create(stream=True, **kwargs) as resp:
            body = b"".join(resp.iter_bytes())
    else:
        body = api.with_raw_response.create(**kwargs).http_response.content
    return rid, tenant, stream, route, body


def test_concurrent_mixed_load_is_byte_identical_and_logged(proxy, sim):
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda i: one_request(proxy.url, i), range(50)))
    for rid, _, stream, _, body in results:
        assert body == sim.sent(rid), f"{rid}: client bytes differ from what the simulator sent"
        if stream:
            assert body.rstrip().endswith(b"data: [DONE]")
    rids = {r[0] for r in results}
    events = wait_for_events(
        proxy.log, lambda ev: rids <= {e.get("request_id") for e in ev if e["event"] == "exchange"}
    )
    exchanges = {e["request_id"]: e for e in events if e["event"] == "exchange"}
    for rid, tenant, stream, route, _ in results:
        e = exchanges[rid]
        assert e["tenant"] == tenant
        assert e["stream"] is stream
        assert e["status"] == 200
        assert e["verdict"] == "clean"
        assert e["path"] == ("/v1/chat/completions" if route == "chat" else "/v1/completions")
        assert e["output_chars"] > 20 and e["prompt_chars"] > 20
        assert e["duration_ms"] >= e["ttft_ms"] >= 0
        assert e["ts"].endswith("Z") and e["level"] == "info"
    assert sum(1 for e in events if e["event"] == "exchange" and e["request_id"] in rids) == 50
    raw = proxy.log.read_text()
    assert "summarise the" not in raw, "the log must never carry prompt text"


def test_sdk_sees_normal_answers_and_request_id_round_trips(proxy):
    c = client(proxy.url, "acme", **{"X-Request-ID": "rid-roundtrip"})
    raw = c.chat.completions.with_raw_response.create(
        model="sim-llm-1", messages=[{"role": "user", "content": "Hello there"}], n=2
    )
    completion = raw.parse()
    assert raw.headers["x-request-id"] == "rid-roundtrip"
    assert len(completion.choices) == 2 and completion.choices[0].message.content
    stream = client(proxy.url, "acme").chat.completions.create(
        model="sim-llm-1", messages=[{"role": "user", "content": "Hello there"}], stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == completion.choices[0].message.content


def test_generated_request_id_is_sent_upstream_and_returned(proxy):
    raw = client(proxy.url, "acme").models.with_raw_response.list()
    assert "x-request-id" not in raw.headers  # not an LLM call: untouched
    raw = client(proxy.url, "acme").chat.completions.with_raw_response.create(
        model="sim-llm-1", messages=[{"role": "user", "content": "id please"}]
    )
    rid = raw.headers["x-request-id"]
    assert rid.startswith("ct-")
    assert raw.headers["x-sim-request-id"] == rid  # the engine saw the same id


def test_tenant_from_api_key_is_pseudonymous(proxy):
    c = openai.OpenAI(
        base_url=f"{proxy.url}/v1",
        api_key="sk-secret-key-of-customer-42",
        max_retries=0,
        default_headers={"X-Request-ID": "rid-apikey"},
    )
    c.chat.completions.create(model="sim-llm-1", messages=[{"role": "user", "content": "hi"}])
    events = wait_for_events(
        proxy.log, lambda ev: any(e.get("request_id") == "rid-apikey" for e in ev)
    )
    e = next(e for e in events if e.get("request_id") == "rid-apikey" and e["event"] == "exchange")
    assert e["tenant"].startswith("key:") and len(e["tenant"]) == 16
    assert "sk-secret-key-of-customer-42" not in proxy.log.read_text()


def test_non_llm_paths_pass_untouched(proxy, sim):
    models = client(proxy.url).models.list()
    assert [m.id for m in models.data] == ["sim-llm-1"]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("GET", "/version")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"version": "0.10.2"}


def raw_post(port: int, path: str, body: bytes, **headers: str) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def test_malformed_json_request_passes_through_and_is_logged(proxy):
    status, _, body = raw_post(
        proxy.port,
        "/v1/chat/completions",
        b"{not json",
        **{"X-Tenant-ID": "t1", "X-Request-ID": "rid-badjson"},
    )
    assert status == 400 and b"not valid JSON" in body  # the engine's own answer
    events = wait_for_events(
        proxy.log,
        lambda ev: any(
            e.get("request_id") == "rid-badjson" and e["event"] == "exchange" for e in ev
        ),
    )
    mine = [e for e in events if e.get("request_id") == "rid-badjson"]
    assert {e["event"] for e in mine} >= {"request.unparsed", "exchange"}


def test_non_json_response_fails_open(proxy, sim):
    status, _, body = raw_post(
        proxy.port,
        "/v1/chat/completions",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode(),
        **{"X-Tenant-ID": "t1", "X-Request-ID": "rid-nonjson", "x-sim-misbehave": "nonjson"},
    )
    assert status == 200 and body == b"oops not json"
    events = wait_for_events(
        proxy.log,
        lambda ev: any(
            e.get("request_id") == "rid-nonjson" and e["event"] == "exchange" for e in ev
        ),
    )
    errors = [
        e for e in events if e["event"] == "detector.error" and e["request_id"] == "rid-nonjson"
    ]
    assert errors and errors[0]["action"] == "failed_open"


def test_the_log_quotes_neither_an_undecodable_body_nor_a_query(proxy, sim):
    """A body in no encoding its header names passes unchanged and fails open; the log
    says why without the codec's message (which quotes the whole body), and a path is
    logged without its query string (which can carry a key)."""
    rid = "rid-mislabelled"
    prompt = "Quote the Halvorsen escrow clause for account 5512-0087 word for word."
    status, headers, data = raw_post(
        proxy.port,
        "/v1/chat/completions?api_key=sk-query-secret-8842",
        json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode(),
        **{"X-Tenant-ID": "t-priv", "X-Request-ID": rid, "x-sim-misbehave": "mislabelled"},
    )
    assert status == 200 and headers.get("content-encoding") == "utf-16"
    assert data == sim.sent(rid)
    events = wait_for_events(
        proxy.log,
        lambda ev: any(e.get("request_id") == rid and e["event"] == "exchange" for e in ev),
    )
    mine = [e for e in events if e.get("request_id") == rid]
    errors = [e for e in mine if e["event"] == "detector.error"]
    reason = errors[0]["reason"] if errors else ""
    assert reason.startswith("body not decodable (content-encoding 'utf-16'): ValueError at ")
    assert reason.endswith(")") and "(from mitm/placement.py:" in reason, reason
    assert errors[0]["action"] == "failed_open"
    assert [e["path"] for e in mine if e["event"] == "exchange"] == ["/v1/chat/completions"]
    answer = json.loads(data)["choices"][0]["message"]["content"]
    log = proxy.log.read_text()
    assert answer[:24] not in log and "sk-query-secret" not in log and "Halvorsen" not in log


def test_gzip_response_reaches_client_unchanged_and_detector_sees_plaintext(proxy, sim):
    # Tenant A's private prompt, then a response to tenant B that leaks a page of it,
    # gzip-compressed by the engine: the detector must still find it.
    a = client(proxy.url, "gz-a", **{"X-Request-ID": "rid-gz-a"})
    a.chat.completions.create(
        model="sim-llm-1",
        messages=[
            {
                "role": "user",
                "content": (
                    "Invoice 77120 for Bellwether Marine covers hull repairs at Dock 14 in Gdansk "
                    "and the replacement of two Volvo Penta engines, billed to Kasia Wrobel."
                ),
            }
        ],
    )
    for stream in (False, True):
        rid = f"rid-gz-b-{stream}"
        body = json.dumps(
            {
                "model": "m",
                "stream": stream,
                "messages": [{"role": "user", "content": "Tell me a fun fact."}],
            }
        )
        status, headers, data = raw_post(
            proxy.port,
            "/v1/chat/completions",
            body.encode(),
            **{
                "X-Tenant-ID": "gz-b",
                "X-Request-ID": rid,
                "x-sim-misbehave": "gzip",
                "x-sim-fault": "prompt_page",
                "x-sim-fault-source": "rid-gz-a",
                "x-sim-fault-words": "16",
                "Accept-Encoding": "gzip",
            },
        )
        assert status == 200 and headers.get("content-encoding") == "gzip"
        assert data == sim.sent(rid)
        events = wait_for_events(
            proxy.log,
            lambda ev, rid=rid: any(
                e.get("request_id") == rid and e["event"] == "exchange" for e in ev
            ),
        )
        leaks = [e for e in events if e["event"] == "leak.detected" and e["request_id"] == rid]
        truth = [json.loads(line) for line in sim.truth.read_text().splitlines()]
        fault = next(t for t in truth if t["request_id"] == rid)
        assert fault["source_tenant"] == "gz-a" and fault["leaked_words"] == 16, fault
        assert leaks and leaks[0]["source_tenant"] == "gz-a", (rid, leaks)


def test_error_event_and_truncated_stream_are_logged(proxy):
    c = client(
        proxy.url, "t-err", **{"X-Request-ID": "rid-errevent", "x-sim-misbehave": "error-event"}
    )
    with pytest.raises(openai.APIError):
        for _ in c.chat.completions.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass
    c = client(proxy.url, "t-err", **{"X-Request-ID": "rid-trunc", "x-sim-misbehave": "truncate"})
    with pytest.raises(openai.APIConnectionError):  # the body ended mid-chunk
        for _ in c.chat.completions.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "y"}], stream=True
        ):
            pass
    events = wait_for_events(
        proxy.log,
        lambda ev: (
            {"rid-errevent", "rid-trunc"}
            <= {e.get("request_id") for e in ev if e["event"] == "exchange"}
        ),
    )
    ex = {e["request_id"]: e for e in events if e["event"] == "exchange"}
    assert ex["rid-errevent"]["upstream_error"] == "engine overloaded"
    assert ex["rid-trunc"].get("truncated") or ex["rid-trunc"].get("error")
    # and everyone else is still served
    assert (
        client(proxy.url, "t-ok")
        .chat.completions.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "still there?"}]
        )
        .choices[0]
        .message.content
    )


def test_client_disconnect_mid_stream_keeps_proxy_serving(proxy):
    body = json.dumps(
        {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "long answer please"}],
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Tenant-ID: t-dc\r\nX-Request-ID: rid-disconnect\r\nx-sim-misbehave: slow\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    events = wait_for_events(
        proxy.log,
        lambda ev: any(
            e.get("request_id") == "rid-disconnect" and e["event"] == "exchange" for e in ev
        ),
    )
    e = next(
        e for e in events if e.get("request_id") == "rid-disconnect" and e["event"] == "exchange"
    )
    assert "disconnect" in e.get("error", "").lower()
    assert client(proxy.url, "t-ok").completions.create(model="sim-llm-1", prompt="ok?").choices


def test_upstream_down_gives_openai_format_502(tmp_path):
    with run_mitmdump(tmp_path, f"http://127.0.0.1:{free_port()}") as proxy:
        with pytest.raises(openai.InternalServerError) as info:
            client(proxy.url, "t1").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "anyone?"}]
            )
        assert info.value.status_code == 502
        assert info.value.body["code"] == "proxy_502"
        assert "crosstalk proxy" in info.value.body["message"]
        events = wait_for_events(proxy.log, lambda ev: any(e["event"] == "exchange" for e in ev))
        assert [e["status"] for e in events if e["event"] == "exchange"] == [502]


def test_a_request_while_the_detector_starts_neither_fails_nor_stops_mitmdump(tmp_path, sim):
    """mitmproxy listens before its addons' ``running`` hooks, and mitmdump exits on any
    error logged before they return. The detector process takes a second or more to
    start: a request in that second (a restart under load) must be answered, scanned
    once the detector is up, and leave mitmdump running. Started as users do (no
    ``--set confdir``): then mitmproxy's TLS addon sets its certificate store up in its
    own ``running`` hook, after crosstalk's; a request that met it unready made it log an
    error, and mitmdump exited."""
    with run_mitmdump(tmp_path, sim.url, as_users_do=True) as proxy:
        sent_at = time.time()
        first = client(proxy.url, "t1").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "anyone home?"}]
        )
        assert first.choices[0].message.content
        events = wait_for_events(
            proxy.log,
            lambda ev: {"detector.ready", "exchange"} <= {e["event"] for e in ev},
            timeout=60,
        )
        ready = next(e for e in events if e["event"] == "detector.ready")
        ready_at = datetime.fromisoformat(ready["ts"].replace("Z", "+00:00")).timestamp()
        assert sent_at < ready_at  # the request came while the detector was starting
        second = client(proxy.url, "t1").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "still there?"}]
        )
        assert second.choices[0].message.content and proxy.proc.poll() is None
    assert not [e for e in read_events(proxy.log) if e["event"] == "addon.failed"]


BROKEN_ADDON = """
class Broken:
    def responseheaders(self, flow):
        raise RuntimeError("a bug, with a prompt in its message: Project Marlowe")


addons = [Broken()]
"""


def test_an_addon_that_raises_is_in_crosstalks_log_and_traffic_flows(tmp_path, sim):
    """A hook that raises: mitmproxy logs it to its own log and passes the flow on. The
    operator reading crosstalk's log sees ``addon.failed`` (type, hook, file and line,
    never the message, which may quote a prompt), and the client gets its answer."""
    script = tmp_path / "broken.py"
    script.write_text(BROKEN_ADDON)
    with run_mitmdump(tmp_path, sim.url, scripts=[script]) as proxy:
        answer = client(proxy.url, "t1").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "still there?"}]
        )
        assert answer.choices[0].message.content
        events = wait_for_events(
            proxy.log, lambda ev: any(e["event"] == "addon.failed" for e in ev)
        )
    (failed,) = [e for e in events if e["event"] == "addon.failed"]
    assert failed["error"] == "RuntimeError" and failed["hook"] == "responseheaders"
    assert failed["addon"] == "broken.py" and failed["where"].startswith("broken.py:")
    assert failed["action"] == "failed_open"
    assert "Marlowe" not in proxy.log.read_text()


class PipeReader:
    """Reads a child's text pipe to its end in a thread: a test can wait for a line
    without blocking on the pipe, and has the whole output once the child exited."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether a line holds ``text`` before the pipe ends or ``timeout`` s pass."""
        with self._changed:
            return self._changed.wait_for(
                lambda: any(text in line for line in self.lines) or self._ended, timeout
            ) and any(text in line for line in self.lines)

    def so_far(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def text(self, timeout: float = 10.0) -> str:
        """Everything read: the pipe must end within ``timeout`` s (after the child
        exited; a grandchild that kept the pipe open would fail the test here)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the pipe is still open"
        return self.so_far()


def test_crosstalk_run_with_builtin_simulator_stops_cleanly_on_sigterm(tmp_path):
    port, log = free_port(), tmp_path / "run.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "run",
            "--listen-port",
            str(port),
            "--log-file",
            str(log),
            "--sim-token-delay",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = PipeReader(proc.stdout), PipeReader(proc.stderr)  # neither fills up
    try:
        wait_for_port(port, proc)
        answer = client(f"http://127.0.0.1:{port}", "acme").chat.completions.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "Hello!"}]
        )
        assert answer.choices[0].message.content
        # The banner waits for the detector process, which a loaded machine started
        # after the port opened and the answer came (a stop then left no banner).
        assert stdout.wait_for("crosstalk is running", timeout=120), stderr.so_far()[-2000:]
    finally:
        code = stop(proc)
    out, err = stdout.text(), stderr.text()
    assert code == 0, err
    assert "crosstalk is running (shadow mode)" in out, (out, err[-2000:])
    assert "curl" in out and "openai" in out
    events = read_events(log)
    assert [e["tenant"] for e in events if e["event"] == "exchange"] == ["acme"]


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[proxy]\nmode = "loud"\n')
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "run", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "proxy.mode must be one of" in result.stderr


def test_a_port_in_use_is_a_clear_error(tmp_path, sim):
    """mitmproxy alone says only "Error logged during startup, exiting...": the operator
    must read which error (here: the listening port is taken)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "proxy", "run", "--listen-port", str(port),
             "--upstream", sim.url, "--log-file", str(tmp_path / "events.jsonl")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "address already in use" in result.stderr


def test_reject_unknown_tenant(tmp_path, sim):
    cfg = tmp_path / "reject.toml"
    cfg.write_text('[tenants]\nunknown = "reject"\nsources = ["header"]\n')
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as proxy:
        with pytest.raises(openai.BadRequestError) as info:
            client(proxy.url).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "who am I?"}]
            )
        assert info.value.body["code"] == "tenant_required"
        assert (
            client(proxy.url, "known")
            .chat.completions.create(model="m", messages=[{"role": "user", "content": "ok"}])
            .choices
        )


def test_http2_client_over_tls(proxy, sim):
    """The openai SDK over HTTP/2 (TLS with mitmproxy's own certificate, verification off
    in the test): streamed and whole responses arrive intact and are logged."""
    import httpx2

    with httpx2.Client(http2=True, verify=False) as http:
        c = openai.OpenAI(
            base_url=f"https://127.0.0.1:{proxy.port}/v1", api_key="sk-test", max_retries=0,
            default_headers={"X-Tenant-ID": "h2-tenant", "X-Request-ID": "rid-h2"},
            http_client=http,
        )  # fmt: skip
        raw = c.chat.completions.with_raw_response.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "over h2"}]
        )
        assert raw.http_response.http_version == "HTTP/2"
        assert raw.http_response.content == sim.sent("rid-h2")
        stream = c.chat.completions.create(
            model="sim-llm-1", messages=[{"role": "user", "content": "over h2"}], stream=True,
            extra_headers={"X-Request-ID": "rid-h2-stream"},
        )  # fmt: skip
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == raw.parse().choices[0].message.content
    events = wait_for_events(proxy.log, lambda ev: {"rid-h2", "rid-h2-stream"} <= {
        e.get("request_id") for e in ev if e["event"] == "exchange"})  # fmt: skip
    tenants = {e["tenant"] for e in events if e.get("request_id", "").startswith("rid-h2")}
    assert tenants == {"h2-tenant"}
