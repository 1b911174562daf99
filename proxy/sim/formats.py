"""The simulator's other wire formats: Anthropic Messages, OpenAI Responses, SGLang's and
TGI's native generate endpoints and vLLM's demo ``/generate``.

Pure functions, like the OpenAI ones in ``server.py``: a request body becomes a
:class:`Request` (prompt text, the user's own words, limits), and generated answers become
a whole body or the stream's events, byte for byte as each engine writes them (event names,
``sequence_number``, TGI's ``data:`` without a space, SGLang's cumulative ``text``). The
server adds everything shared: answers, fault injection, pacing, misbehaviour.

The prompt text is what the proxy's parsers extract from the same body (system or
instructions first, then the messages, joined by "\\n"): the fault injector leaks pieces
of it, and the detector must have seen them to name the source.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.sim.answers import count_units, question_part


class FormatError(ValueError):
    """A request this format rejects (HTTP 400, or the engine's own status)."""


@dataclass(frozen=True, slots=True)
class Request:
    """What the simulator needs from a request body, whatever its format."""

    prompt: str
    private: str  # the user's own words (the last user message), for the fault injector
    max_words: int | None
    n: int
    stream: bool


class Generated(Protocol):
    """What the builders read of an exchange (the server's ``_Exchange``)."""

    request_id: str
    prompt: str
    answers: Sequence[str]
    finish: Sequence[str]  # "stop" or "length", per answer


def _json(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def named_event(name: str, obj: Any) -> bytes:
    """One SSE event with an ``event:`` line (Anthropic, Responses)."""
    return b"event: " + name.encode() + b"\ndata: " + _json(obj) + b"\n\n"


def _text_of(content: Any, part_types: frozenset[str]) -> str:
    """A content string, or the text of its text parts joined (no separator)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in part_types
        )
    raise FormatError("content must be a string or a list of parts")


def _positive(value: Any, name: str, *, required: bool = False) -> int | None:
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1_000_000:
        raise FormatError(f"'{name}' must be an integer in [0, 1000000]")
    return value


def _stream_flag(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise FormatError("'stream' must be a boolean")
    return stream


def _conversation(system: str, messages: Any, part_types: frozenset[str]) -> tuple[str, str]:
    """(prompt, last user text) of a system text and role/content messages."""
    if not isinstance(messages, list) or not messages:
        raise FormatError("'messages' must be a non-empty list")
    texts = [system] if system else []
    last_user = ""
    for m in messages:
        if not isinstance(m, dict):
            raise FormatError("each message must be an object")
        text = _text_of(m.get("content"), part_types)
        texts.append(text)
        if m.get("role") == "user":
            last_user = text
    return "\n".join(texts), last_user


# --- Anthropic Messages ----------------------------------------------------------------------

_ANTHROPIC_TEXT = frozenset({"text"})


def anthropic_request(body: dict) -> Request:
    """``system`` + ``messages``; ``max_tokens`` is required, as the API requires it."""
    system = _text_of(body.get("system"), _ANTHROPIC_TEXT)
    prompt, private = _conversation(system, body.get("messages"), _ANTHROPIC_TEXT)
    max_words = _positive(body.get("max_tokens"), "max_tokens", required=True)
    return Request(prompt, private, max_words, 1, _stream_flag(body))


def _anthropic_usage(r: Generated) -> dict:
    return {"input_tokens": count_units(r.prompt), "output_tokens": count_units(r.answers[0])}


def _stop_reason(finish: str) -> str:
    return "max_tokens" if finish == "length" else "end_turn"


def anthropic_body(r: Generated, resp_id: str, created: int, model: str) -> dict:
    return {
        "id": resp_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": r.answers[0]}],
        "stop_reason": _stop_reason(r.finish[0]),
        "stop_sequence": None,
        "usage": _anthropic_usage(r),
    }


def anthropic_events(
    r: Generated,
    resp_id: str,
    created: int,
    model: str,
    pieces: list[list[str]],
) -> tuple[list[bytes], int]:
    """message_start, content_block_start, ping, one text_delta per piece,
    content_block_stop, message_delta, message_stop. Returns (events, events before
    the first delta)."""
    start = {**anthropic_body(r, resp_id, created, model), "content": [], "stop_reason": None}
    start["usage"] = {"input_tokens": count_units(r.prompt), "output_tokens": 1}
    events = [
        named_event("message_start", {"type": "message_start", "message": start}),
        named_event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        named_event("ping", {"type": "ping"}),
    ]
    lead = len(events)
    for piece in pieces[0]:
        delta = {"type": "text_delta", "text": piece}
        events.append(
            named_event(
                "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
            )
        )
    events += [
        named_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        named_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(r.finish[0]), "stop_sequence": None},
                "usage": {"output_tokens": count_units(r.answers[0])},
            },
        ),
        named_event("message_stop", {"type": "message_stop"}),
    ]
    return events, lead


def anthropic_error(message: str, status: int) -> dict:
    kind = {400: "invalid_request_error", 529: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ANTHROPIC_ERROR_EVENT = named_event(
    "error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
)


# --- OpenAI Responses ------------------------------------------------------------------------

_RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})


def responses_request(body: dict) -> Request:
    """``instructions`` + ``input`` (a string or message items)."""
    instructions = body.get("instructions") or ""
    if not isinstance(instructions, str):
        raise FormatError("'instructions' must be a string")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if isinstance(items, list):
        items = [i for i in items if isinstance(i, dict) and i.get("type", "message") == "message"]
    prompt, private = _conversation(instructions, items, _RESPONSES_TEXT)
    max_words = _positive(body.get("max_output_tokens"), "max_output_tokens")
    return Request(prompt, private, max_words, 1, _stream_flag(body))


def responses_body(
    r: Generated, resp_id: str, created: int, model: str, *, done: bool = True
) -> dict:
    text = r.answers[0]
    complete = r.finish[0] != "length"
    message = {
        "id": "msg_" + resp_id.removeprefix("resp_"),
        "type": "message",
        "status": "completed" if complete else "incomplete",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }
    status = ("completed" if complete else "incomplete") if done else "in_progress"
    prompt_units, output_units = count_units(r.prompt), count_units(text)
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None if complete or not done else {"reason": "max_output_tokens"},
        "model": model,
        "output": [message] if done else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": prompt_units,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_units,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_units + output_units,
        }
        if done
        else None,
    }


def responses_events(
    r: Generated,
    resp_id: str,
    created: int,
    model: str,
    pieces: list[list[str]],
) -> tuple[list[bytes], int]:
    """The Responses event sequence for one message item, numbered from 0."""
    final = responses_body(r, resp_id, created, model)
    message = final["output"][0]
    item_id, text = message["id"], r.answers[0]
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(seq), **fields})

    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    events = [
        event("response.created", response=responses_body(r, resp_id, created, model, done=False)),
        event(
            "response.in_progress", response=responses_body(r, resp_id, created, model, done=False)
        ),
        event(
            "response.output_item.added",
            output_index=0,
            item={**message, "status": "in_progress", "content": []},
        ),
        event("response.content_part.added", **where, part=part),
    ]
    lead = len(events)
    events += [
        event("response.output_text.delta", **where, delta=piece, logprobs=[])
        for piece in pieces[0]
    ]
    events += [
        event("response.output_text.done", **where, text=text, logprobs=[]),
        event("response.content_part.done", **where, part={**part, "text": text}),
        event("response.output_item.done", output_index=0, item=message),
        event(
            "response.completed" if final["status"] == "completed" else "response.incomplete",
            response=final,
        ),
    ]
    return events, lead


RESPONSES_ERROR_EVENT = named_event(
    "error",
    {
        "type": "error",
        "sequence_number": 0,
        "error": {
            "type": "server_error",
            "code": "server_error",
            "message": "engine overloaded",
            "param": None,
        },
    },
)


# --- SGLang /generate -------------------------------------------------------------------------


def sglang_request(body: dict) -> Request:
    """``text`` (a string, or a list of one) and ``sampling_params``. Token ids
    (``input_ids``) are refused: the simulator answers text with text."""
    text = body.get("text")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise FormatError("'text' must be a string (the simulator has no tokenizer)")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise FormatError("'sampling_params' must be an object")
    max_words = _positive(params.get("max_new_tokens"), "max_new_tokens")
    n = _positive(params.get("n"), "n") or 1
    return Request(text, question_part(text), max_words, n, _stream_flag(body))


def _sglang_meta(r: Generated, i: int, produced: int, finish: str | None) -> dict:
    reason = None
    if finish is not None:
        reason = {"type": "length", "length": produced} if finish == "length" else {"type": "stop"}
    return {
        "id": f"{r.request_id}-{i}" if len(r.answers) > 1 else r.request_id,
        "finish_reason": reason,
        "prompt_tokens": count_units(r.prompt),
        "completion_tokens": produced,
        "cached_tokens": 0,
    }


def sglang_body(r: Generated, resp_id: str, created: int, model: str) -> Any:
    outs = [
        {
            "text": text,
            "output_ids": list(range(1000, 1000 + count_units(text))),
            "meta_info": _sglang_meta(r, i, count_units(text), r.finish[i]),
            **({"index": i} if len(r.answers) > 1 else {}),
        }
        for i, text in enumerate(r.answers)
    ]
    return outs[0] if len(outs) == 1 else outs


def sglang_events(
    r: Generated,
    resp_id: str,
    created: int,
    model: str,
    pieces: list[list[str]],
    *,
    incremental: bool = False,
) -> tuple[list[bytes], int]:
    """``data: {...}`` per piece, ``text`` and ``output_ids`` cumulative (or, with
    ``incremental``, as SGLang's ``--incremental-streaming-output`` sends them, only the
    new ones), then ``data: [DONE]``. Sequences of n > 1 interleave, with ``index``."""
    events: list[bytes] = []
    sent = [""] * len(pieces)
    for step in range(max((len(p) for p in pieces), default=0)):
        for i, p in enumerate(pieces):
            if step >= len(p):
                continue
            sent[i] += p[step]
            last = step == len(p) - 1
            ids = list(range(1000, 1001 + step))
            out = {
                "text": p[step] if incremental else sent[i],
                "output_ids": ids[-1:] if incremental else ids,
                "meta_info": _sglang_meta(r, i, step + 1, r.finish[i] if last else None),
                **({"index": i} if len(pieces) > 1 else {}),
            }
            events.append(b"data: " + _json(out) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events, 0


SGLANG_ERROR_EVENT = (
    b"data: " + _json({"error": {"message": "engine overloaded"}}) + b"\n\ndata: [DONE]\n\n"
)


def sglang_error(message: str, status: int) -> dict:
    return {"error": {"message": message}}


# --- TGI /generate and /generate_stream ---------------------------------------------------------


def tgi_request(body: dict, *, stream: bool) -> Request:
    """``inputs`` and ``parameters`` (``max_new_tokens``). The route decides streaming."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str):
        raise FormatError("'inputs' must be a string")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise FormatError("'parameters' must be an object")
    max_words = _positive(params.get("max_new_tokens"), "max_new_tokens")
    return Request(inputs, question_part(inputs), max_words, 1, stream)


def _tgi_details(r: Generated, tokens: int) -> dict:
    reason = "length" if r.finish[0] == "length" else "eos_token"
    return {"finish_reason": reason, "generated_tokens": tokens, "seed": None}


def tgi_body(r: Generated, resp_id: str, created: int, model: str) -> dict:
    return {"generated_text": r.answers[0], "details": _tgi_details(r, count_units(r.answers[0]))}


def _tgi_data(obj: Any) -> bytes:
    # axum's Event::json_data writes "data:" without a space.
    return b"data:" + _json(obj) + b"\n\n"


def tgi_events(
    r: Generated,
    resp_id: str,
    created: int,
    model: str,
    pieces: list[list[str]],
) -> tuple[list[bytes], int]:
    """One event per token; the last one carries ``generated_text`` and ``details``. An
    answer that ended by itself ends with the special end-of-sequence token."""
    tokens = [(piece, False) for piece in pieces[0]]
    if r.finish[0] != "length" or not tokens:
        tokens.append(("</s>", True))
    events = []
    for k, (text, special) in enumerate(tokens, start=1):
        last = k == len(tokens)
        events.append(
            _tgi_data(
                {
                    "index": k,
                    "token": {"id": 1000 + k, "text": text, "logprob": -0.25, "special": special},
                    "generated_text": r.answers[0] if last else None,
                    "details": {**_tgi_details(r, k), "input_length": count_units(r.prompt)}
                    if last
                    else None,
                    "top_tokens": None,
                }
            )
        )
    return events, 0


TGI_ERROR_EVENT = _tgi_data(
    {"error": "Request failed during generation: engine overloaded", "error_type": "generation"}
)


def tgi_error(message: str, status: int) -> dict:
    return {"error": message, "error_type": "validation" if status < 500 else "generation"}


# --- vLLM's demo /generate ----------------------------------------------------------------------


def vllm_request(body: dict) -> Request:
    """``prompt`` and flat sampling parameters (``max_tokens``, ``n``)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise FormatError("'prompt' must be a string")
    max_words = _positive(body.get("max_tokens"), "max_tokens")
    n = _positive(body.get("n"), "n") or 1
    return Request(prompt, question_part(prompt), max_words, n, _stream_flag(body))


def vllm_body(r: Generated, resp_id: str, created: int, model: str) -> dict:
    return {"text": [r.prompt + text for text in r.answers]}


def vllm_events(
    r: Generated,
    resp_id: str,
    created: int,
    model: str,
    pieces: list[list[str]],
) -> tuple[list[bytes], int]:
    """One JSON object a line, every sequence's text so far (prompt included)."""
    sent = [""] * len(pieces)
    lines = []
    for step in range(max((len(p) for p in pieces), default=0)):
        for i, p in enumerate(pieces):
            if step < len(p):
                sent[i] += p[step]
        lines.append(json.dumps({"text": [r.prompt + s for s in sent]}).encode() + b"\n")
    return lines, 0


def vllm_error(message: str, status: int) -> dict:
    return {"error": message}
