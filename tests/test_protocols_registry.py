"""The protocol registry, and the exchange monitor driving each API through it: a real
engine, enforce mode, streams of every format cut at every chunk size (no network)."""

from __future__ import annotations

import json

import orjson
import pytest

from proxy.engine import Engine, EngineConfig
from proxy.pipeline.exchange import BLOCK_MESSAGE, Enforcement, ExchangeMonitor
from proxy.protocols import APIS, Route, as_route, route_for
from proxy.protocols import openai as openai_api
from proxy.protocols.sse import SSEDecoder
from proxy.sim import formats

PRIVATE = (
    "Invoice 77120 for Bellwether Marine covers hull repairs at Dock 14 in Gdansk and the "
    "replacement of two Volvo Penta engines billed to Kasia Wrobel"
)
LEAD = ["Here", "is", "the", "summary", "you", "asked", "for", "about", "the", "weather", "today"]
CLEAN = ("the weather in Lisbon is mild and sunny all week long " * 4).split()

PATHS = {
    "/v1/chat/completions": Route("openai", "chat"),
    "/v1/completions": Route("openai", "completions"),
    "/v1/messages": Route("anthropic", "messages"),
    "/v1/responses": Route("responses", "responses"),
    "/generate": Route("textgen", "generate"),
    "/generate_stream": Route("textgen", "generate_stream"),
    "/v1/embeddings": None,
    "/v1/models": None,
    "/health": None,
}


@pytest.mark.parametrize(("path", "route"), PATHS.items())
def test_each_path_has_exactly_one_api(path: str, route: Route | None) -> None:
    assert route_for("POST", path) == route
    claims = [name for name, module in APIS.items() if module.route_for("POST", path)]
    assert len(claims) == (route is not None)


def test_every_api_module_has_the_interface() -> None:
    for module in APIS.values():
        for name in ("route_for", "parse_request", "parse_response", "StreamParser"):
            assert callable(getattr(module, name)), (module.__name__, name)
        for name in ("error_event", "error_body"):
            raw = getattr(module, name)("m", type="t", code="c")
            assert isinstance(raw, bytes) and b'"c"' in raw


def test_as_route_keeps_the_openai_route_names() -> None:
    assert as_route("chat") == Route("openai", "chat")
    assert as_route(Route("anthropic", "messages")) == Route("anthropic", "messages")
    route = Route("openai", "chat")
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert route.parse_request(raw) == openai_api.parse_request("chat", raw)
    assert route.error_body("m", type="t", code="c") == openai_api.error_body(
        "m", type="t", code="c"
    )
    assert route.error_event("m", type="t", code="c", parser=route.stream_parser()) == (
        openai_api.error_event("m", type="t", code="c")
    )


# --- each format through the exchange monitor ----------------------------------------------------


class _Sent:
    request_id = "b-1"
    prompt = "weather?"

    def __init__(self, answer: str) -> None:
        self.answers, self.finish = [answer], ["stop"]


def stream_of(fmt: str, words: list[str]) -> tuple[Route, bytes]:
    """A stream in ``fmt`` as the simulator writes it, one word a delta."""
    pieces = [[w if i == 0 else " " + w for i, w in enumerate(words)]]
    sent = _Sent("".join(pieces[0]))
    build = {
        "anthropic": (Route("anthropic", "messages"), formats.anthropic_events),
        "responses": (Route("responses", "responses"), formats.responses_events),
        "sglang": (Route("textgen", "generate"), formats.sglang_events),
        "tgi": (Route("textgen", "generate_stream"), formats.tgi_events),
    }
    route, events = build[fmt]
    return route, b"".join(events(sent, "id_1", 0, "m", pieces)[0])


@pytest.fixture
def engine() -> Engine:
    e = Engine(EngineConfig(key=b"k" * 32))
    e.observe_prompt("A", "a-1", PRIVATE, now=999.0).finish()
    return e


def monitor(engine: Engine, route: Route, rid: str) -> ExchangeMonitor:
    m = ExchangeMonitor(
        route=route,
        tenant="B",
        request_id=rid,
        scan=engine.observe_prompt("B", rid, "weather?", now=1000.0),
        on_findings=lambda *_: None,
        enforcement=Enforcement(holdback_words=16),
    )
    m.start_stream(None)
    return m


def feed(m: ExchangeMonitor, data: bytes, size: int) -> bytes:
    out = []
    for i in range(0, len(data), size):
        out += m.on_chunk(data[i : i + size])
    out += m.on_chunk(b"")
    assert all(isinstance(b, bytes) and b for b in out)
    return b"".join(out)


