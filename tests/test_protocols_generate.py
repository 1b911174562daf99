"""Tests for proxy.protocols.generate: SGLang /generate (cumulative or incremental streams),
TGI /generate and /generate_stream, vLLM's demo /generate."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.protocols import Route, route_for
from proxy.protocols.generate import (
    StreamParser,
    error_body,
    error_event,
    parse_request,
    parse_response,
    tgi_error_event,
)
from proxy.protocols.generate import route_for as textgen_route
from proxy.protocols.openai import OutputDelta, ProtocolError
from proxy.protocols.sse import SSEDecoder, SSEEvent
from proxy.sim import formats


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def data(obj: Any) -> SSEEvent:
    return SSEEvent(obj if isinstance(obj, str) else json.dumps(obj))


def texts(deltas: list[OutputDelta]) -> dict[int, str]:
    out: dict[int, str] = {}
    for d in deltas:
        out[d.choice] = out.get(d.choice, "") + d.text
    return out


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/generate", "generate"),
        ("PUT", "/generate", "generate"),  # SGLang accepts PUT too
        ("POST", "/sglang/generate?x=1", "generate"),
        ("POST", "/generate_stream", "generate_stream"),
        ("POST", "/generate_stream/", "generate_stream"),
        ("PUT", "/generate_stream", None),
        ("GET", "/generate", None),
        ("POST", "/api/generate", None),  # Ollama: another format
        ("POST", "/generate_from_file", None),
    ],
)
def test_route_for(method: str, path: str, kind: str | None) -> None:
    assert textgen_route(method, path) == kind
    assert route_for(method, path) == (Route("textgen", kind) if kind else None)


# --- requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "request_body", "prompt", "stream", "n"),
    [
        ("generate", {"text": "Capital of France?", "stream": True}, "Capital of France?", True, 1),
        ("generate", {"text": ["One?", "", "Two?"], "sampling_params": {"n": 2}}, "One?\nTwo?", False, 6),
        ("generate", {"input_ids": [1, 2, 3]}, "", False, 1),
        ("generate", {"inputs": "TGI prompt", "parameters": {"max_new_tokens": 5}}, "TGI prompt", False, 1),
        ("generate_stream", {"inputs": "TGI prompt"}, "TGI prompt", True, 1),
        ("generate", {"prompt": "vLLM prompt", "stream": False, "n": 2}, "vLLM prompt", False, 1),
    ],
)  # fmt: skip
def test_requests_of_each_engine(kind, request_body, prompt, stream, n) -> None:
    parsed = parse_request(kind, body(request_body))
    assert (parsed.prompt, parsed.model_text, parsed.stream, parsed.n, parsed.user) == (
        prompt,
        "",
        stream,
        n,
        None,
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"x",
        body([1]),
        body({"model": "m"}),  # nothing to generate from
        body({"text": 5}),
        body({"text": ["a", 5]}),
        body({"inputs": ["a"]}),
        body({"prompt": 3}),
        body({"text": "a", "stream": 1}),
    ],
)
def test_malformed_requests_raise_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_request("generate", raw)


# --- whole responses --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (body({"generated_text": "TGI says hi", "details": None}), {0: "TGI says hi"}),
        (body([{"generated_text": "compat route"}]), {0: "compat route"}),
        (body({"text": "SGLang says hi", "output_ids": [1], "meta_info": {}}), {0: "SGLang says hi"}),
        (body([{"text": "a", "index": 1}, {"text": "b", "index": 0}]), {1: "a", 0: "b"}),
        (body([{"text": "first"}, {"text": "second"}]), {0: "first", 1: "second"}),
        (body({"text": ["Q?A one", "Q?A two"]}), {0: "Q?A one", 1: "Q?A two"}),
        # vLLM's streamed JSON lines, buffered whole: the last line is the whole text.
        (b'{"text": ["Q?A"]}\n{"text": ["Q?A b"]}\n{"text": ["Q?A b c"]}\n', {0: "Q?A b c"}),
    ],
)  # fmt: skip
def test_parse_response_of_each_engine(raw: bytes, expected: dict[int, str]) -> None:
    assert texts(parse_response("generate", raw)) == expected


@pytest.mark.parametrize(
    "raw",
    [
        body({"error": {"message": "bad"}}),  # SGLang
        body({"error": "Input validation error", "error_type": "validation"}),  # TGI
        body({"object": "error", "message": "x"}),
        body([{"text": 1}]),
        body({"text": ["a", 1]}),
        body(["x"]),
        b"not json",
        b"not json\nnor this",
    ],
)
def test_parse_response_rejects_errors_and_other_shapes(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_response("generate", raw)


# --- SGLang streams ----------------------------------------------------------------------------


def sglang_stream(pieces: list[str], *, incremental: bool, hints: bool) -> list[SSEEvent]:
    events, sent = [], ""
    for step, piece in enumerate(pieces):
        sent += piece
        out: dict[str, Any] = {"text": piece if incremental else sent}
        if hints:
            ids = list(range(step + 1))
            out["output_ids"] = ids[-1:] if incremental else ids
            out["meta_info"] = {"completion_tokens": step + 1, "finish_reason": None}
        events.append(data(out))
    return [*events, data("[DONE]")]


def feed(parser: StreamParser, events: list[SSEEvent]) -> dict[int, str]:
    return texts([d for e in events for d in parser.feed(e)])


pieces_strategy = st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=25)


@given(pieces_strategy, st.booleans())
@settings(max_examples=300)
def test_sglang_stream_with_the_engines_hints_is_exact_in_either_mode(pieces, incremental):
    parser = StreamParser()
    got = feed(parser, sglang_stream(pieces, incremental=incremental, hints=True))
    assert got.get(0, "") == "".join(pieces)
    assert parser.done and parser.malformed_events == 0


@given(pieces_strategy)
@settings(max_examples=300)
def test_sglang_cumulative_stream_without_hints_is_exact(pieces):
    assert feed(StreamParser(), sglang_stream(pieces, incremental=False, hints=False)).get(
        0, ""
    ) == "".join(pieces)


@given(pieces_strategy)
@settings(max_examples=300)
def test_sglang_incremental_stream_without_hints(pieces):
    """Exact unless the second non-empty piece starts with the whole first one (then the
    stream looks cumulative): each later piece is still fed, less any prefix it shares
    with the one before it."""
    got = feed(StreamParser(), sglang_stream(pieces, incremental=True, hints=False)).get(0, "")
    nonempty = [p for p in pieces if p]
    if len(nonempty) < 2 or not nonempty[1].startswith(nonempty[0]):
        assert got == "".join(pieces)
    else:
        assert len(got) <= len("".join(pieces))
        assert got.startswith(nonempty[0])


def test_sglang_cumulative_rewrite_feeds_the_changed_tail() -> None:
    parser = StreamParser()
    events = [data({"text": t}) for t in ("Caf", "Caf\ufffd", "Café au", "Café au lait")]
    assert feed(parser, events) == {0: "Caf\ufffdé au lait"}


def test_sglang_batch_streams_interleave_by_index_and_errors_are_kept() -> None:
    parser = StreamParser()
    events = [
        data({"text": "A", "index": 0}),
        data({"text": "B", "index": 1}),
        data({"text": "A a", "index": 0, "meta_info": {"finish_reason": {"type": "stop"}}}),
        data({"text": "B b", "index": 1, "meta_info": {"finish_reason": {"type": "length"}}}),
        data({"error": {"message": "engine overloaded"}}),
        data("[DONE]"),
    ]
    assert feed(parser, events) == {0: "A a", 1: "B b"}
    assert parser.finish_reasons == {0: "stop", 1: "length"}
    assert parser.error == {"message": "engine overloaded"} and parser.done


# --- TGI streams -------------------------------------------------------------------------------


def tgi_token(k: int, text: str, *, special: bool = False, final: str | None = None) -> SSEEvent:
    return data(
        {
            "index": k,
            "token": {"id": k, "text": text, "logprob": -0.1, "special": special},
            "generated_text": final,
            "details": None,
            "top_tokens": None,
        }
    )


def test_tgi_stream_feeds_tokens_not_specials_nor_the_final_repeat() -> None:
    parser = StreamParser("generate_stream")
    events = [
        tgi_token(1, "Hello"),
        tgi_token(2, " world"),
        tgi_token(3, "</s>", special=True, final="Hello world"),
    ]
    assert feed(parser, events) == {0: "Hello world"}
    assert parser.done and parser.error is None


def test_tgi_error_event() -> None:
    parser = StreamParser("generate_stream")
    parser.feed(tgi_token(1, "Hel"))
    parser.feed(
        data({"error": "Request failed during generation: boom", "error_type": "generation"})
    )
    assert parser.error == {
        "message": "Request failed during generation: boom",
        "type": "generation",
    }
    assert not parser.done


@pytest.mark.parametrize(
    "raw", ["{", "[1]", json.dumps({"meta_info": {}}), json.dumps({"text": 3})]
)
def test_malformed_events_are_counted(raw: str) -> None:
    parser = StreamParser()
    assert parser.feed(data(raw)) == []
    assert parser.malformed_events == 1


# --- the simulator's streams, cut anywhere ------------------------------------------------------


class _Sent:
    request_id = "r1"
    prompt = "Tell me about the harbour."

    def __init__(self, answers: list[str], finish: str = "stop") -> None:
        self.answers, self.finish = answers, [finish] * len(answers)


def decode_cut(raw: bytes, cuts: list[int], parser: StreamParser) -> dict[int, str]:
    decoder, out = SSEDecoder(), []
    for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        out += [d for e in decoder.feed(raw[a:b]) for d in parser.feed(e)]
    return texts(out)


@given(
    st.lists(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=15), min_size=1, max_size=3),
    st.sampled_from(["sglang", "sglang-incremental", "tgi"]),
    st.sampled_from(["stop", "length"]),
    st.data(),
)  # fmt: skip
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_simulator_streams_cut_anywhere_give_back_the_answers(pieces, engine, finish, draw):
    if engine == "tgi":
        pieces = pieces[:1]  # TGI streams one sequence
    sent = _Sent(["".join(p) for p in pieces], finish)
    if engine == "tgi":
        events, _ = formats.tgi_events(sent, "", 0, "m", pieces)
    else:
        incremental = engine == "sglang-incremental"
        events, _ = formats.sglang_events(sent, "", 0, "m", pieces, incremental=incremental)
    raw = b"".join(events)
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    parser = StreamParser()
    assert decode_cut(raw, cuts, parser) == dict(enumerate(sent.answers))
    assert parser.done and parser.malformed_events == 0


def test_simulator_whole_bodies_parse_back() -> None:
    sent = _Sent(["Hello there."])
    for build in (formats.sglang_body, formats.tgi_body):
        raw = json.dumps(build(sent, "", 0, "m")).encode()
        assert texts(parse_response("generate", raw)) == {0: "Hello there."}
    two = _Sent(["One.", "Two."])
    raw = json.dumps(formats.sglang_body(two, "", 0, "m")).encode()
    assert texts(parse_response("generate", raw)) == {0: "One.", 1: "Two."}
    raw = json.dumps(formats.vllm_body(two, "", 0, "m")).encode()
    assert texts(parse_response("generate", raw)) == {
        0: sent.prompt + "One.",
        1: sent.prompt + "Two.",
    }


# --- the error format -------------------------------------------------------------------------


def test_error_body_and_event() -> None:
    assert orjson.loads(error_body("stopped", type="leak_blocked", code="cross_tenant_leak")) == {
        "error": {
            "message": "stopped",
            "type": "leak_blocked",
            "param": None,
            "code": "cross_tenant_leak",
        }
    }
    events = SSEDecoder().feed(
        error_event("stopped", type="leak_blocked", code="cross_tenant_leak")
    )
    assert [e.data for e in events][1] == "[DONE]"
    parser = StreamParser()
    for e in events:
        parser.feed(e)
    assert parser.error["message"] == "stopped" and parser.done


def test_cut_events_are_the_engines_own() -> None:
    tgi = StreamParser("generate_stream").error_event("stopped", type="t", code="cross_tenant_leak")
    assert tgi == tgi_error_event("stopped", code="cross_tenant_leak")
    (event,) = SSEDecoder().feed(tgi)
    assert json.loads(event.data) == {"error": "stopped", "error_type": "cross_tenant_leak"}
    parser = StreamParser("generate_stream")
    parser.feed(event)
    assert parser.error == {"message": "stopped", "type": "cross_tenant_leak"}
    sglang = StreamParser("generate").error_event("stopped", type="t", code="c")
    assert sglang == error_event("stopped", type="t", code="c")
