# cython: language_level=3, boundscheck=False, wraparound=False
"""The per-event steps of a streamed response, compiled (issue 16): SSE decoding, and
reading an OpenAI stream's events; and cutting a byte stream into whole events.

Every event of every stream is decoded and read here, a hundred or more per answer: in
Python they took ~1.2 and ~2.5 us an event, a fifth of a replay's time.
``SSEDecoderCore`` does what ``proxy.protocols.sse_reference.SSEDecoder`` does, step for
step (``proxy.protocols.sse.SSEDecoder`` is the class the proxy uses; ``tests/test_sse.py``
holds the two to the same events). ``openai_event_deltas`` reads the events of the usual
shape and declines the others, which ``openai.StreamParser.read_event`` reads
(``tests/test_protocols_openai.py`` holds the two to the same deltas and state).
``frame_events`` cuts as ``sse._EVENT_END`` does (``tests/test_enforce.py`` holds it to
the pattern).
"""

import codecs

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_Tailmatch
from libc.string cimport memchr

cdef extern from "Python.h":
    Py_ssize_t PyUnicode_FindChar(object, Py_UCS4, Py_ssize_t, Py_ssize_t, int) except -2
    Py_ssize_t PyUnicode_Find(object, object, Py_ssize_t, Py_ssize_t, int) except -2

cdef str BOM = "\ufeff"
# Makes an event without the named tuple's Python-level __new__ (half its cost).
cdef object tuple_new = tuple.__new__


cdef class SSEDecoderCore:
    """``sse.SSEDecoder``'s state and steps (its docstring says what they do). Its
    events are of ``event_type``, a named tuple of (data, event, id, retry)."""

    cdef object event_type
    cdef object _decoder  # the incremental UTF-8 decoder (made when first needed)
    cdef bint _decoder_holds  # it holds the first bytes of a character
    # The unfinished last line, as pieces: joining only once the line ends keeps a long
    # line fed in small chunks linear instead of quadratic.
    cdef list _tail
    # True after a chunk ended in "\r": a "\n" opening the next text belongs to it.
    cdef bint _skip_lf
    cdef bint _started
    cdef list _data
    cdef object _event
    cdef object _retry
    cdef object _last_id
    # Any non-comment line since the last dispatch, i.e. an event is under way.
    cdef bint _has_fields
    cdef bint _closed
    cdef bint _truncated
    #: Total number of bytes passed to ``feed``.
    cdef public Py_ssize_t bytes_seen

    def __init__(self, event_type):
        self.event_type = event_type
        self._tail = []
        self._data = []

    @property
    def truncated(self):
        """True after ``close`` if the stream ended inside an event or a line."""
        return self._truncated

    def feed(self, chunk):
        """The events ``chunk`` completes, in order (``sse.SSEDecoder.feed``)."""
        if self._closed:
            raise RuntimeError("SSEDecoder.feed() called after close()")
        if type(chunk) is not bytes:
            if not isinstance(chunk, (bytearray, memoryview)):
                raise TypeError(f"SSEDecoder.feed() takes bytes, not {type(chunk).__name__}")
            chunk = bytes(chunk)
        self.bytes_seen += len(<bytes>chunk)
        return self._feed_text(self._decode(chunk))

    cdef str _decode(self, bytes chunk):
        """A chunk of whole, valid UTF-8 after a chunk that ended between characters
        (as most are) decodes in one call; else the incremental decoder takes it."""
        if not self._decoder_holds:
            try:
                return chunk.decode()
            except UnicodeDecodeError:
                pass
        if self._decoder is None:
            self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = self._decoder.decode(chunk)
        self._decoder_holds = bool(self._decoder.buffer)
        return text

    def close(self):
        """End of stream: discards an unfinished event (``sse.SSEDecoder.close``)."""
        if self._closed:
            return []
        events = []
        if self._decoder_holds:
            # Flushing can only yield U+FFFD for an incomplete sequence, never a line end.
            events = self._feed_text(self._decoder.decode(b"", final=True))
            self._decoder_holds = False
        self._closed = True
        self._truncated = self._has_fields or bool(self._tail)
        self._tail = []
        self._data = []
        return events

    cdef list _feed_text(self, str text):
        if not text:
            # Leave _skip_lf alone: a chunk holding only part of a UTF-8 character decodes
            # to nothing, and the "\n" may still come next.
            return []
        if not self._started:
            self._started = True
            if text[0] == BOM:
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
            # Normalise to "\n" within this chunk only. "\r\n" first, so that "\r\r\n" is
            # two line endings, not three.
            if text[len(text) - 1] == "\r":
                self._skip_lf = True
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if "\n" not in text:
            self._tail.append(text)
            return []
        if not self._tail and not self._has_fields and text.endswith("\n\n"):
            return self._whole_events(text)
        cdef list lines = text.split("\n")
        if self._tail:
            self._tail.append(lines[0])
            lines[0] = "".join(self._tail)
        last = lines.pop()
        self._tail = [last] if last else []
        cdef list events = []
        self._lines(lines, events)
        return events

    cdef list _whole_events(self, str text):
        """Text that starts and ends between events: block by block, where a block of
        one ``data: `` line, as servers send almost every event, is one event at once.
        (``text[:-2].split("\\n\\n")``'s blocks, found in place.)"""
        cdef list events = []
        cdef Py_ssize_t start = 0, stop = len(text) - 2, end
        while True:
            end = PyUnicode_Find(text, "\n\n", start, stop, 1)
            if end < 0:
                end = stop
            if (
                PyUnicode_Tailmatch(text, "data: ", start, end, -1)
                and PyUnicode_FindChar(text, "\n", start, end, 1) < 0
            ):
                events.append(self._make_event(text[start + 6 : end], None, None))
            else:
                lines = text[start:end].split("\n")
                lines.append("")  # the block's blank line
                self._lines(lines, events)
            if end == stop:
                return events
            start = end + 2

    cdef int _lines(self, list lines, list events) except -1:
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return 0

    cdef object _make_event(self, str data, event, retry):
        return tuple_new(self.event_type, (data, event, self._last_id, retry))

    cdef object _line(self, str line):
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
            try:
                self._retry = int(value)
            except ValueError:
                pass  # only past Python's int-from-str digit limit: absurd, ignored
        return None

    cdef object _dispatch(self):
        cdef list data = self._data
        event, retry = self._event, self._retry
        self._data = []
        self._event = None
        self._retry = None
        self._has_fields = False
        if not data:
            return None
        return self._make_event(data[0] if len(data) == 1 else "\n".join(data), event, retry)


