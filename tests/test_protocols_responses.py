"""Tests for proxy.protocols.responses: OpenAI Responses requests, streamed and whole
responses, and the error event that ends a cut stream."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import orjson
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent

from proxy.protocols import Route, route_for
from proxy.protocols.openai import OutputDelta, ProtocolError
from proxy.protocols.responses import (
    StreamParser,
    error_body,
    error_event,
    parse_request,
    parse_response,
)
from proxy.protocols.responses import route_for as responses_route
from proxy.protocols.sse import SSEDecoder, SSEEvent
from proxy.sim import formats

STREAM_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def ev(kind: str, seq: int, **fields: Any) -> SSEEvent:
    return SSEEvent(json.dumps({"type": kind, "sequence_number": seq, **fields}), event=kind)


def text_of(deltas: list[OutputDelta]) -> str:
    assert all(d.choice == 0 for d in deltas)
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("POST", "/v1/responses", "responses"),
        ("POST", "/openai/v1/responses?api-version=preview", "responses"),
        ("POST", "/v1/responses/", "responses"),
        ("GET", "/v1/responses", None),
        ("POST", "/v1/responses/resp_1/cancel", None),
        ("POST", "/v1/responses/compact", None),
        ("POST", "/v1/responses/input_tokens", None),
    ],
)
def test_route_for(method: str, path: str, kind: str | None) -> None:
    assert responses_route(method, path) == kind
    assert route_for(method, path) == (Route("responses", kind) if kind else None)


# --- requests -------------------------------------------------------------------------------


def test_string_input_with_instructions() -> None:
    parsed = parse_request(
        "responses",
        body({"model": "gpt-5", "instructions": "Be brief.", "input": "Hi", "user": "u1"}),
    )
    assert (parsed.prompt, parsed.model_text, parsed.stream, parsed.model, parsed.user) == (
        "Be brief.\nHi",
        "",
        False,
        "gpt-5",
        "u1",
    )


def test_item_input_covers_every_item_kind_in_order() -> None:
    request = {
        "model": "gpt-5",
        "stream": True,
        "safety_identifier": "hashed-user",
        "input": [
            {"role": "developer", "content": "Answer from the knowledge base."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Where is order 7731?"},
                         {"type": "input_image", "image_url": "data:image/png;base64,iVBOR"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look it up."}]},
            {"type": "function_call", "call_id": "c1", "name": "orders", "arguments": '{"id":7731}'},
            {"type": "function_call_output", "call_id": "c1", "output": "Shipped Monday."},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "It shipped Monday.", "annotations": []},
                         {"type": "refusal", "refusal": "No tracking number."}]},
            {"type": "custom_tool_call", "call_id": "c2", "name": "sql", "input": "SELECT 1"},
            {"type": "custom_tool_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "1 row"}]},
            {"type": "item_reference", "id": "msg_0"},
            {"role": "user", "content": "Thanks!"},
        ],
    }  # fmt: skip
    parsed = parse_request("responses", body(request))
    assert parsed.prompt.split("\n") == [
        "Answer from the knowledge base.",
        "Where is order 7731?",
        "Look it up.",
        '{"id":7731}',
        "Shipped Monday.",
        "It shipped Monday.",
        "No tracking number.",
        "SELECT 1",
        "1 row",
        "Thanks!",
    ]
    assert parsed.model_text.split("\n") == [
        "Look it up.",
        '{"id":7731}',
        "It shipped Monday.",
        "No tracking number.",
        "SELECT 1",
    ]
    assert (parsed.stream, parsed.user) == (True, "hashed-user")


def test_previous_response_id_alone_has_an_empty_prompt() -> None:
    parsed = parse_request("responses", body({"model": "m", "previous_response_id": "resp_1"}))
    assert parsed.prompt == ""


@pytest.mark.parametrize(
    "raw",
    [
        b"nope",
        body(["input"]),
        body({"input": 5}),
        body({"input": ["hi"]}),
        body({"input": [{"role": "user", "content": 5}]}),
        body({"input": [{"role": "user", "content": ["x"]}]}),
        body({"input": "x", "instructions": 1}),
        body({"input": "x", "stream": "true"}),
        body({"input": "x", "user": 3}),
        body({"input": [{"type": "function_call", "arguments": {"id": 1}}]}),
    ],
)
def test_malformed_requests_raise_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_request("responses", raw)


# --- whole responses --------------------------------------------------------------------------

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "created_at": 1_700_000_000,
    "status": "completed",
    "model": "gpt-5",
    "output": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Plan."}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Here you go.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "save",
         "arguments": '{"title":"Q3"}', "status": "completed"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed",
         "action": {"type": "search", "query": "Q3 plans"}},
    ],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
}  # fmt: skip


def test_parse_response_joins_model_written_output() -> None:
    assert parse_response("responses", body(RESPONSE)) == [
        OutputDelta(0, 'Plan.\nHere you go.\n{"title":"Q3"}')
    ]


@pytest.mark.parametrize(
    "raw",
    [
        body({"error": {"message": "bad", "type": "invalid_request_error"}}),
        body({"object": "response"}),
        body({**RESPONSE, "output": ["x"]}),
        b"",
    ],
)
def test_parse_response_rejects_errors_and_wrong_shapes(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_response("responses", raw)


# --- streams --------------------------------------------------------------------------------


def stream() -> list[SSEEvent]:
    where = {"item_id": "msg_1", "output_index": 1, "content_index": 0}
    created = {**RESPONSE, "status": "in_progress", "output": []}
    return [
        ev("response.created", 0, response=created),
        ev("response.in_progress", 1, response=created),
        ev("response.reasoning_summary_text.delta", 2, item_id="rs_1", output_index=0,
           summary_index=0, delta="Plan."),
        ev("response.reasoning_summary_text.done", 3, item_id="rs_1", output_index=0,
           summary_index=0, text="Plan."),
        ev("response.output_text.delta", 4, **where, delta="Here ", logprobs=[]),
        ev("response.output_text.delta", 5, **where, delta="you go.", logprobs=[]),
        ev("response.output_text.done", 6, **where, text="Here you go.", logprobs=[]),
        ev("response.function_call_arguments.delta", 7, item_id="fc_1", output_index=2,
           delta='{"title":'),
        ev("response.function_call_arguments.delta", 8, item_id="fc_1", output_index=2,
           delta='"Q3"}'),
        ev("response.function_call_arguments.done", 9, item_id="fc_1", output_index=2,
           arguments='{"title":"Q3"}', name="save"),
        ev("response.completed", 10, response=RESPONSE),
    ]  # fmt: skip


def test_stream_yields_model_written_deltas_once_with_separators() -> None:
    events = stream()
    for e in events:
        STREAM_EVENTS.validate_json(e.data)  # real event shapes, as the SDK reads them
    parser = StreamParser()
    out = [d for e in events for d in parser.feed(e)]
    assert text_of(out) == 'Plan.\nHere you go.\n{"title":"Q3"}'
    assert text_of(out) == parse_response("responses", body(RESPONSE))[0].text
    assert (parser.model, parser.status, parser.done, parser.error, parser.sequence_number) == (
        "gpt-5",
        "completed",
        True,
        None,
        10,
    )


@pytest.mark.parametrize(
    ("event", "error"),
    [
        # As OpenAI's servers send it (and the openai SDK raises on).
        (
            {"type": "error", "sequence_number": 3,
             "error": {"type": "too_many_requests", "code": "too_many_requests", "message": "Slow down", "param": None}},
            {"type": "too_many_requests", "code": "too_many_requests", "message": "Slow down", "param": None},
        ),
        # As the API reference documents it.
        (
            {"type": "error", "sequence_number": 3, "code": "ERR", "message": "Broken", "param": None},
            {"code": "ERR", "message": "Broken", "param": None},
        ),
        (
            {"type": "response.failed", "sequence_number": 3,
             "response": {**RESPONSE, "status": "failed", "error": {"code": "server_error", "message": "Oops"}}},
            {"code": "server_error", "message": "Oops"},
        ),
    ],
)  # fmt: skip
def test_stream_errors(event: dict, error: dict) -> None:
    parser = StreamParser()
    for e in stream()[:5]:
        parser.feed(e)
    assert parser.feed(SSEEvent(json.dumps(event), event=event["type"])) == []
    assert parser.error == error
    assert parser.done == (event["type"] == "response.failed")


def test_incomplete_ends_the_stream_and_malformed_events_are_counted() -> None:
    parser = StreamParser()
    parser.feed(ev("response.incomplete", 4, response={**RESPONSE, "status": "incomplete"}))
    assert parser.done and parser.status == "incomplete"
    for data in ("{", "[]", json.dumps({"type": "response.output_text.delta", "delta": 5})):
        parser.feed(SSEEvent(data))
    assert parser.malformed_events == 3
    assert parser.feed(SSEEvent(json.dumps({"type": "response.future_thing"}))) == []


class _Sent:
    request_id = "r1"
    prompt = "Tell me about the harbour."

    def __init__(self, answer: str, finish: str = "stop") -> None:
        self.answers, self.finish = (answer,), (finish,)


@given(
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=30),
    st.sampled_from(["stop", "length"]),
    st.data(),
)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_simulator_stream_cut_anywhere_gives_back_the_answer(pieces, finish, data) -> None:
    answer = "".join(pieces)
    events, _ = formats.responses_events(_Sent(answer, finish), "resp_1", 0, "m", [pieces])
    raw = b"".join(events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    decoder, parser, out = SSEDecoder(), StreamParser(), []
    for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
        out += [d for e in decoder.feed(raw[a:b]) for d in parser.feed(e)]
    assert text_of(out) == answer
    assert parser.done and parser.malformed_events == 0
    assert parser.sequence_number == len(events) - 1


def test_simulator_events_and_body_are_valid_sdk_types() -> None:
    sent = _Sent("Hello there.")
    events, _ = formats.responses_events(sent, "resp_1", 0, "m", [["Hello", " there."]])
    for e in SSEDecoder().feed(b"".join(events)):
        assert STREAM_EVENTS.validate_json(e.data).type == e.event
    whole = Response.model_validate(formats.responses_body(sent, "resp_1", 0, "m"))
    assert whole.output_text == "Hello there."


# --- the error format -------------------------------------------------------------------------


def test_error_event_has_both_shapes_and_the_sdk_raises_on_it() -> None:
    raw = error_event("stopped", type="leak_blocked", code="cross_tenant_leak", sequence_number=7)
    (decoded,) = SSEDecoder().feed(raw)
    assert decoded.event == "error"
    documented = ResponseErrorEvent.model_validate_json(decoded.data)
    assert (documented.code, documented.message, documented.sequence_number) == (
        "cross_tenant_leak",
        "stopped",
        7,
    )
    assert orjson.loads(decoded.data)["error"] == {
        "type": "leak_blocked",
        "code": "cross_tenant_leak",
        "message": "stopped",
        "param": None,
    }
    # The openai SDK, reading a stream that ends with it, raises APIError.
    stream_body = b"".join(formats.responses_events(_Sent("Hi."), "r", 0, "m", [["Hi."]])[0][:3])
    client = openai.OpenAI(
        api_key="k",
        base_url="http://sim.invalid/v1",
        max_retries=0,
        http_client=httpx2.Client(
            transport=httpx2.MockTransport(
                lambda request: httpx2.Response(
                    200, headers={"content-type": "text/event-stream"}, content=stream_body + raw
                )
            )
        ),
    )
    with pytest.raises(openai.APIError) as caught:
        list(client.responses.create(model="m", input="x", stream=True))
    assert caught.value.message == "stopped"


def test_parser_numbers_the_cut_after_what_it_saw() -> None:
    parser = StreamParser()
    for e in stream()[:6]:
        parser.feed(e)
    assert (
        orjson.loads(parser.error_event("x", type="t", code="c")[len(b"event: error\ndata: ") :])[
            "sequence_number"
        ]
        == 6
    )
    route = Route("responses", "responses")
    assert route.error_event("x", type="t", code="c", parser=parser) == parser.error_event(
        "x", type="t", code="c"
    )
    assert orjson.loads(error_body("x", type="t", code="c")) == {
        "error": {"message": "x", "type": "t", "param": None, "code": "c"}
    }
