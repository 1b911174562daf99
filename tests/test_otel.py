"""OpenTelemetry export (proxy/mitm/otel.py): a real mitmdump with crosstalk in front of
the simulator, the openai SDK as the client, and a real OTLP/HTTP receiver on loopback
that decodes what arrives with the OTLP protobuf definitions. Spans, their parents (the
client's ``traceparent``), the leak events and the counters are checked, and that no
prompt or output text is in any of it."""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from conftest import TEST_KEY, run_mitmdump, run_sim, wait_for_events
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.config import ConfigError, load_text

SECRET = "GB29 NWBK 6016 1331 9268 19"
SOURCE_PROMPT = (
    f"Customer Ada Quist (ada.quist@heronmail.org) asked us to refund EUR 310 to IBAN {SECRET}."
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
MESSAGES = {
    "/v1/traces": ExportTraceServiceRequest,
    "/v1/metrics": ExportMetricsServiceRequest,
}


class Receiver:
    """An OTLP/HTTP receiver: keeps each request it is sent, decoded."""

    def __init__(self) -> None:
        self.received: list[tuple[str, object]] = []
        self.raw: list[bytes] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = MESSAGES[self.path].FromString(body)
                with outer.lock:
                    outer.received.append((self.path, message))
                    outer.raw.append(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(b"")

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def messages(self, path: str) -> list:
        """The decoded requests sent to ``path`` so far."""
        with self.lock:
            return [msg for p, msg in self.received if p == path]

    def spans(self) -> list:
        return [
            span
            for msg in self.messages("/v1/traces")
            for rs in msg.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def metric_points(self, name: str) -> list:
        return [
            point
            for msg in self.messages("/v1/metrics")
            for rm in msg.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == name
            for point in metric.sum.data_points
        ]


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    thread = threading.Thread(target=r.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()


def attrs(kvs) -> dict:
    """An OTLP attribute list as a dict of plain values."""
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which)
    return out


def wait_until(predicate, timeout: float = 60.0) -> None:
    """Until ``predicate()`` holds; the batch processor sends every few seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "nothing arrived in time"
        time.sleep(0.2)


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=30,
        default_headers={"X-Tenant-ID": tenant},
    )  # fmt: skip


def exchange(url: str, tenant: str, rid: str, content: str, **headers: str) -> str:
    """One streamed chat completion; what the client received (cut or not)."""
    text = ""
    try:
        stream = client(url, tenant).chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], stream=True,
            extra_headers={"X-Request-ID": rid, **headers},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    except openai.APIError:
        pass  # enforce mode's cut ends the stream with an error event
    return text


@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_spans_and_counters_reach_an_otlp_receiver_without_text(tmp_path: Path, mode: str):
    """enforce runs the engine on the event loop; shadow in the detector process, which
    then exports: both send one span per exchange inside the caller's trace."""
    with receiver() as otlp:
        config = tmp_path / "crosstalk.toml"
        config.write_text(
            f'[proxy]\nmode = "{mode}"\n[detection]\nkey = "{TEST_KEY}"\n'
            f'[otel]\nendpoint = "{otlp.url}"\nservice_name = "crosstalk-test"\n'
            "metrics_interval_seconds = 0.5\n"
        )
        with (
            run_sim(tmp_path, "--leak-rate", "0") as sim,
            run_mitmdump(tmp_path, sim.url, f"crosstalk_config={config}") as proxy,
        ):
            traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
            exchange(proxy.url, "tenant-a", "src-1", SOURCE_PROMPT, traceparent=traceparent)
            leaked = exchange(
                proxy.url, "tenant-b", "victim-1", "What is a database index?",
                **{"x-sim-fault": "entities"},
            )  # fmt: skip
            exchange(proxy.url, "tenant-b", "clean-1", "What is a database index?")
            wait_until(lambda: len(otlp.spans()) >= 3)
            wait_until(lambda: otlp.metric_points("crosstalk.requests"))
        spans = {attrs(s.attributes)["crosstalk.request_id"]: s for s in otlp.spans()}
        with otlp.lock:
            raw = b"".join(otlp.raw)

    assert set(spans) == {"src-1", "victim-1", "clean-1"}
    source = spans["src-1"]
    # Inside the caller's trace: its trace id, the caller's span as parent.
    assert source.trace_id.hex() == TRACE_ID and source.parent_span_id.hex() == PARENT_ID
    assert not spans["clean-1"].parent_span_id  # no traceparent: a trace of its own
    a = attrs(source.attributes)
    assert a["crosstalk.tenant"] == "tenant-a" and a["crosstalk.verdict"] == "clean"
    assert a["url.path"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert a["crosstalk.stream"] is True and a["gen_ai.request.model"] == "m"
    assert source.end_time_unix_nano > source.start_time_unix_nano
    assert source.name == "crosstalk /v1/chat/completions" and source.kind == 2  # SERVER

    victim = spans["victim-1"]
    action = "blocked" if mode == "enforce" else "logged"
    assert attrs(victim.attributes)["crosstalk.verdict"] == (
        "blocked" if mode == "enforce" else "leak"
    )
    leaks = [attrs(e.attributes) for e in victim.events if e.name == "crosstalk.leak"]
    assert leaks and all(e["crosstalk.leak.source_tenant"] == "tenant-a" for e in leaks)
    assert {e["crosstalk.leak.action"] for e in leaks} == {action}
    if mode == "enforce":
        assert SECRET not in leaked
    assert attrs(spans["clean-1"].attributes)["crosstalk.verdict"] == "clean"

    # The counters, as OTLP metrics: three requests by tenant and verdict.
    latest: dict[tuple, int] = {}
    for point in otlp.metric_points("crosstalk.requests"):
        labels = attrs(point.attributes)
        key = (labels["tenant"], labels["verdict"])
        latest[key] = max(latest.get(key, 0), point.as_int)
    assert sum(latest.values()) == 3 and latest[("tenant-a", "clean")] == 1

    # No text: neither the source's prompt nor what leaked is in anything sent.
    for needle in (SECRET, "Ada Quist", "heronmail", "database index", "refund"):
        assert needle.encode() not in raw, needle


def test_an_endpoint_that_is_not_http_is_refused():
    with pytest.raises(ConfigError, match="otel.endpoint"):
        load_text('[otel]\nendpoint = "grpc://127.0.0.1:4317"\n')


def test_a_receiver_that_is_down_costs_spans_not_traffic(tmp_path: Path):
    """Nothing listens at the endpoint: every exchange is still answered and logged."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed again before the proxy starts
    config = tmp_path / "crosstalk.toml"
    config.write_text(
        f'[proxy]\nmode = "enforce"\n[detection]\nkey = "{TEST_KEY}"\n'
        f'[otel]\nendpoint = "http://127.0.0.1:{dead}"\n'
    )
    with (
        run_sim(tmp_path, "--leak-rate", "0") as sim,
        run_mitmdump(tmp_path, sim.url, f"crosstalk_config={config}") as proxy,
    ):
        texts = [exchange(proxy.url, "tenant-a", f"r-{i}", "What is an index?") for i in range(3)]
        events = wait_for_events(
            proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= 3, timeout=30
        )
    assert all(texts)
    assert {e["verdict"] for e in events if e["event"] == "exchange"} == {"clean"}
