"""The Python implementation that the compiled step (``proxy.protocols._wire``)
replaced, kept as the reference it is held to (``tests/test_sse.py``): never on the
proxy's path. It returns exactly what the compiled class it names returns.
"""

from __future__ import annotations

import codecs
import contextlib

from proxy.protocols.sse import SSEEvent

__all__ = ["SSEDecoder"]

_BOM = "\ufeff"


class SSEDecoder:
    """``proxy.protocols.sse.SSEDecoder`` in Python (its docstring says what it does):
    the reference that the compiled ``_wire.SSEDecoderCore`` is held to."""

    __slots__ = (
        "_closed",
        "_data",
        "_decoder",
        "_event",
        "_has_fields",
        "_last_id",
        "_retry",
        "_skip_lf",
        "_started",
        "_tail",
        "_truncated",
        "bytes_seen",
    )

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # The unfinished last line, as pieces: joining only once the line ends keeps a long
        # line fed in small chunks linear instead of quadratic.
        self._tail: list[str] = []
        # True after a chunk ended in "\r": a "\n" opening the next text belongs to it.
        self._skip_lf = False
        self._started = False
        self._data: list[str] = []
        self._event: str | None = None
        self._retry: int | None = None
        self._last_id: str | None = None
        # Any non-comment line since the last dispatch, i.e. an event is under way.
        self._has_fields = False
        self._closed = False
        self._truncated = False
        #: Total number of bytes passed to :meth:`feed`.
        self.bytes_seen = 0

    @property
    def truncated(self) -> bool:
        """True after :meth:`close` if the stream ended inside an event or a line.

        Comment-only trailing lines do not count; a trailing partial line of any kind does.
        Always False before :meth:`close`.
        """
        return self._truncated

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume the next chunk of the body and return the events it completes, in order.

        Empty chunks are allowed. Raises :class:`RuntimeError` if called after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("SSEDecoder.feed() called after close()")
        self.bytes_seen += len(chunk)
        return self._feed_text(self._decode(chunk))

    def _decode(self, chunk: bytes) -> str:
        """The chunk's text. A chunk of whole, valid UTF-8 after a chunk that ended
        between characters (as most are) decodes in one call; the incremental decoder
        (a character split across chunks, invalid bytes) costs a Python frame more."""
        if not self._decoder.buffer:  # codecs.BufferedIncrementalDecoder: bytes held
            try:
                return chunk.decode()
            except UnicodeDecodeError:
                pass
        return self._decoder.decode(chunk)

    def close(self) -> list[SSEEvent]:
        """Signal end of stream and discard any unfinished event.

        Returns ``[]``: per the spec nothing is dispatched without its terminating blank line.
        (A list is returned so callers can treat it like :meth:`feed`.) Sets :attr:`truncated`
        if an event had started or a partial line, including an incomplete UTF-8 sequence,
        was pending. Calling it again is a no-op.
        """
        if self._closed:
            return []
        # Flushing can only yield U+FFFD for an incomplete sequence, never a line ending.
        events = self._feed_text(self._decoder.decode(b"", final=True))
        self._closed = True
        self._truncated = self._has_fields or bool(self._tail)
        self._tail = []
        self._data = []
        return events

    def _feed_text(self, text: str) -> list[SSEEvent]:
        if not text:
            # Leave _skip_lf alone: a chunk holding only part of a UTF-8 character decodes to
            # nothing, and the "\n" may still come next.
            return []
        if not self._started:
            self._started = True
            if text[0] == _BOM:
                text = text[1:]
                if not text:
                    return []
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                text = text[1:]
                if not text:
                    return []
        if "\r" in text:
            # Normalise to "\n" within this chunk only. "\r\n" first, so that "\r\r\n" is two
            # line endings, not three.
            if text[-1] == "\r":
                self._skip_lf = True
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            self._tail.append(text)
            return []
        if not self._tail and not self._has_fields and text.endswith("\n\n"):
            return self._whole_events(text)

        lines = text.split("\n")
        if self._tail:
            self._tail.append(lines[0])
            lines[0] = "".join(self._tail)
        last = lines.pop()
        self._tail = [last] if last else []

        events: list[SSEEvent] = []
        self._process_lines(lines, events)
        return events

    def _whole_events(self, text: str) -> list[SSEEvent]:
        """Text that starts and ends between events (no event under way, no partial
        line): as the general path would, block by block, where a block of one
        ``data: `` line, as servers send almost every event, is one event at once."""
        events: list[SSEEvent] = []
        for block in text[:-2].split("\n\n"):
            if block.startswith("data: ") and "\n" not in block:
                events.append(SSEEvent(block[6:], None, self._last_id, None))
            else:
                self._process_lines([*block.split("\n"), ""], events)  # "": its blank line
        return events

    def _process_lines(self, lines: list[str], events: list[SSEEvent]) -> None:
        for line in lines:
            if (event := self._process_line(line)) is not None:
                events.append(event)

    def _process_line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None
        self._has_fields = True
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or None
        elif name == "id":
            if "\0" not in value:
                self._last_id = value or None
        elif name == "retry" and value.isascii() and value.isdigit():
            # ValueError only past Python's int-from-str digit limit: absurd, so ignore it.
            with contextlib.suppress(ValueError):
                self._retry = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event, retry = self._data, self._event, self._retry
        self._data = []
        self._event = None
        self._retry = None
        self._has_fields = False
        if not data:
            return None
        return SSEEvent(
            data=data[0] if len(data) == 1 else "\n".join(data),
            event=event,
            id=self._last_id,
            retry=retry,
        )
