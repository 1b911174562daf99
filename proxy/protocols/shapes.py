"""What every API's parser shares: the error a body of the wrong shape raises, the
checks of a JSON value's type, and the JSON object an SSE event holds."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.protocols.sse import SSEEvent


class ProtocolError(ValueError):
    """A body that is not the JSON shape the OpenAI API defines.

    The caller should log it and pass the traffic through untouched. Its messages say
    what is wrong with the shape, never what the body holds.
    """

    quotes_no_text = True  # for the log (``redaction.error_text``)


class Shape(Exception):
    """Internal: a value has the wrong type. Becomes ProtocolError or a malformed count."""


#: What ``event_object`` returns for an event that holds no JSON object.
NOTHING, DONE_MARKER, MALFORMED = "nothing", "done", "malformed"


def type_of(obj: dict[str, Any]) -> str | None:
    """An object's ``type`` when it is a string: any other value (a list, a number) names
    no known kind, and must not reach a set or dict lookup (unhashable)."""
    kind = obj.get("type")
    return kind if isinstance(kind, str) else None


def event_object(event: SSEEvent, *, done_marker: bool = True) -> dict[str, Any] | str:
    """The JSON object an SSE event's data holds; else ``NOTHING`` (no data),
    ``DONE_MARKER`` (``data: [DONE]``, for the APIs that end with it) or ``MALFORMED``.
    Shared by every API's stream parser."""
    data = event.data
    if not data or data.isspace():
        return NOTHING
    if done_marker and data[0] != "{" and data.strip() == "[DONE]":
        return DONE_MARKER
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return MALFORMED
    return obj if isinstance(obj, dict) else MALFORMED


def load_object(body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"body is a JSON {type(obj).__name__}, not an object")
    return obj


def opt_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None or isinstance(value, str):
        return value
    raise Shape(f"{key!r} must be a string")


def opt_text(value: Any, out: list[str]) -> None:
    """Append ``value`` if it is a non-empty string; None is absent; anything else is bad."""
    if isinstance(value, str):
        if value:
            out.append(value)
    elif value is not None:
        raise Shape(f"expected a string, got {type(value).__name__}")
