"""OpenAI Responses API: ``POST /v1/responses`` (also served by vLLM and SGLang).

Request: ``instructions`` (the system prompt) and ``input``, a string or a list of items:
messages (``role`` + ``content``, a string or ``input_text``/``output_text``/``refusal``
parts), function calls and their outputs, reasoning items, custom tool calls, MCP calls.
State kept by the server (``previous_response_id``, ``conversation``) is not in the request
and cannot be observed here.

Response: a ``response`` object whose ``output`` is a list of items, or, streamed, events
whose data carries a ``type`` (also on the ``event:`` line) and a ``sequence_number``::

    response.created / response.in_progress / response.queued     {"response": {...}}
    response.output_item.added, response.content_part.added        (no text yet)
    response.output_text.delta            {"output_index", "content_index", "delta"}
    response.refusal.delta, response.reasoning_text.delta,
    response.reasoning_summary_text.delta, response.function_call_arguments.delta,
    response.custom_tool_call_input.delta, response.mcp_call_arguments.delta,
    response.code_interpreter_call_code.delta, response.shell_call_command.delta,
    response.audio.transcript.delta       (model-written text: scanned)
    response.*.done, response.output_item.done                     (repeat the text: skipped)
    response.completed / response.incomplete                        (end)
    response.failed                       {"response": {"error": {...}}}  (end, an error)
    error                                 {"code", "message", "param"}, or {"error": {...}}

There is no ``data: [DONE]``. There is one output per response: every delta is choice 0;
the text of another item or content part is preceded by ``"\\n"``, as a whole body joins
its pieces.

The failure policy is the OpenAI module's: whole bodies raise :class:`ProtocolError`,
streams never raise and count ``malformed_events``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.protocols import openai
from proxy.protocols.openai import (
    OutputDelta,
    ParsedRequest,
)
from proxy.protocols.shapes import (
    MALFORMED,
    ProtocolError,
    Shape,
    event_object,
    load_object,
    opt_str,
    opt_text,
    type_of,
)
from proxy.protocols.sse import SSEEvent

__all__ = [
    "StreamParser",
    "error_body",
    "error_event",
    "parse_request",
    "parse_response",
    "route_for",
]

ROUTE = "responses"

# Streamed events whose "delta" is model-written text.
_DELTA_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.mcp_call_arguments.delta",
        "response.code_interpreter_call_code.delta",
        "response.shell_call_command.delta",
        "response.audio.transcript.delta",
    }
)
_START_EVENTS = frozenset({"response.created", "response.in_progress", "response.queued"})
_END_EVENTS = frozenset({"response.completed", "response.incomplete"})
# Content-part types with text, and the key that holds it (looked up with ``type_of``,
# None for a part without a string type: it finds nothing).
_PART_KEYS: dict[str | None, str] = {
    "input_text": "text",
    "output_text": "text",
    "text": "text",
    "refusal": "refusal",
    "summary_text": "text",
    "reasoning_text": "text",
}


def route_for(method: str, path: str) -> str | None:
    """``"responses"`` for ``POST .../responses`` (any prefix: ``/v1/responses``, Azure's
    ``/openai/v1/responses``; query and one trailing slash ignored), else ``None``.
    ``/v1/responses/{id}/cancel``, ``/v1/responses/compact`` and the like do not match."""
    if method.upper() != "POST":
        return None
    path = path.partition("?")[0].partition("#")[0]
    if path.endswith("/"):
        path = path[:-1]
    return ROUTE if path.rpartition("/")[2] == "responses" else None


def parse_request(kind: str, body: bytes) -> ParsedRequest:
    """The prompt of a Responses request: ``instructions``, then ``input`` (a string, or
    each item's text in order). ``model_text`` is what the model wrote: ``assistant``
    messages, reasoning, function/custom/MCP tool-call arguments. ``user`` is ``user``,
    else ``safety_identifier`` (its replacement).

    Raises :class:`ProtocolError` if the body is not a JSON object, ``input`` is neither a
    string, a list of objects nor absent, or a field read here has the wrong type.
    """
    obj = load_object(body)
    try:
        pieces: list[str] = []
        model_pieces: list[str] = []
        opt_text(obj.get("instructions"), pieces)
        items = obj.get("input")
        if isinstance(items, str):
            if items:
                pieces.append(items)
        elif isinstance(items, list):
            for item in items:
                if not isinstance(item, dict):
                    raise Shape("each input item must be an object")
                _item_texts(item, pieces, model_pieces)
        elif items is not None:
            raise Shape("'input' must be a string or a list of items")
        stream = obj.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise Shape("'stream' must be a boolean")
        return ParsedRequest(
            prompt="\n".join(pieces),
            model_text="\n".join(model_pieces),
            stream=bool(stream),
            model=opt_str(obj, "model"),
            n=1,
            user=opt_str(obj, "user") or opt_str(obj, "safety_identifier"),
            turns_known=True,
        )
    except Shape as exc:
        raise ProtocolError(f"{kind} request: {exc}") from None


def parse_response(kind: str, body: bytes) -> list[OutputDelta]:
    """One :class:`OutputDelta` (choice 0): the model-written text of a ``response``
    body's ``output`` items joined by ``"\\n"``. Raises :class:`ProtocolError` for an
    error body or any other shape without an ``output`` list."""
    obj = load_object(body)
    try:
        output = obj.get("output")
        if not isinstance(output, list):
            raise Shape("'output' must be a list")
        pieces: list[str] = []
        for item in output:
            if not isinstance(item, dict):
                raise Shape("each output item must be an object")
            _item_texts(item, pieces, pieces, output=True)
        return [OutputDelta(0, "\n".join(pieces))]
    except Shape as exc:
        raise ProtocolError(f"{kind} response: {exc}") from None


@dataclass(slots=True)
class StreamParser:
    """Turn the events of one streamed response into output deltas (choice 0).

    * ``done``: ``response.completed``, ``response.incomplete`` or ``response.failed``.
    * ``error``: from an ``error`` event (its ``error`` object, or the event's own
      ``code``/``message``/``param``) or ``response.failed``'s ``response.error``.
    * ``model``: from the first ``response.created``/``in_progress``/``queued``.
    * ``sequence_number``: the highest seen (the cut event is numbered after it).
    * ``malformed_events``: events that were not JSON objects, or a delta not a string.
    """

    route: str = ROUTE
    done: bool = False
    error: dict[str, Any] | None = None
    model: str | None = None
    status: str | None = None
    sequence_number: int = -1
    malformed_events: int = 0
    _part: Any = None  # (output_index, content/summary index) whose text came last
    _emitted: bool = False

    def feed(self, event: SSEEvent) -> list[OutputDelta]:
        """Consume one SSE event and return the output text it carries. Never raises."""
        obj = event_object(event, done_marker=False)
        if not isinstance(obj, dict):
            self.malformed_events += obj == MALFORMED
            return []
        seq = obj.get("sequence_number")
        if isinstance(seq, int) and seq > self.sequence_number:
            self.sequence_number = seq
        kind = type_of(obj) or event.event
        if kind in _DELTA_EVENTS:
            text = obj.get("delta")
            if not isinstance(text, str):
                self.malformed_events += 1
                return []
            if not text:
                return []
            part = (
                obj.get("output_index"),
                obj.get("content_index", obj.get("summary_index", kind)),
            )
            if self._emitted and part != self._part:
                text = "\n" + text
            self._part = part
            self._emitted = True
            return [OutputDelta(0, text)]
        if kind in _START_EVENTS or kind in _END_EVENTS or kind == "response.failed":
            response = obj.get("response")
            if isinstance(response, dict):
                if self.model is None and isinstance(response.get("model"), str):
                    self.model = response["model"]
                if isinstance(response.get("status"), str):
                    self.status = response["status"]
            if kind != "response.failed":
                self.done = self.done or kind in _END_EVENTS
                return []
            self.done = True
            err = response.get("error") if isinstance(response, dict) else None
            self.error = err if isinstance(err, dict) else {"message": "response failed"}
        elif kind == "error":
            err = obj.get("error")
            if isinstance(err, dict):
                self.error = err
            else:
                self.error = {k: obj.get(k) for k in ("code", "message", "param")}
        return []

    def error_event(self, message: str, *, type: str, code: str) -> bytes:
        """The event that ends a stream cut after what this parser has seen."""
        return error_event(message, type=type, code=code, sequence_number=self.sequence_number + 1)


def error_body(message: str, *, type: str, code: str) -> bytes:
    """The OpenAI error body (``{"error": {...}}``): the Responses API answers errors
    with the same envelope as the rest of OpenAI's API."""
    return openai.error_body(message, type=type, code=code)


def error_event(message: str, *, type: str, code: str, sequence_number: int = 0) -> bytes:
    """An ``error`` event. It carries ``code``/``message``/``param`` on the event itself,
    as OpenAI's API reference defines it, and the same in an ``error`` object, as
    OpenAI's servers send it: the openai-python SDK raises ``APIError`` only on the
    latter, other SDKs read the former."""
    err = {"type": type, "code": code, "message": message, "param": None}
    obj = {
        "type": "error",
        "sequence_number": sequence_number,
        "code": code,
        "message": message,
        "param": None,
        "error": err,
    }
    return b"event: error\ndata: " + orjson.dumps(obj) + b"\n\n"


# --- helpers -------------------------------------------------------------------------------


def _content_texts(content: Any, out: list[str]) -> None:
    """Append the text of a message's (or a tool output's) content: string or parts."""
    if isinstance(content, str):
        if content:
            out.append(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                raise Shape("content parts must be objects")
            key = _PART_KEYS.get(type_of(part))
            if key is not None:
                opt_text(part.get(key), out)
            # input_image, input_file, input_audio, ...: no text.
    elif content is not None:
        raise Shape("'content' must be a string, a list of parts or null")


def _item_texts(
    item: dict[str, Any], out: list[str], model_out: list[str], *, output: bool = False
) -> None:
    """Append an input or output item's text to ``out``, and to ``model_out`` too when the
    model wrote it. (For a response body both lists are the same: only model-written
    text is collected; tool outputs there came from elsewhere.)"""
    kind = type_of(item)
    if kind == "message" or (kind is None and "role" in item):
        pieces: list[str] = []
        _content_texts(item.get("content"), pieces)
        out.extend(pieces)
        if item.get("role") == "assistant" and model_out is not out:
            model_out.extend(pieces)
        return
    pieces = []
    if kind == "reasoning":
        _content_texts(item.get("summary"), pieces)
        _content_texts(item.get("content"), pieces)
    elif kind in ("function_call", "mcp_call"):
        opt_text(item.get("arguments"), pieces)
    elif kind == "custom_tool_call":
        opt_text(item.get("input"), pieces)
    elif not output and kind in (
        "function_call_output",
        "custom_tool_call_output",
        "mcp_call_output",
    ):
        _content_texts(item.get("output"), out)
        return
    # item_reference, web/file search calls, images, computer calls ...: no text.
    out.extend(pieces)
    if model_out is not out:
        model_out.extend(pieces)