FORMATS = ("anthropic", "responses", "sglang", "tgi")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", [1, 29, 100_000])
def test_clean_streams_pass_byte_for_byte(engine, fmt, size):
    route, data = stream_of(fmt, CLEAN)
    m = monitor(engine, route, f"{fmt}-{size}")
    assert feed(m, data, size) == data
    assert m.verdict == "clean" and not m.truncated and m.output_chars > 100


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", [1, 29, 100_000])
def test_leaks_are_cut_with_the_apis_own_error_event(engine, fmt, size):
    route, data = stream_of(fmt, LEAD + PRIVATE.split() + ["and", "more", "text", "follows"])
    m = monitor(engine, route, f"{fmt}-{size}")
    out = feed(m, data, size)
    assert m.verdict == "blocked" and m.blocked_by.source_tenant == "A"
    assert b"Bellwether" not in out and b"77120" not in out
    events = SSEDecoder().feed(out)
    last = [e for e in events if e.data != "[DONE]"][-1]
    error = orjson.loads(last.data)
    if fmt == "anthropic":
        assert last.event == "error" and error["error"]["type"] == "permission_error"
        assert error["error"]["message"] == BLOCK_MESSAGE
    elif fmt == "responses":
        assert last.event == "error" and error["code"] == "cross_tenant_leak"
        numbers = [orjson.loads(e.data)["sequence_number"] for e in events[:-1]]
        assert error["sequence_number"] > max(numbers, default=-1)
    elif fmt == "tgi":
        assert error == {"error": BLOCK_MESSAGE, "error_type": "cross_tenant_leak"}
    else:
        assert error["error"]["code"] == "cross_tenant_leak" and events[-1].data == "[DONE]"
    # Before the cut event: whole events of the original stream, in order.
    marker = {
        "anthropic": b"event: error\n",
        "responses": b"event: error\n",
        "tgi": b'data:{"error"',
    }
    marker = marker.get(fmt, b'data: {"error"')
    assert data.startswith(out[: out.rfind(marker)])


@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_bodies_are_scanned(engine, fmt):
    sent = _Sent(" ".join(LEAD) + " " + PRIVATE)
    route, body = {
        "anthropic": (Route("anthropic", "messages"), formats.anthropic_body),
        "responses": (Route("responses", "responses"), formats.responses_body),
        "sglang": (Route("textgen", "generate"), formats.sglang_body),
        "tgi": (Route("textgen", "generate"), formats.tgi_body),
    }[fmt]
    m = ExchangeMonitor(
        route=route,
        tenant="B",
        request_id=f"w-{fmt}",
        scan=engine.observe_prompt("B", f"w-{fmt}", "weather?", now=1000.0),
        on_findings=lambda *_: None,
    )
    m.on_body(json.dumps(body(sent, "id_1", 0, "m")).encode())
    assert m.verdict == "leak" and m.findings[0].source_tenant == "A"
    assert m.route.error_body("x", type="leak_blocked", code="cross_tenant_leak")


def test_forensic_replay_scans_every_format():
    """crosstalk replay dispatches through the same registry: recorded exchanges of each
    format make the findings live shadow mode would have made."""
    from mitmproxy.http import Headers

    from proxy.config import Config
    from proxy.forensics.replayer import ExchangeRecord, RecordedResponse, Replayer
    from proxy.tenants import TenantRules

    found: list[tuple[str, str, str]] = []

    class Sink:
        def finding(self, monitor, finding, when, record, partial):
            found.append((monitor.request_id, finding.source_tenant, monitor.route.api))

        def detector_error(self, monitor, record):
            raise AssertionError(monitor.detector_error)

        def no_tenant(self, record):
            raise AssertionError(record.tenant_missing)

        def failure(self, position, reason):
            raise AssertionError(reason)

        def unrecorded(self, monitor, record, what):
            raise AssertionError(what)

        def degenerate(self, monitor, record, reason, choice):
            raise AssertionError(reason)

    def record(t: float, rid: str, tenant: str, path: str, body: dict, response: bytes, sse: bool):
        kind = "text/event-stream" if sse else "application/json"
        return ExchangeRecord(
            time=t,
            position=rid,
            method="POST",
            path=path,
            headers=Headers(x_tenant_id=tenant, x_request_id=rid),
            body=json.dumps(body).encode(),
            response=RecordedResponse(200, Headers(content_type=kind), response, t, t + 0.5),
            fallback_id=rid,
        )

    source = _Sent("Noted.")
    records = [
        record(
            1000.0,
            "src",
            "A",
            "/v1/messages",
            {"max_tokens": 9, "messages": [{"role": "user", "content": PRIVATE}]},
            json.dumps(formats.anthropic_body(source, "msg_1", 0, "m")).encode(),
            sse=False,
        )
    ]
    requests = {
        "anthropic": ("/v1/messages", {"max_tokens": 9, "messages": [{"role": "user", "content": "Hi"}]}),
        "responses": ("/v1/responses", {"input": "Hi"}),
        "sglang": ("/generate", {"text": "Hi", "stream": True}),
        "tgi": ("/generate_stream", {"inputs": "Hi"}),
    }  # fmt: skip
    for i, fmt in enumerate(FORMATS):
        _, data = stream_of(fmt, LEAD + PRIVATE.split())
        path, body = requests[fmt]
        records.append(record(1001.0 + i, f"v-{fmt}", "B", path, body, data, sse=True))
    engine = Engine(EngineConfig(key=b"k" * 32))
    stats = Replayer(engine, TenantRules(), Config(), Sink()).run(records)
    assert stats.exchanges == 5 and stats.unparsed == 0
    assert set(found) == {
        (f"v-{fmt}", "A", route_for("POST", requests[fmt][0]).api) for fmt in FORMATS
    }