# --- an OpenAI stream's events ------------------------------------------------------------

import orjson

cdef object json_loads = orjson.loads
cdef object JSONDecodeError = orjson.JSONDecodeError


cdef bint plain_json_text(str text, Py_ssize_t start, Py_ssize_t end):
    """Whether ``text[start:end]`` is, as it stands, the body of a JSON string: no quote,
    backslash or control character (which JSON escapes), so it decodes to itself; and
    no lone surrogate, which orjson refuses (text decoded from bytes holds none)."""
    cdef Py_UCS4 c
    cdef Py_ssize_t i
    for i in range(start, end):
        c = text[i]
        if c < 0x20 or c == 0x22 or c == 0x5C or 0xD800 <= c <= 0xDFFF:
            return False
    return True


cdef object same_but_text(str data, tuple template, delta_type, parser):
    """The deltas of an event that is the template's event but for its one output
    string, which is plain JSON string content here too; else None. The prefix and the
    suffix are the template's text before and after that string: equal, they hold the
    same JSON, so the event reads as the template's with another string."""
    cdef str prefix = template[0], suffix = template[1]
    cdef Py_ssize_t n = len(data), a = len(prefix), b = len(suffix)
    if (
        n < a + b
        or not PyUnicode_Tailmatch(data, prefix, 0, n, -1)
        or not PyUnicode_Tailmatch(data, suffix, 0, n, 1)
        or not plain_json_text(data, a, n - b)
    ):
        return None
    index, finish = template[2], template[3]
    if finish is not None:
        parser.finish_reasons[index] = finish
    if n - b == a:
        return []
    return [tuple_new(delta_type, (index, data[a : n - b]))]


cdef object template_of(str data, bint chat, str text, index, finish):
    """The template of an event of one choice whose one output string is ``text``: the
    text before and after that string, found as ``"content":"text"`` (``"text":`` for
    completions) as it stands; else None. The string found there must be the choice's,
    not an equal one of another field (the choice's may be spaced or escaped): the
    event is read again with another string in its place, once a template, not once an
    event."""
    cdef Py_ssize_t length = len(text)
    if not plain_json_text(text, 0, length):
        return None
    cdef str key = "content" if chat else "text"
    cdef Py_ssize_t at = PyUnicode_Find(data, '"' + key + '":"' + text + '"', 0, len(data), 1)
    if at < 0:
        return None
    cdef Py_ssize_t start = at + len(key) + 4
    cdef str prefix = data[:start], suffix = data[start + length :], probe = text + "."
    try:
        choice = json_loads(prefix + probe + suffix)["choices"][0]
    except (JSONDecodeError, LookupError, TypeError):
        return None
    if type(choice) is not dict:
        return None
    value = (<dict>choice).get("delta") if chat else choice
    if type(value) is not dict or (<dict>value).get(key) != probe:
        return None
    return (prefix, suffix, index, finish)


