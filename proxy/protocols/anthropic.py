"""Anthropic Messages API: ``POST /v1/messages``.

Request: ``system`` (a string or text blocks) and ``messages`` (``role`` + ``content``, a
string or a list of content blocks). Response: a ``message`` object whose ``content`` is a
list of blocks, or, streamed, Server-Sent Events named by ``event:`` lines (the same name is
in the data's ``type``)::

    message_start         {"message": {"model": ..., "content": []}}
    content_block_start   {"index": i, "content_block": {"type": "text", "text": ""}}
    content_block_delta   {"index": i, "delta": {"type": "text_delta", "text": ...}}
                          (also input_json_delta.partial_json, thinking_delta.thinking;
                           signature_delta and citations_delta carry no output text)
    content_block_stop    {"index": i}
    message_delta         {"delta": {"stop_reason": ...}, "usage": {...}}
    message_stop          {}
    ping                  {}
    error                 {"error": {"type": "overloaded_error", "message": ...}}

Unknown event types are ignored: Anthropic documents that new ones may be added.

Output text is what the model wrote: text, thinking, and tool-use input (JSON). Blocks are
separated by ``"\\n"``, streamed or whole, so both give the detector the same text (up to the
spacing of tool-use JSON, which a whole body has re-serialised). There is one output per
message: every delta is choice 0.

The failure policy is the OpenAI module's: whole bodies raise :class:`ProtocolError`,
streams never raise and count ``malformed_events``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

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

ROUTE = "messages"

# Blocks whose text a model wrote, and the key that holds it. These tables are looked up
# with ``type_of``, None for an object without a string type (it finds nothing).
_MODEL_TEXT_KEYS: dict[str | None, str] = {"text": "text", "thinking": "thinking"}
# Blocks that call a tool: their "input" object is model-written JSON.
_TOOL_USE_TYPES = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
# Blocks that carry tool output or documents back to the model: prompt text.
_RESULT_TYPES = frozenset({"tool_result", "mcp_tool_result", "search_result"})
# Streamed delta types and the key of their text.
_DELTA_KEYS: dict[str | None, str] = {
    "text_delta": "text",
    "input_json_delta": "partial_json",
    "thinking_delta": "thinking",
}


def route_for(method: str, path: str) -> str | None:
    """``"messages"`` for ``POST .../v1/messages`` (any prefix, query and one trailing slash
    ignored), else ``None``. The segment before ``messages`` must be ``v1``: OpenAI's
    Assistants API has ``POST /v1/threads/{id}/messages``, which generates nothing."""
    if method.upper() != "POST":
        return None
    path = path.partition("?")[0].partition("#")[0]
    if path.endswith("/"):
        path = path[:-1]
    head, _, last = path.rpartition("/")
    if last == "messages" and head.rpartition("/")[2] == "v1":
        return ROUTE
    return None


def parse_request(kind: str, body: bytes) -> ParsedRequest:
    """The prompt of a Messages request: ``system``, then every message's content blocks in
    order (text, thinking, tool-use input as JSON, tool results, text documents, search
    results; images and other binary blocks contribute nothing). ``model_text`` is what
    the ``assistant`` turns hold; ``user`` is ``metadata.user_id``.

    Raises :class:`ProtocolError` if the body is not a JSON object, ``messages`` is not a
    list of objects, or a field read here has the wrong type.
    """
    obj = load_object(body)
    try:
        pieces: list[str] = []
        model_pieces: list[str] = []
        _content_texts(obj.get("system"), pieces)
        messages = obj.get("messages")
        if not isinstance(messages, list):
            raise Shape("'messages' must be a list")
        for message in messages:
            if not isinstance(message, dict):
                raise Shape("each message must be an object")
            _content_texts(message.get("content"), pieces)
            if message.get("role") == "assistant":
                _content_texts(message.get("content"), model_pieces)
        stream = obj.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise Shape("'stream' must be a boolean")
        metadata = obj.get("metadata")
        user = None
        if isinstance(metadata, dict):
            user = opt_str(metadata, "user_id")
        elif metadata is not None:
            raise Shape("'metadata' must be an object")
        return ParsedRequest(
            prompt="\n".join(pieces),
            model_text="\n".join(model_pieces),
            stream=bool(stream),
            model=opt_str(obj, "model"),
            n=1,
            user=user,
            turns_known=True,
        )
    except Shape as exc:
        raise ProtocolError(f"{kind} request: {exc}") from None


def parse_response(kind: str, body: bytes) -> list[OutputDelta]:
    """One :class:`OutputDelta` (choice 0) with the text of a ``message`` body's content
    blocks joined by ``"\\n"``. Raises :class:`ProtocolError` for an error body
    (``{"type": "error", ...}``) or any other shape without a ``content`` list."""
    obj = load_object(body)
    try:
        if obj.get("type") == "error":
            raise Shape("an error body")
        content = obj.get("content")
        if not isinstance(content, list):
            raise Shape("'content' must be a list")
        pieces: list[str] = []
        _content_texts(content, pieces)
        return [OutputDelta(0, "\n".join(pieces))]
    except Shape as exc:
        raise ProtocolError(f"{kind} response: {exc}") from None


@dataclass(slots=True)
class StreamParser:
    """Turn the events of one streamed message into output deltas (choice 0).

    * ``done``: ``message_stop`` was seen.
    * ``error``: the ``error`` object of an ``error`` event (the last one wins).
    * ``model``: from ``message_start``.
    * ``stop_reason``: from the last ``message_delta`` that has one.
    * ``malformed_events``: events that were not JSON objects, or had a wrong-typed field.

    The text of a block after the first one that had text is preceded by ``"\\n"``.
    """

    route: str = ROUTE
    done: bool = False
    error: dict[str, Any] | None = None
    model: str | None = None
    stop_reason: str | None = None
    malformed_events: int = 0
    _block: Any = None  # index of the block whose text came last
    _emitted: bool = False

    def feed(self, event: SSEEvent) -> list[OutputDelta]:
        """Consume one SSE event and return the output text it carries. Never raises."""
        obj = event_object(event, done_marker=False)
        if not isinstance(obj, dict):
            self.malformed_events += obj == MALFORMED
            return []
        kind = type_of(obj) or event.event
        try:
            if kind == "content_block_delta":
                delta = obj.get("delta")
                if not isinstance(delta, dict):
                    raise Shape("delta")
                key = _DELTA_KEYS.get(type_of(delta))
                return self._text(obj.get("index"), delta.get(key) if key else None)
            if kind == "content_block_start":
                block = obj.get("content_block")
                if not isinstance(block, dict):
                    raise Shape("content_block")
                key = _MODEL_TEXT_KEYS.get(type_of(block))
                return self._text(obj.get("index"), block.get(key) if key else None)
            if kind == "message_start":
                message = obj.get("message")
                if isinstance(message, dict) and isinstance(message.get("model"), str):
                    self.model = self.model or message["model"]
            elif kind == "message_delta":
                delta = obj.get("delta")
                if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                    self.stop_reason = delta["stop_reason"]
            elif kind == "message_stop":
                self.done = True
            elif kind == "error":
                err = obj.get("error")
                self.error = err if isinstance(err, dict) else {"message": str(err)}
        except Shape:
            self.malformed_events += 1
        return []

    def _text(self, index: Any, text: Any) -> list[OutputDelta]:
        if text is None or text == "":
            return []
        if not isinstance(text, str):
            raise Shape("text")
        if self._emitted and index != self._block:
            text = "\n" + text
        self._block = index
        self._emitted = True
        return [OutputDelta(0, text)]


# Anthropic's error types are a closed set (typed SDKs reject others): crosstalk's codes map
# onto the nearest one. A leak is content this caller may not have (permission_error, never
# retried by the SDKs); a failed detector is the gateway's own failure (api_error).
_ERROR_TYPES = {
    "cross_tenant_leak": "permission_error",
    "detector_failed": "api_error",
    "tenant_required": "authentication_error",
}
_KNOWN_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "overloaded_error",
    }
)


def error_body(message: str, *, type: str, code: str) -> bytes:
    """An Anthropic error body, ``{"type": "error", "error": {"type", "message"}}``, with an
    Anthropic error type (``code`` mapped, else ``type`` if Anthropic has it, else
    ``api_error``) and crosstalk's ``code`` as an extra key of the error object."""
    kind = _ERROR_TYPES.get(code) or (type if type in _KNOWN_TYPES else "api_error")
    return orjson.dumps(
        {"type": "error", "error": {"type": kind, "message": message, "code": code}}
    )


