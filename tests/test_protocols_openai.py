"""Tests for proxy.protocols.openai: request prompts, streamed and whole responses, errors."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from proxy.protocols.openai import (
    OutputDelta,
    ParsedRequest,
    ProtocolError,
    StreamParser,
    error_body,
    error_event,
    event_object,
    parse_request,
    parse_response,
    route_for,
)
from proxy.protocols.sse import SSEDecoder, SSEEvent


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def ev(obj: Any) -> SSEEvent:
    return SSEEvent(obj if isinstance(obj, str) else json.dumps(obj))


def texts_by_choice(deltas: list[OutputDelta]) -> dict[int, str]:
    out: dict[int, str] = {}
    for d in deltas:
        out[d.choice] = out.get(d.choice, "") + d.text
    return out


def chunk(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A chat.completion.chunk as vLLM / OpenAI send it."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "llama-3-8b",
        "choices": list(choices),
        **extra,
    }


def delta(index: int, finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": index, "delta": fields, "finish_reason": finish_reason, "logprobs": None}


# --- route_for -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "route"),
    [
        ("POST", "/v1/chat/completions", "chat"),
        ("POST", "/v1/completions", "completions"),
        ("POST", "/chat/completions", "chat"),
        ("POST", "/completions", "completions"),
        ("POST", "/openai/v1/chat/completions", "chat"),
        ("POST", "/api/openai/v1/completions?x=1", "completions"),
        ("POST", "/v1/chat/completions?api-version=2024-06-01", "chat"),
        ("POST", "/openai/deployments/gpt4o/chat/completions?api-version=1", "chat"),
        ("POST", "/v1/chat/completions/", "chat"),
        ("post", "/v1/completions", "completions"),
        ("GET", "/v1/chat/completions", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/embeddings", None),
        ("POST", "/v1/responses", None),
        ("POST", "/v1/chat/completions/extra", None),
        ("POST", "/v1/chatcompletions", None),
        ("POST", "/v1/mychat/completions", "completions"),
        ("POST", "/v1/completionsX", None),
        ("POST", "/?next=/v1/completions", None),
        ("POST", "", None),
    ],
)
def test_route_for(method: str, path: str, route: str | None) -> None:
    assert route_for(method, path) == route


# --- parse_request -----------------------------------------------------------------------------


def test_chat_prompt_covers_every_message_kind_in_order() -> None:
    request = {
        "model": "llama-3-8b",
        "user": "tenant-a",
        "stream": True,
        "n": 2,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Dev rules."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "input_text", "text": "and this \u00e9\U0001f600"},
                    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"acct": "4111"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "balance: 12.50"},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "second result"}],
            },
            {"role": "assistant", "content": "Your balance is 12.50."},
            {"role": "user", "content": "Thanks"},
        ],
    }
    parsed = parse_request("chat", body(request))
    assert parsed == ParsedRequest(
        prompt="\n".join(
            [
                "You are terse.",
                "Dev rules.",
                "Look at this",
                "and this \u00e9\U0001f600",
                '{"acct": "4111"}',
                "balance: 12.50",
                "second result",
                "Your balance is 12.50.",
                "Thanks",
            ]
        ),
        model_text='{"acct": "4111"}\nYour balance is 12.50.',
        stream=True,
        model="llama-3-8b",
        n=2,
        user="tenant-a",
        turns_known=True,  # roles say who wrote what
    )


def test_chat_prompt_edge_cases() -> None:
    request = {
        "messages": [
            {"role": "user", "content": ""},  # empty pieces add no blank lines
            {"role": "assistant", "content": "", "refusal": "I can't."},
            {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "assistant", "reasoning_content": "think", "content": "answer"},
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}, "bare part"]},
            {"role": "user", "name": "bob"},  # no content at all
        ]
    }
    parsed = parse_request("chat", body(request))
    assert parsed.prompt == "I can't.\n{}\nthink\nanswer\nno\nbare part"
    assert (parsed.stream, parsed.model, parsed.n, parsed.user) == (False, None, 1, None)


def test_chat_prompt_empty_messages() -> None:
    assert parse_request("chat", b'{"messages": []}').prompt == ""


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("Once upon a time", "Once upon a time"),
        (["first", "second \u20ac"], "first\nsecond \u20ac"),
        ([1, 2, 3], ""),
        ([[1, 2], [3, 4]], ""),
        (["text", 5, [6]], "text"),
        ("", ""),
        (None, ""),
    ],
)
def test_completions_prompt(prompt: Any, expected: str) -> None:
    parsed = parse_request("completions", body({"model": "m", "prompt": prompt, "stream": False}))
    assert parsed == ParsedRequest(
        prompt=expected, model_text="", stream=False, model="m", n=1, user=None
    )


def test_completions_suffix_is_prompt_text() -> None:
    parsed = parse_request("completions", body({"prompt": "def f(", "suffix": "    return x"}))
    assert parsed.prompt == "def f(\n    return x"


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("chat", b""),
        ("chat", b"{not json"),
        ("chat", b'{"messages": [}'),
        ("chat", b"\xff\xfe"),
        ("chat", b"[]"),
        ("chat", b'"just a string"'),
        ("chat", b"{}"),
        ("chat", b'{"messages": "hi"}'),
        ("chat", b'{"messages": ["hi"]}'),
        ("chat", b'{"messages": [{"role": "user", "content": 5}]}'),
        ("chat", b'{"messages": [{"role": "user", "content": [5]}]}'),
        ("chat", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}'),
        ("chat", b'{"messages": [{"role": "assistant", "tool_calls": {}}]}'),
        ("chat", b'{"messages": [], "stream": "yes"}'),
        ("chat", b'{"messages": [], "n": 0}'),
        ("chat", b'{"messages": [], "n": true}'),
        ("chat", b'{"messages": [], "model": 7}'),
        ("completions", b'{"prompt": 7}'),
        ("completions", b'{"prompt": [{"text": "x"}]}'),
        ("completions", b'{"prompt": "x", "user": ["a"]}'),
    ],
)
def test_malformed_requests_raise_protocol_error(route: Any, raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_request(route, raw)


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


# --- StreamParser: chat ------------------------------------------------------------------------


def test_chat_stream_with_two_interleaved_choices() -> None:
    events = [
        chunk(delta(0, role="assistant", content=""), delta(1, role="assistant", content="")),
        chunk(delta(1, content="Bon")),
        chunk(delta(0, content="Hel")),
        chunk(delta(0, content="lo \u00e9"), delta(1, content="jour")),
        chunk(delta(1, finish_reason="stop")),
        chunk(delta(0, content="!", finish_reason="length")),
        chunk(usage={"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}),
        "[DONE]",
    ]
    parser = StreamParser("chat")
    out: list[OutputDelta] = []
    for e in events:
        out += parser.feed(ev(e))
    assert out[:2] == [OutputDelta(1, "Bon"), OutputDelta(0, "Hel")]
    assert texts_by_choice(out) == {0: "Hello \u00e9!", 1: "Bonjour"}
    assert parser.done
    assert parser.error is None
    assert parser.model == "llama-3-8b"
    assert parser.finish_reasons == {0: "length", 1: "stop"}
    assert parser.malformed_events == 0


def test_role_only_and_empty_deltas_produce_no_output() -> None:
    parser = StreamParser("chat")
    assert parser.feed(ev(chunk(delta(0, role="assistant")))) == []
    assert parser.feed(ev(chunk(delta(0, role="assistant", content=None)))) == []
    assert parser.feed(ev(chunk(delta(0)))) == []
    assert parser.feed(ev(chunk({"index": 0, "delta": None, "finish_reason": None}))) == []
    assert parser.feed(ev(chunk({"index": 0}))) == []
    assert parser.malformed_events == 0


def test_usage_only_final_chunk() -> None:
    parser = StreamParser("chat")
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert parser.feed(ev(chunk(usage=usage))) == []
    assert parser.malformed_events == 0
    assert not parser.done


def test_tool_call_argument_deltas() -> None:
    events = [
        chunk(delta(0, role="assistant", content=None)),
        chunk(
            delta(
                0,
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": ""},
                    }
                ],
            )
        ),
        chunk(delta(0, tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}])),
        chunk(delta(0, tool_calls=[{"index": 0, "function": {"arguments": '"Par\u00eds"}'}}])),
        chunk(delta(0, tool_calls=[{"index": 0}])),  # no function at all
        chunk(delta(0, finish_reason="tool_calls")),
    ]
    parser = StreamParser("chat")
    out = [d for e in events for d in parser.feed(ev(e))]
    assert out == [OutputDelta(0, '{"city": '), OutputDelta(0, '"Par\u00eds"}')]
    assert parser.finish_reasons == {0: "tool_calls"}
    assert parser.malformed_events == 0


def test_reasoning_deltas_precede_content_and_are_not_duplicated() -> None:
    parser = StreamParser("chat")
    assert parser.feed(ev(chunk(delta(0, reasoning_content="Let me think.")))) == [
        OutputDelta(0, "Let me think.")
    ]
    # Newer vLLM: "reasoning"; during the rename both carried the same text.
    assert parser.feed(ev(chunk(delta(0, reasoning="Hmm.")))) == [OutputDelta(0, "Hmm.")]
    assert parser.feed(ev(chunk(delta(0, reasoning="Ok.", reasoning_content="Ok.")))) == [
        OutputDelta(0, "Ok.")
    ]
    assert parser.feed(ev(chunk(delta(0, reasoning_content="r", content="c")))) == [
        OutputDelta(0, "r"),
        OutputDelta(0, "c"),
    ]


def test_refusal_and_legacy_function_call_deltas() -> None:
    parser = StreamParser("chat")
    assert parser.feed(ev(chunk(delta(0, refusal="I can't")))) == [OutputDelta(0, "I can't")]
    got = parser.feed(ev(chunk(delta(0, function_call={"name": "f", "arguments": '{"a"'}))))
    assert got == [OutputDelta(0, '{"a"')]


def test_missing_index_uses_position() -> None:
    parser = StreamParser("chat")
    got = parser.feed(ev({"choices": [{"delta": {"content": "a"}}, {"delta": {"content": "b"}}]}))
    assert got == [OutputDelta(0, "a"), OutputDelta(1, "b")]
    assert parser.model is None


def test_model_comes_from_first_chunk_that_has_one() -> None:
    parser = StreamParser("chat")
    parser.feed(ev({"choices": []}))
    parser.feed(ev(chunk(model="first")))
    parser.feed(ev(chunk(model="second")))
    assert parser.model == "first"


# --- StreamParser: errors and malformed events -------------------------------------------------


def test_error_event_is_captured() -> None:
    parser = StreamParser("chat")
    parser.feed(ev(chunk(delta(0, content="partial"))))
    err = {"message": "KV cache exhausted", "type": "InternalServerError", "code": 500}
    assert parser.feed(SSEEvent(json.dumps({"error": err}), event="error")) == []
    assert parser.error == err
    assert parser.malformed_events == 0
    assert not parser.done


def test_error_event_in_other_shapes() -> None:
    old_vllm = {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}
    parser = StreamParser("completions")
    parser.feed(ev(old_vllm))
    assert parser.error == old_vllm

    parser = StreamParser("chat")
    parser.feed(ev({"error": "upstream timeout"}))
    assert parser.error == {"message": "upstream timeout"}

    # "error": null on an ordinary chunk is not an error.
    parser = StreamParser("chat")
    assert parser.feed(ev(chunk(delta(0, content="x"), error=None))) == [OutputDelta(0, "x")]
    assert parser.error is None


def test_our_own_error_event_round_trips() -> None:
    decoder = SSEDecoder()
    [event] = decoder.feed(error_event("leak blocked", type="crosstalk_error", code="leak"))
    parser = StreamParser("chat")
    assert parser.feed(event) == []
    assert parser.error == {
        "message": "leak blocked",
        "type": "crosstalk_error",
        "param": None,
        "code": "leak",
    }


@pytest.mark.parametrize(
    "data",
    [
        "not json",
        "{truncated",
        '"a string"',
        "[1, 2]",
        "42",
        "{}",
        '{"choices": null}',
        '{"choices": {"0": {}}}',
        '{"choices": ["x"]}',
        '{"choices": [{"index": "0", "delta": {"content": "x"}}]}',
        '{"choices": [{"index": 0, "delta": "x"}]}',
        '{"choices": [{"index": 0, "delta": {"content": 5}}]}',
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"function": "f"}]}}]}',
        "[DONE",
    ],
)
def test_malformed_events_are_counted_and_skipped(data: str) -> None:
    parser = StreamParser("chat")
    assert parser.feed(SSEEvent(data)) == []
    assert parser.malformed_events == 1
    assert not parser.done
    # The parser keeps going.
    assert parser.feed(ev(chunk(delta(0, content="ok")))) == [OutputDelta(0, "ok")]
    assert parser.malformed_events == 1


def test_a_bad_choice_does_not_hide_good_ones() -> None:
    parser = StreamParser("chat")
    got = parser.feed(ev(chunk(delta(0, content=7), delta(1, content="fine"), "junk")))
    assert got == [OutputDelta(1, "fine")]
    assert parser.malformed_events == 1


def test_blank_data_is_ignored_and_done_tolerates_whitespace() -> None:
    parser = StreamParser("chat")
    assert parser.feed(SSEEvent("")) == []
    assert parser.feed(SSEEvent(" \n")) == []
    assert parser.malformed_events == 0
    assert parser.feed(SSEEvent(" [DONE] ")) == []
    assert parser.done


# --- StreamParser: completions -----------------------------------------------------------------


def test_completions_stream() -> None:
    def cchunk(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "gpt-3.5-turbo-instruct",
            "choices": list(choices),
            **extra,
        }

    def c(i: int, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"index": i, "text": text, "logprobs": None, "finish_reason": finish}

    events = [
        cchunk(c(0, "Once")),
        cchunk(c(1, "In a")),
        cchunk(c(0, " upon"), c(1, " galaxy")),
        cchunk(c(0, "", "stop"), c(1, " \u2728", "length")),
        cchunk(usage={"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}),
        "[DONE]",
    ]
    # No SDK check here: openai.types.Completion requires a non-null finish_reason, which
    # streamed completions chunks (OpenAI's and vLLM's alike) send as null until the end.
    parser = StreamParser("completions")
    out = [d for e in events for d in parser.feed(ev(e))]
    assert texts_by_choice(out) == {0: "Once upon", 1: "In a galaxy \u2728"}
    assert parser.finish_reasons == {0: "stop", 1: "length"}
    assert parser.model == "gpt-3.5-turbo-instruct"
    assert parser.done
    assert parser.malformed_events == 0


def test_completions_stream_ignores_chat_delta_and_vice_versa() -> None:
    # Route decides the shape: a chat chunk on the completions route carries no "text".
    assert StreamParser("completions").feed(ev(chunk(delta(0, content="x")))) == []
    assert StreamParser("chat").feed(ev({"choices": [{"index": 0, "text": "x"}]})) == []


# --- realistic stream validated by the openai SDK's own types ----------------------------------


def test_realistic_stream_validated_by_openai_sdk_types() -> None:
    created = 1_718_000_000
    base = {"id": "chatcmpl-9abc", "created": created, "model": "gpt-4o-2024-08-06"}
    base |= {"object": "chat.completion.chunk", "system_fingerprint": "fp_abc"}
    chunks: list[dict[str, Any]] = [
        {**base, "choices": [delta(i, role="assistant", content="", refusal=None) for i in (0, 1)]},
        {**base, "choices": [delta(0, content="The secret")]},
        {**base, "choices": [delta(1, reasoning_content="User wants a tool.")]},
        {
            **base,
            "choices": [
                delta(
                    1,
                    tool_calls=[
                        {
                            "index": 0,
                            "id": "call_Xy",
                            "type": "function",
                            "function": {"name": "search", "arguments": '{"q":'},
                        }
                    ],
                )
            ],
        },
        {**base, "choices": [delta(0, content=" is \u201cswordfish\u201d \U0001f512.")]},
        {
            **base,
            "choices": [delta(1, tool_calls=[{"index": 0, "function": {"arguments": '"x"}'}}])],
        },
        {**base, "choices": [delta(0, "stop")]},
        {**base, "choices": [delta(1, "tool_calls")]},
        {
            **base,
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
        },
    ]
    for c in chunks:
        ChatCompletionChunk.model_validate(c)  # proves the fixtures have the real shape

    wire = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    decoder = SSEDecoder()
    parser = StreamParser("chat")
    out: list[OutputDelta] = []
    for i in range(0, len(wire), 7):  # arbitrary network chunking
        for event in decoder.feed(wire[i : i + 7]):
            out += parser.feed(event)
    assert decoder.close() == []
    assert not decoder.truncated

    assert texts_by_choice(out) == {
        0: "The secret is \u201cswordfish\u201d \U0001f512.",
        1: 'User wants a tool.{"q":"x"}',
    }
    assert parser.done
    assert parser.model == "gpt-4o-2024-08-06"
    assert parser.finish_reasons == {0: "stop", 1: "tool_calls"}
    assert parser.malformed_events == 0


# --- parse_response ----------------------------------------------------------------------------


def test_parse_response_chat() -> None:
    response = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello \U0001f44b", "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            },
            {
                "index": 1,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"a": 1}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "g", "arguments": '{"b": 2}'},
                        },
                    ],
                    "reasoning_content": "Two calls needed.",
                },
                "finish_reason": "tool_calls",
                "logprobs": None,
            },
            {
                "index": 2,
                "message": {"role": "assistant", "content": None},
                "finish_reason": "length",
                "logprobs": None,
            },
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    ChatCompletion.model_validate(response)
    assert parse_response("chat", body(response)) == [
        OutputDelta(0, "Hello \U0001f44b"),
        OutputDelta(1, 'Two calls needed.\n{"a": 1}\n{"b": 2}'),
        OutputDelta(2, ""),
    ]


def test_parse_response_completions() -> None:
    response = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 1, "text": " world", "logprobs": None, "finish_reason": "stop"},
            {"index": 0, "text": " there", "logprobs": None, "finish_reason": "stop"},
        ],
    }
    Completion.model_validate(response)
    assert parse_response("completions", body(response)) == [
        OutputDelta(1, " world"),
        OutputDelta(0, " there"),
    ]


def test_parse_response_empty_choices() -> None:
    assert parse_response("chat", b'{"choices": []}') == []


@pytest.mark.parametrize(
    ("route", "raw"),
    [
        ("chat", b"data: {}\n\n"),  # a stream mistaken for a whole body
        ("chat", b"null"),
        ("chat", b"[]"),
        ("chat", b'{"error": {"message": "x"}}'),
        ("chat", b'{"choices": [{"index": 0}]}'),
        ("chat", b'{"choices": [{"index": 0, "message": {"content": 1}}]}'),
        ("chat", b'{"choices": [{"index": 0.5, "message": {}}]}'),
        ("chat", b'{"choices": [null]}'),
        ("completions", b'{"choices": [{"index": 0, "text": ["x"]}]}'),
        ("completions", b'{"choices": "x"}'),
    ],
)
def test_parse_response_rejects_wrong_shapes(route: Any, raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_response(route, raw)


# --- error helpers -----------------------------------------------------------------------------


def test_error_body_and_event() -> None:
    raw = error_body('Leak "blocked"\nline 2', type="crosstalk_error", code="cross_tenant_leak")
    assert json.loads(raw) == {
        "error": {
            "message": 'Leak "blocked"\nline 2',
            "type": "crosstalk_error",
            "param": None,
            "code": "cross_tenant_leak",
        }
    }
    event = error_event('Leak "blocked"\nline 2', type="crosstalk_error", code="cross_tenant_leak")
    assert event == b"data: " + raw + b"\n\n"
    assert event.count(b"\n") == 2  # one data line, then the blank line


# --- the compiled step and the Python one --------------------------------------------------

_text = st.sampled_from(["Hi", "", " there", "caf\u00e9 \u20ac", "\U0001f600", "a\nb"])
_odd = st.sampled_from([None, 0, 1, True, 2.5, [], {}, [1], {"x": 1}, "x"])
_delta = st.one_of(
    st.none(),
    _odd,
    st.fixed_dictionaries({"content": _text}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _text}),
    st.fixed_dictionaries({"role": st.just("assistant")}),
    # Two keys, the shape the compiled step reads when the other one is "role".
    st.builds(
        lambda key, content, other: {"content": content, key: other},
        st.sampled_from(["role", "reasoning_content", "reasoning", "refusal", "tool_calls"]),
        st.one_of(_text, _odd),
        st.one_of(_text, _odd),
    ),
    st.fixed_dictionaries({"content": st.one_of(_text, _odd)}, optional={"role": _odd}),
    st.fixed_dictionaries(
        {},
        optional={
            "content": st.one_of(_text, _odd),
            "reasoning_content": _text,
            "reasoning": _text,
            "refusal": _text,
            "tool_calls": st.one_of(_odd, st.just([{"function": {"arguments": "{}"}}])),
            "x": _odd,
        },
    ),
)
_choice = st.one_of(
    _odd,
    st.fixed_dictionaries(
        {},
        optional={
            "index": st.one_of(st.integers(0, 2), _odd),
            "delta": _delta,
            "text": st.one_of(_text, _odd),
            "finish_reason": st.one_of(st.sampled_from(["stop", "length"]), _odd),
        },
    ),
)
_chunk = st.one_of(
    st.fixed_dictionaries(
        {"choices": st.lists(_choice, max_size=3)},
        optional={
            "model": st.one_of(st.just("m1"), st.just("m2"), _odd),
            "object": st.sampled_from(["chat.completion.chunk", "error"]),
            "error": st.one_of(_odd, st.just({"message": "boom"})),
        },
    ),
    st.fixed_dictionaries({}, optional={"choices": _odd, "model": _odd}),
)
_event_data = st.one_of(
    _chunk.map(lambda c: orjson.dumps(c).decode()),
    st.sampled_from(
        ["", " ", "[DONE]", " [DONE]", "{", '{"a":', "[1]", "1", '"x"', ' {"choices": []}']
    ),
)


_content = st.text(
    alphabet=st.sampled_from(
        ["a", " ", "é", "€", "😀", '"', "\\", "\n", "\x00", "\x1f", "/", "\ufeff"]
    ),
    max_size=6,
)


@st.composite
def _stream_of_one_shape(draw: st.DrawFn) -> list[str]:
    """Events of one shape with another string each, as a server sends them: the string
    written as orjson does, escaped to ASCII, or inserted raw (invalid JSON when it holds a
    quote, a backslash or a control character); now and then an event of another shape."""
    key = draw(
        st.sampled_from(
            ['"delta":{"content":%s}', '"delta":{"role":"assistant","content":%s}', '"text":%s']
        )
    )
    index = draw(st.sampled_from(["", '"index":0,', '"index":1,', '"index":true,']))
    finish = draw(st.sampled_from(["null", '"stop"', "3"]))
    shape = (
        '{"id":"c1","model":"m","choices":[{' + index + key + ',"finish_reason":' + finish + "}]}"
    )
    events = []
    for content in draw(st.lists(_content, max_size=10)):
        how = draw(st.sampled_from(["orjson", "ascii", "raw", "other"]))
        if how == "other":
            events.append(draw(_event_data))
            continue
        written = {
            "orjson": lambda c: orjson.dumps(c).decode(),
            "ascii": json.dumps,
            "raw": lambda c: f'"{c}"',
        }[how](content)
        events.append(shape.replace("%s", written))
    return events


@given(
    st.sampled_from(["chat", "completions"]),
    st.lists(_event_data, max_size=8) | _stream_of_one_shape(),
)
@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@example("chat", ['{"choices":[{"delta":{"content":"c","reasoning_content":"r"}}]}'])
@example("chat", ['{"model":"m","choices":[{"index":true,"delta":{"content":"c"}}]}'])
@example("completions", ['{"choices":[{"text":"a","finish_reason":"stop"},{"text":3}]}'])
@example(
    "chat",
    ['{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"content":"b\\"c"}}]}'],
)
@example(
    "chat",
    ['{"choices":[{"delta":{"content":"a"}}]}', '{"choices":[{"delta":{"content":"\x01"}}]}'],
)
@example(  # the template's finish reason, after another event's
    "chat",
    [
        '{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}',
        '{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":"length"}]}',
        '{"choices":[{"delta":{"content":"b"},"finish_reason":"stop"}]}',
    ],
)
@example(  # the output string's text also in another field
    "chat",
    [
        '{"content":"a","choices":[{"delta":{"content":"a"}}]}',
        '{"content":"zz","choices":[{"delta":{"content":"a"}}]}',
    ],
)
@example(  # ... only there as it stands: the choice's is spaced, or escaped
    "chat",
    [
        '{"x":{"content":"a"},"choices":[{"delta":{"content": "a"}}]}',
        '{"x":{"content":"zz"},"choices":[{"delta":{"content": "a"}}]}',
        '{"x":{"content":"\u00e9"},"choices":[{"delta":{"content":"\\u00e9"}}]}',
        '{"x":{"content":"zz"},"choices":[{"delta":{"content":"\\u00e9"}}]}',
    ],
)
@example(  # a lone surrogate, which orjson refuses (review)
    "chat",
    [
        '{"choices":[{"index":0,"delta":{"content":"Hi"}}]}',
        '{"choices":[{"index":0,"delta":{"content":"a\ud800b"}}]}',
    ],
)
def test_the_compiled_step_reads_events_as_the_python_one(route: str, data: list[str]) -> None:
    """``feed`` (the compiled step, and the Python one for the events it declines) and
    ``read_event`` (Python only) return the same deltas and leave the same state."""
    compiled, python = StreamParser(route), StreamParser(route)
    for item in data:
        event = SSEEvent(item)
        assert compiled.feed(event) == python.read_event(event), item
        assert compiled == python, item


def test_events_of_data_that_is_not_text_are_read_by_the_python_step() -> None:
    """After a template is set, an event whose data is None or bytes is read as the
    Python step reads it (found in review: the compiled step raised on None)."""
    for data in (None, b'{"choices":[{"delta":{"content":"b"}}]}', b"[DONE]"):
        compiled, python = StreamParser("chat"), StreamParser("chat")
        first = SSEEvent('{"choices":[{"delta":{"content":"a"}}]}')
        assert compiled.feed(first) == python.read_event(first)
        assert compiled.template is not None
        assert compiled.feed(SSEEvent(data)) == python.read_event(SSEEvent(data)), data
        assert compiled == python


def test_an_event_the_compiled_step_declines_after_parsing_is_parsed_once(monkeypatch) -> None:
    """Reasoning and tool-call deltas are the Python step's to read: it reads the object
    the compiled step parsed, so such a stream costs one JSON parse an event; only an
    event the compiled step never parsed (``[DONE]``) is parsed by ``event_object``. An
    empty last delta, with its finish reason, is the compiled step's own."""
    from proxy.protocols import openai as openai_module

    parsed: list[str] = []

    def counting_event_object(event: SSEEvent, **kwargs: Any) -> Any:
        parsed.append(event.data)
        return event_object(event, **kwargs)

    monkeypatch.setattr(openai_module, "event_object", counting_event_object)
    parser = StreamParser("chat")
    assert parser.feed(ev(chunk(delta(0, reasoning_content="Let me think.")))) == [
        OutputDelta(0, "Let me think.")
    ]
    tool = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a"'}}]}
    parser.feed(ev(chunk({"index": 0, "delta": tool})))
    assert parser.feed(ev(chunk({"index": 0, "delta": {}, "finish_reason": "stop"}))) == []
    assert parsed == []
    assert parser.finish_reasons == {0: "stop"}
    assert parser.feed(SSEEvent("[DONE]")) == [] and parser.done
    assert parsed == ["[DONE]"]


def test_turns_are_known_for_chats_and_read_templates_only() -> None:
    """A completions string may quote a model unmarked; a chat, or a conversation whose
    template was read, says who wrote what (``EngineConfig.plain_user_factor``)."""
    templated = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert parse_request(
        "chat", body({"messages": [{"role": "user", "content": "Hi"}]})
    ).turns_known
    assert parse_request("completions", body({"prompt": templated})).turns_known
    assert not parse_request("completions", body({"prompt": "Ticket 1\nReply:"})).turns_known