def openai_event_deltas(parser, object data, str route, delta_type):
    """The output deltas of one OpenAI stream event (``data``, its SSE data) of the shape
    nearly every event has: a JSON object with a ``choices`` list whose choices carry a
    ``delta`` of at most two keys, ``content`` a string and the other ``role`` (chat), or
    a string or null ``text`` (completions). Records the event's ``model`` and finish
    reasons on ``parser`` as ``openai.StreamParser.read_event`` does, and returns what it
    returns (``delta_type(choice, text)`` each). Any other event (empty, ``[DONE]``, not
    JSON, an error, a field of another type or shape) changes nothing and is left to the
    Python step: None when its data was not parsed, else the JSON object parsed (so that
    a stream of other deltas, reasoning or tool calls, is not parsed twice an event).

    A stream's events differ mostly in their text: an event of one choice and one output
    string is kept as ``parser.template``, and the next one that is the same text around
    another plain string is answered without parsing its JSON (half of this step's
    time)."""
    if type(data) is not str:
        return None
    cdef tuple template = parser.template
    if template is not None:
        found = same_but_text(data, template, delta_type, parser)
        if found is not None:
            return found
    if not data or data[0] != "{":
        return None
    try:
        obj = json_loads(data)
    except JSONDecodeError:
        return None
    if type(obj) is not dict:
        return None
    cdef dict event = <dict>obj
    if event.get("error") is not None or event.get("object") == "error":
        return event
    choices = event.get("choices")
    if type(choices) is not list:
        return event
    cdef bint chat = route == "chat"
    cdef list out = [], finishes = []
    cdef Py_ssize_t position = 0
    cdef object one_text = None  # the output string of a choice that has one alone
    for choice in <list>choices:
        if type(choice) is not dict:
            return event
        index = (<dict>choice).get("index", position)
        position += 1
        if type(index) is not int:
            return event  # a bool, or not a number: malformed
        if chat:
            value = (<dict>choice).get("delta")
            text = None
            # {}: a last event, with its finish (tested as a dict, not against a new {})
            if value is not None and not (type(value) is dict and not <dict>value):
                if type(value) is not dict or len(<dict>value) > 2:
                    return event
                text = (<dict>value).get("content")
                if type(text) is not str or not (len(<dict>value) == 1 or "role" in value):
                    return event
                if len(<dict>value) == 1:
                    one_text = text
        else:
            text = (<dict>choice).get("text")
            if type(text) is str:
                one_text = text
            elif text is not None:
                return event
        if text:
            out.append(tuple_new(delta_type, (index, text)))
        finish = (<dict>choice).get("finish_reason")
        if type(finish) is str:
            finishes.append((index, finish))
    if parser.model is None:
        model = event.get("model")
        if type(model) is str:
            parser.model = model
    if finishes:
        reasons = parser.finish_reasons
        for index, finish in finishes:
            reasons[index] = finish
    if position == 1 and one_text is not None:
        parser.template = template_of(
            data, chat, one_text, index, finishes[0][1] if finishes else None
        )
    return out


# --- whole events of a byte stream ------------------------------------------------------


cdef inline Py_ssize_t line_end_at(const char* data, Py_ssize_t at, Py_ssize_t size) noexcept:
    """The length of the line ending at ``at`` ("\r\n" 2, "\r" or "\n" 1), 0 if there is
    none: one atomic group of ``sse._EVENT_END``, a "\r\n" never taken as "\r" alone."""
    if data[at] == b"\n":
        return 1
    if data[at] != b"\r":
        return 0
    return 2 if at + 1 < size and data[at + 1] == b"\n" else 1


cdef Py_ssize_t event_end(const char* data, Py_ssize_t start, Py_ssize_t size,
                          bint lf_only) noexcept:
    """Where the first event end at or after ``start`` ends (two line endings in a row,
    ``sse._EVENT_END``'s leftmost match within ``size``), or -1."""
    cdef Py_ssize_t at = start, first, second
    cdef const char* found
    while at < size:
        if lf_only:  # most streams: memchr finds the candidates
            found = <const char*>memchr(data + at, b"\n", size - at)
            if found == NULL:
                return -1
            at = found - data
        first = line_end_at(data, at, size)
        if first and at + first < size:
            second = line_end_at(data, at + first, size)
            if second:
                return at + first + second
        at += 1
    return -1


def frame_events(bytes buffer not None):
    """``sse.SSEFramer``'s cut of ``buffer``: the whole events in it, each with the blank
    line that ends it, and the rest, which the next chunk continues (``(events, rest)``,
    bytes unchanged). A last "\r" is left in the rest: a "\n" may follow it in the next
    chunk, and the two are one line ending."""
    cdef const char* data = PyBytes_AS_STRING(buffer)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(buffer), start = 0, end
    if size and data[size - 1] == b"\r":
        size -= 1
    cdef bint lf_only = memchr(data, b"\r", size) == NULL
    cdef list events = []
    while True:
        end = event_end(data, start, size, lf_only)
        if end < 0:
            break
        events.append(PyBytes_FromStringAndSize(data + start, end - start))
        start = end
    if start == 0:
        return events, buffer
    return events, PyBytes_FromStringAndSize(data + start, PyBytes_GET_SIZE(buffer) - start)