def error_event(message: str, *, type: str, code: str) -> bytes:
    """:func:`error_body` as an ``event: error`` SSE event, which Anthropic's SDKs raise as
    an API error (they skip events without an ``event:`` name)."""
    return b"event: error\ndata: " + error_body(message, type=type, code=code) + b"\n\n"


# --- helpers -------------------------------------------------------------------------------


def _content_texts(content: Any, out: list[str]) -> None:
    """Append the text of a ``content`` (or ``system``): a string or a list of blocks."""
    if isinstance(content, str):
        if content:
            out.append(content)
    elif isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                raise Shape("content blocks must be objects")
            _block_texts(block, out)
    elif content is not None:
        raise Shape("'content' must be a string, a list of blocks or null")


def _block_texts(block: dict[str, Any], out: list[str]) -> None:
    kind = type_of(block)
    key = _MODEL_TEXT_KEYS.get(kind)
    if key is not None:
        opt_text(block.get(key), out)
    elif kind in _TOOL_USE_TYPES:
        tool_input = block.get("input")
        if tool_input:  # {} (nothing yet) and null carry no text
            out.append(orjson.dumps(tool_input).decode())
    elif kind in _RESULT_TYPES:
        _content_texts(block.get("content"), out)
    elif kind == "document":
        opt_text(block.get("context"), out)
        source = block.get("source")
        if isinstance(source, dict):
            if source.get("type") == "text":
                opt_text(source.get("data"), out)
            elif source.get("type") == "content":
                _content_texts(source.get("content"), out)
    # Images, redacted thinking, web search results (encrypted) and other blocks: no text.
