"""Incremental Server-Sent Events decoder, per the WHATWG HTML standard ("Server-sent events").

The decoder is fed raw response-body chunks as they arrive and returns the events that each
chunk completes. It keeps only the unfinished tail between calls, so the work per chunk is
proportional to the chunk, not to the stream so far: feeding a stream one byte at a time is
linear.

Deviations from the browser ``EventSource`` behaviour, all deliberate:

* ``SSEEvent.event`` is ``None`` when no (or an empty) ``event:`` field was given, rather than
  the default type ``"message"``, so callers can tell the two apart.
* ``SSEEvent.retry`` carries the last valid ``retry:`` value seen in the event's own block;
  there is no reconnection, so it is informational only.
* Decoding never raises: invalid UTF-8 becomes U+FFFD.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from proxy.protocols import _wire

__all__ = ["SSEDecoder", "SSEEvent", "SSEFramer"]


class SSEEvent(NamedTuple):
    """One dispatched event (immutable; a named tuple, which is built for a third of a
    frozen dataclass's cost: one of these is made for every event of every stream).

    ``data`` is the event's ``data:`` lines joined with ``"\\n"`` (no trailing newline).
    ``id`` is the stream's *last event ID* at dispatch time: per the spec it persists across
    events until another ``id:`` field changes it (an empty ``id:`` resets it to ``None``).
    """

    data: str
    event: str | None = None
    id: str | None = None
    retry: int | None = None


class SSEDecoder(_wire.SSEDecoderCore):
    """Turn a byte stream, split at arbitrary points, into :class:`SSEEvent` objects.

    Behaviour, following the spec:

    * Lines end with ``\\r\\n``, ``\\n`` or ``\\r``. A ``\\r`` that ends one chunk and a ``\\n``
      that starts the next are one line ending.
    * UTF-8 is decoded incrementally (a character may be split across chunks); invalid bytes
      become U+FFFD. A single byte-order mark at the start of the stream is dropped.
    * Lines starting with ``:`` are comments (keep-alives) and are ignored, as are unknown
      fields. ``field:value`` loses one space after the colon; a line without a colon is a
      field name with an empty value.
    * A blank line dispatches the pending event. An event with no ``data`` field is not
      dispatched (but ``data:`` with an empty value is, with ``data == ""``).
    * ``id`` values containing U+0000 are ignored; ``retry`` values that are not all ASCII
      digits are ignored.

    Call :meth:`close` at end of stream. An unterminated event is discarded there, as the spec
    requires, and :attr:`truncated` records that it happened.
    """

    __slots__ = ()

    # ``feed(chunk)``, ``close()``, ``truncated`` and ``bytes_seen`` are the compiled
    # core's (``proxy.protocols._wire``); ``proxy.protocols.sse_reference.SSEDecoder`` is the
    # Python they are held to.

    def __init__(self) -> None:
        super().__init__(SSEEvent)


# A line ending is CRLF, LF or CR; an event ends at an empty line. Atomic groups keep
# "\r\n" one line ending (never "\r" then "\n"), which would end events early. The
# compiled cut (``_wire.frame_events``) finds what this finds; tests hold it to this.
_EVENT_END = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")


class SSEFramer:
    """Cuts a raw SSE byte stream into whole events, bytes unchanged.

    The enforcing proxy holds back and releases whole events; it needs their exact
    bytes, not decoded fields. ``feed`` returns the events completed by a chunk (each
    with its terminating blank line); ``close`` returns what is left (an unterminated
    event, or b""). A chunk ending in ``\\r`` is held until the next chunk shows whether
    a ``\\n`` follows.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        events, self._buffer = _wire.frame_events(self._buffer + chunk)
        return events

    def close(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest
