"""Tests for proxy.protocols.anthropic: Messages requests, streamed and whole responses, the
error format, and the x-api-key tenant source."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.protocols import Route, route_for
from proxy.protocols.anthropic import (
    StreamParser,
    error_body,
    error_event,
    parse_request,
    parse_response,
)
from proxy.protocols.anthropic import route_for as anthropic_route
from proxy.protocols.openai import OutputDelta, ProtocolError
from proxy.protocols.sse import SSEDecoder, SSEEvent
from proxy.sim import formats
from proxy.tenants import TenantRules, api_key_of, resolve_tenant

STREAM_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def ev(kind: str, **fields: Any) -> SSEEvent:
    return SSEEvent(json.dumps({"type": kind, **fields}), event=kind)


def text_of(deltas: list[OutputDelta]) -> str:
    assert all(d.choice == 0 for d in deltas)
    return "".join(d.text for d in deltas)


# --- routes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/v1/messages", "messages"),
        ("post", "/v1/messages?beta=true", "messages"),
        ("POST", "/anthropic/v1/messages/", "messages"),
        ("GET", "/v1/messages", None),
        ("POST", "/v1/messages/count_tokens", None),
        ("POST", "/v1/messages/batches", None),
        ("POST", "/v1/threads/thread_1/messages", None),  # OpenAI Assistants: no generation
        ("POST", "/messages", None),
    ],
)
def test_route_for(method: str, path: str, kind: str | None) -> None:
    assert anthropic_route(method, path) == kind
    expected = Route("anthropic", kind) if kind else None
    assert route_for(method, path) == expected


# --- requests -------------------------------------------------------------------------------


def test_request_prompt_covers_system_and_every_block_kind_in_order() -> None:
    request = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are the Acme helpdesk."}],
        "metadata": {"user_id": "user-42"},
        "stream": True,
        "messages": [
            {"role": "user", "content": "What is the status of order 7731?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look the order up.", "signature": "c2ln"},
                    {"type": "redacted_thinking", "data": "b3BhcXVl"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "t1", "name": "orders", "input": {"id": 7731}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "Order 7731 shipped Monday."}],
                    },
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
                    {
                        "type": "document",
                        "source": {"type": "text", "media_type": "text/plain", "data": "Refund policy: 30 days."},
                        "context": "Acme terms",
                    },
                    {"type": "search_result", "source": "kb", "title": "FAQ",
                     "content": [{"type": "text", "text": "Returns are free."}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "plain result"},
                ],
            },
        ],
    }  # fmt: skip
    parsed = parse_request("messages", body(request))
    assert parsed.prompt.split("\n") == [
        "You are the Acme helpdesk.",
        "What is the status of order 7731?",
        "Look the order up.",
        "Let me check.",
        '{"id":7731}',
        "Order 7731 shipped Monday.",
        "Acme terms",
        "Refund policy: 30 days.",
        "Returns are free.",
        "plain result",
    ]
    assert parsed.model_text == 'Look the order up.\nLet me check.\n{"id":7731}'
    assert (parsed.stream, parsed.model, parsed.user, parsed.n) == (
        True,
        "claude-sonnet-4-5",
        "user-42",
        1,
    )


def test_request_with_string_system_and_no_optional_fields() -> None:
    parsed = parse_request(
        "messages", body({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]})
    )
    assert (parsed.prompt, parsed.model_text, parsed.stream, parsed.user) == (
        "Be brief.\nHi",
        "",
        False,
        None,
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        body({"model": "m"}),  # no messages
        body({"messages": "hi"}),
        body({"messages": ["hi"]}),
        body({"messages": [{"role": "user", "content": 7}]}),
        body({"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}),
        body({"messages": [{"role": "user", "content": ["bare string block"]}]}),
        body({"messages": [], "system": 3}),
        body({"messages": [], "stream": "yes"}),
        body({"messages": [], "metadata": "u"}),
        body({"messages": [], "metadata": {"user_id": 5}}),
    ],
)
def test_malformed_requests_raise_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_request("messages", raw)


# --- whole responses --------------------------------------------------------------------------

MESSAGE = {
    "id": "msg_01",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [
        {"type": "thinking", "thinking": "The user wants a summary.", "signature": "c2ln"},
        {"type": "text", "text": "Here is the summary.", "citations": None},
        {"type": "tool_use", "id": "t1", "name": "save", "input": {"title": "Q3 plan"}},
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"input_tokens": 10, "output_tokens": 20},
}


def test_parse_response_joins_model_written_blocks() -> None:
    Message.model_validate(MESSAGE)  # the shape the SDK reads
    assert parse_response("messages", body(MESSAGE)) == [
        OutputDelta(0, 'The user wants a summary.\nHere is the summary.\n{"title":"Q3 plan"}')
    ]
    assert parse_response("messages", body({**MESSAGE, "content": []})) == [OutputDelta(0, "")]


@pytest.mark.parametrize(
    "raw",
    [
        body({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
        body({"type": "message"}),
        body({**MESSAGE, "content": [{"type": "text", "text": 1}]}),
        b"{",
    ],
)
def test_parse_response_rejects_errors_and_wrong_shapes(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_response("messages", raw)


# --- streams --------------------------------------------------------------------------------

STREAM = [
    ev("message_start", message={**MESSAGE, "content": [], "stop_reason": None}),
    ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
    ev("ping"),
    ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "The user "}),
    ev("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "wants a summary."}),
    ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "c2ln"}),
    ev("content_block_stop", index=0),
    ev("content_block_start", index=1, content_block={"type": "text", "text": ""}),
    ev("content_block_delta", index=1, delta={"type": "text_delta", "text": "Here is "}),
    ev("content_block_delta", index=1, delta={"type": "citations_delta", "citation": {
        "type": "char_location", "cited_text": "x", "document_index": 0, "document_title": None,
        "start_char_index": 0, "end_char_index": 1}}),
    ev("content_block_delta", index=1, delta={"type": "text_delta", "text": "the summary."}),
    ev("content_block_stop", index=1),
    ev("content_block_start", index=2, content_block={"type": "tool_use", "id": "t1", "name": "save", "input": {}}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": ""}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": '{"title": '}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": '"Q3 plan"}'}),
    ev("content_block_stop", index=2),
    ev("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None}, usage={"output_tokens": 20}),
    ev("message_stop"),
]  # fmt: skip


def test_stream_yields_every_model_written_delta_with_block_separators() -> None:
    for e in STREAM:
        if e.event != "ping":  # the SDK skips pings; the rest are its event types
            STREAM_EVENTS.validate_json(e.data)
    parser = StreamParser()
    out = [d for e in STREAM for d in parser.feed(e)]
    assert text_of(out) == 'The user wants a summary.\nHere is the summary.\n{"title": "Q3 plan"}'
    assert (parser.model, parser.stop_reason, parser.done, parser.error) == (
        "claude-sonnet-4-5",
        "tool_use",
        True,
        None,
    )
    assert parser.malformed_events == 0


def test_stream_error_event_and_truncation() -> None:
    parser = StreamParser()
    out = [d for e in STREAM[:9] for d in parser.feed(e)]
    out += parser.feed(ev("error", error={"type": "overloaded_error", "message": "Overloaded"}))
    assert text_of(out) == "The user wants a summary.\nHere is "
    assert parser.error == {"type": "overloaded_error", "message": "Overloaded"}
    assert not parser.done


def test_stream_type_comes_from_data_or_event_line_and_unknown_events_are_ignored() -> None:
    parser = StreamParser()
    # Without "type" in the data the event line names it.
    delta = {"index": 0, "delta": {"type": "text_delta", "text": "hi"}}
    assert text_of(parser.feed(SSEEvent(json.dumps(delta), event="content_block_delta"))) == "hi"
    assert parser.feed(ev("future_event_type", payload=1)) == []
    assert parser.feed(SSEEvent("", event="ping")) == []
    assert parser.malformed_events == 0


@pytest.mark.parametrize(
    "data",
    [
        "not json",
        "[]",
        json.dumps({"type": "content_block_delta", "index": 0, "delta": "x"}),
        json.dumps({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}}),
        json.dumps({"type": "content_block_start", "index": 0, "content_block": None}),
    ],
)  # fmt: skip
def test_malformed_events_are_counted_not_raised(data: str) -> None:
    parser = StreamParser()
    assert parser.feed(SSEEvent(data)) == []
    assert parser.malformed_events == 1


class _Sent:
    request_id = "r1"
    prompt = "Tell me about the harbour."
    finish = ("stop",)

    def __init__(self, answer: str) -> None:
        self.answers = (answer,)


@given(
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=30),
    st.data(),
)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_simulator_stream_cut_anywhere_gives_back_the_answer(pieces: list[str], data) -> None:
    """The simulator's Anthropic stream, split into arbitrary chunks, decodes to exactly
    the answer it was generated from: the detector sees what the client sees."""
    answer = "".join(pieces)
    events, lead = formats.anthropic_events(_Sent(answer), "msg_1", 0, "m", [pieces])
    raw = b"".join(events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    decoder, parser, out = SSEDecoder(), StreamParser(), []
    for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        out += [d for e in decoder.feed(raw[a:b]) for d in parser.feed(e)]
    assert text_of(out) == answer
    assert parser.done and parser.malformed_events == 0 and lead == 3


def test_simulator_events_are_valid_sdk_events() -> None:
    events, _ = formats.anthropic_events(
        _Sent("Hello there."), "msg_1", 0, "m", [["Hello", " there."]]
    )
    for e in SSEDecoder().feed(b"".join(events)):
        if e.event != "ping":
            assert STREAM_EVENTS.validate_json(e.data).type == e.event
    Message.model_validate(formats.anthropic_body(_Sent("Hello."), "msg_1", 0, "m"))


# --- the error format -------------------------------------------------------------------------


def test_error_body_and_event_are_anthropic_errors() -> None:
    raw = error_body("stopped", type="leak_blocked", code="cross_tenant_leak")
    assert orjson.loads(raw) == {
        "type": "error",
        "error": {"type": "permission_error", "message": "stopped", "code": "cross_tenant_leak"},
    }
    ErrorResponse.model_validate_json(raw)  # Anthropic's error types are a closed set
    for code, kind in [
        ("detector_failed", "api_error"),
        ("tenant_required", "authentication_error"),
        ("other", "api_error"),
    ]:
        failed = ErrorResponse.model_validate_json(error_body("x", type="leak_blocked", code=code))
        assert failed.error.type == kind
    assert orjson.loads(error_body("x", type="invalid_request_error", code="c"))["error"][
        "type"
    ] == ("invalid_request_error")
    event = error_event("stopped", type="leak_blocked", code="cross_tenant_leak")
    (decoded,) = SSEDecoder().feed(event)
    assert decoded.event == "error" and decoded.data.encode() == raw
    # Our own cut, read back by the parser, is an upstream error like any other.
    parser = StreamParser()
    parser.feed(decoded)
    assert parser.error["code"] == "cross_tenant_leak"


# --- tenants from x-api-key -------------------------------------------------------------------


def test_api_key_from_x_api_key_when_there_is_no_bearer_token() -> None:
    assert api_key_of({"x-api-key": " sk-ant-1 "}) == "sk-ant-1"
    assert api_key_of({"authorization": "Bearer sk-2", "x-api-key": "sk-ant-1"}) == "sk-2"
    assert api_key_of({"authorization": "Basic abc", "x-api-key": "sk-ant-1"}) == "sk-ant-1"
    assert api_key_of({"x-api-key": "  "}) is None
    rules = TenantRules(api_keys={"sk-ant-1": "acme"}, secret=b"s")
    assert resolve_tenant(rules, {"x-api-key": "sk-ant-1"}, None) == "acme"
    assert resolve_tenant(rules, {"x-api-key": "sk-other"}, None).startswith("key:")
    # metadata.user_id is the body's user: used when no header or key names a tenant.
    parsed = parse_request("messages", body({"messages": [], "metadata": {"user_id": "u-7"}}))
    assert resolve_tenant(rules, {}, parsed.user) == "u-7"
