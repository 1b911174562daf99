"""Tests for proxy.protocols.sse: spec behaviour, chunk-split invariance and linear cost."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.protocols import sse_reference
from proxy.protocols.sse import SSEDecoder, SSEEvent


def decode(*chunks: bytes) -> tuple[list[SSEEvent], bool]:
    """Feed chunks to a fresh decoder, close it; return (events, truncated)."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    events += decoder.close()
    return events, decoder.truncated


def split_at(blob: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(cuts)), len(blob)]
    return [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# --- strategies ----------------------------------------------------------------------------

# Field values: any text without line breaks (surrogates cannot be UTF-8 encoded). The
# alphabet leans on multi-byte characters so chunk splits often land inside one.
_value = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
        st.sampled_from("é€😀\ufeff :x"),
    ),
    max_size=12,
)
_eol = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def sse_streams(draw: st.DrawFn) -> tuple[bytes, list[SSEEvent]]:
    """A well-formed SSE stream and the events a correct decoder must produce from it."""
    parts: list[str] = []
    expected: list[SSEEvent] = []
    if draw(st.booleans()):
        parts.append("\ufeff")
    last_id: str | None = None
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            parts.append(":" + draw(_value) + draw(_eol))  # comment / keep-alive
        event = draw(st.none() | _value.filter(lambda v: v != ""))
        if event is not None:
            parts.append(f"event: {event}" + draw(_eol))
        if draw(st.booleans()):
            new_id = draw(_value.filter(lambda v: "\0" not in v))
            parts.append(f"id: {new_id}" + draw(_eol))
            last_id = new_id or None
        lines = draw(st.lists(_value, min_size=1, max_size=4))
        for line in lines:
            # With no space after the colon the value must not start with one (it would be
            # stripped); with a space any value round-trips.
            sep = ": " if line.startswith(" ") or draw(st.booleans()) else ":"
            parts.append("data" + sep + line + draw(_eol))
        # The blank line: after a lone "\r", a "\n" would merely complete that line ending.
        parts.append(draw(_eol.filter(lambda e: e != "\n" or not parts[-1].endswith("\r"))))
        expected.append(SSEEvent(data="\n".join(lines), event=event, id=last_id))
    return "".join(parts).encode(), expected


_noisy_bytes = st.lists(
    st.sampled_from(
        [b"data:", b"data: ", b"event:x", b"id:", b"retry:12", b":", b" ", b"x", b"\r", b"\n"]
        + [b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xef\xbb\xbf", b"\xff", b"\xe2\x82", b"\x00"]
    ),
    max_size=60,
).map(b"".join)


# --- properties ----------------------------------------------------------------------------


@given(sse_streams(), st.data())
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_any_split_yields_the_expected_events(
    stream: tuple[bytes, list[SSEEvent]], data: st.DataObject
) -> None:
    blob, expected = stream
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=12))
    assert decode(blob) == (expected, False)
    assert decode(*split_at(blob, cuts)) == (expected, False)


@given(_noisy_bytes, st.data())
@settings(max_examples=400)
def test_arbitrary_bytes_are_split_invariant_and_never_raise(
    blob: bytes, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=12))
    assert decode(*split_at(blob, cuts)) == decode(blob)


@given(st.binary(max_size=200))
def test_random_binary_never_raises(blob: bytes) -> None:
    events, _ = decode(*[blob[i : i + 1] for i in range(len(blob))])
    assert events == decode(blob)[0]


# --- exhaustive small splits -------------------------------------------------------------

MIXED = (
    "\ufeff: hello\r\n"
    "data: caf\u00e9 \u20ac\r"
    "data: \U0001f600\n"
    "\r\n"
    "event: delta\r"
    "data: two\r\r"
    "data:[DONE]\n\n"
).encode()
MIXED_EVENTS = [
    SSEEvent(data="caf\u00e9 \u20ac\n\U0001f600"),
    SSEEvent(data="two", event="delta"),
    SSEEvent(data="[DONE]"),
]


def test_every_two_and_three_way_split() -> None:
    assert decode(MIXED) == (MIXED_EVENTS, False)
    n = len(MIXED)
    for i in range(n + 1):
        assert decode(MIXED[:i], MIXED[i:]) == (MIXED_EVENTS, False), i
        for j in range(i, n + 1):
            assert decode(MIXED[:i], MIXED[i:j], MIXED[j:]) == (MIXED_EVENTS, False), (i, j)


def test_one_byte_at_a_time() -> None:
    assert decode(*[MIXED[i : i + 1] for i in range(len(MIXED))]) == (MIXED_EVENTS, False)


# --- spec details ----------------------------------------------------------------------------


def test_cr_then_lf_in_next_chunk_is_one_line_ending() -> None:
    # If the split "\r" | "\n" were two endings, the "\n" would be a blank line dispatching
    # "a" early, and "b" would become a second event.
    assert decode(b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n") == ([SSEEvent("a\nb")], False)


def test_cr_at_chunk_end_then_split_utf8_then_lf() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"") == []
    assert decoder.feed(b"\n") == []  # still the same line ending: no blank line yet
    assert decoder.feed(b"data: \xe2\x82") == []
    assert decoder.feed(b"\xac\r") == []
    assert decoder.feed(b"\r") == [SSEEvent("x\n\u20ac")]


def test_cr_cr_lf_is_two_line_endings() -> None:
    assert decode(b"data: a\r\r\n") == ([SSEEvent("a")], False)


def test_comments_and_keepalives_are_ignored() -> None:
    blob = b": keep-alive\n\n:\n\ndata: x\n: inside an event\ndata: y\n\n: ping\n\n"
    assert decode(blob) == ([SSEEvent("x\ny")], False)


def test_event_without_data_is_not_dispatched() -> None:
    events, _ = decode(b"event: ping\n\nid: 7\nretry: 10\n\ndata: x\n\n")
    # id persists (it is the last event ID); event type and retry do not carry over.
    assert events == [SSEEvent("x", id="7")]


def test_empty_data_field_is_dispatched() -> None:
    assert decode(b"data:\n\ndata\n\n")[0] == [SSEEvent(""), SSEEvent("")]
    assert decode(b"data:\ndata:\n\n")[0] == [SSEEvent("\n")]


def test_only_one_space_after_colon_is_removed() -> None:
    assert decode(b"data:  two\n\ndata:none\n\n")[0] == [SSEEvent(" two"), SSEEvent("none")]


def test_value_may_contain_colons() -> None:
    assert decode(b'data: {"a": "b:c"}\n\n')[0] == [SSEEvent('{"a": "b:c"}')]


def test_unknown_fields_are_ignored() -> None:
    assert decode(b"foo: bar\ndata: x\nDATA: y\n\n")[0] == [SSEEvent("x")]


def test_id_persists_and_nul_ids_are_ignored() -> None:
    blob = b"id: 1\ndata: a\n\ndata: b\n\nid: 2\0\ndata: c\n\nid\ndata: d\n\n"
    events, _ = decode(blob)
    assert [e.id for e in events] == ["1", "1", "1", None]


def test_retry_must_be_ascii_digits() -> None:
    blob = b"retry: 3000\ndata: a\n\nretry: 3s\ndata: b\n\nretry: \xd9\xa3\ndata: c\n\n"
    events, _ = decode(blob)
    assert [e.retry for e in events] == [3000, None, None]
    assert decode(b"retry: " + b"9" * 5000 + b"\ndata: x\n\n")[0] == [SSEEvent("x")]


def test_event_type() -> None:
    events, _ = decode(b"event: error\ndata: {}\n\nevent:\ndata: x\n\n")
    assert events == [SSEEvent("{}", event="error"), SSEEvent("x")]


def test_bom_only_at_stream_start_and_only_once() -> None:
    assert decode(b"\xef\xbb\xbfdata: x\n\n")[0] == [SSEEvent("x")]
    assert decode(b"\xef", b"\xbb", b"\xbf", b"data: x\n\n")[0] == [SSEEvent("x")]
    # A second BOM is part of the first line, so that line is an unknown field.
    assert decode(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n")[0] == [SSEEvent("y")]
    assert decode(b"data: \xef\xbb\xbfx\n\n")[0] == [SSEEvent("\ufeffx")]


def test_invalid_utf8_becomes_replacement_char() -> None:
    assert decode(b"data: a\xffb\xe2\x82\n\n")[0] == [SSEEvent("a\ufffdb\ufffd")]


def test_openai_style_stream_with_done_and_error_event() -> None:
    blob = (
        b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n'
        b": OPENROUTER PROCESSING\n\n"
        b'event: error\ndata: {"error":{"message":"boom"}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert decode(blob) == (
        [
            SSEEvent('{"choices":[{"delta":{"content":"Hi"}}]}'),
            SSEEvent('{"error":{"message":"boom"}}', event="error"),
            SSEEvent("[DONE]"),
        ],
        False,
    )


# --- end of stream ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("blob", "truncated"),
    [
        (b"", False),
        (b"data: a\n\n", False),
        (b"data: a\r\n\r\n: bye\n", False),  # a trailing complete comment is not an event
        (b"data: a\n\ndata: b\n", True),  # event without its blank line
        (b"data: a\n\nevent: x\n", True),  # an event had started, even without data
        (b"data: a\n\ndata: b", True),  # partial line
        (b"data: a\n\n: partial comm", True),
        (b"data: a\n\n\xe2\x82", True),  # incomplete UTF-8 sequence
    ],
)
def test_close_discards_unfinished_event_and_reports_truncation(
    blob: bytes, truncated: bool
) -> None:
    decoder = SSEDecoder()
    events = decoder.feed(blob)
    assert not decoder.truncated  # only known at close
    assert decoder.close() == []
    assert decoder.truncated is truncated
    assert events == ([SSEEvent("a")] if blob else [])


def test_close_is_idempotent_and_feed_after_close_raises() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"data: x")
    assert decoder.close() == []
    assert decoder.close() == []
    assert decoder.truncated
    with pytest.raises(RuntimeError):
        decoder.feed(b"\n\n")


def test_bytes_seen_counts_raw_bytes() -> None:
    decoder = SSEDecoder()
    decoder.feed(b"\xef\xbb\xbfdata: \xe2")
    decoder.feed(b"\x82\xac\r")
    decoder.feed(b"")
    assert decoder.bytes_seen == 13


# --- cost ----------------------------------------------------------------------------------


def _stream_of_size(size: int) -> tuple[bytes, int]:
    """A stream that is 7/8 one long data line, then small CRLF events with multi-byte text."""
    small = 'data: {"content": "\u20ac\U0001f600"}\r\n\r\n'
    count = (size // 8) // len(small.encode())
    blob = f"data: {'x' * (size * 7 // 8)}\n\n{small * count}".encode()
    return blob, 1 + count


def test_one_mebibyte_fed_one_byte_at_a_time() -> None:
    # The unfinished tail is the trap: the decoder must keep only it, never re-join or
    # re-scan what it already dispatched. (Its speed is measured in bench/, not here.)
    blob, count = _stream_of_size(1024 * 1024)
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for i in range(len(blob)):
        events += decoder.feed(blob[i : i + 1])
    events += decoder.close()
    assert len(events) == count
    assert events[0].data == "x" * (1024 * 1024 * 7 // 8)
    assert events[-1].data == '{"content": "\u20ac\U0001f600"}'
    assert not decoder.truncated


@given(st.lists(_noisy_bytes, max_size=8))
@settings(max_examples=400)
def test_chunks_cut_between_events_decode_as_one_byte_at_a_time(blocks: list[bytes]) -> None:
    """Chunks that each end with a blank line, as most servers write them (the decoder's
    whole-event path), give what the line-by-line path gives."""
    chunks = [block + b"\n\n" for block in blocks]
    blob = b"".join(chunks)
    assert decode(*chunks) == decode(*[blob[i : i + 1] for i in range(len(blob))])


# --- the compiled decoder and its Python reference -----------------------------------------


def both_decode(chunks: list[bytes]) -> None:
    """The compiled decoder and ``sse_reference.SSEDecoder`` return the same events after
    every chunk, the same ``truncated`` and ``bytes_seen``, and both refuse a feed
    after close."""
    compiled, python = SSEDecoder(), sse_reference.SSEDecoder()
    for chunk in chunks:
        assert compiled.feed(chunk) == python.feed(chunk)
    assert compiled.close() == python.close()
    assert (compiled.truncated, compiled.bytes_seen) == (python.truncated, python.bytes_seen)
    assert compiled.close() == python.close() == []
    for decoder in (compiled, python):
        with pytest.raises(RuntimeError):
            decoder.feed(b"data: x\n\n")


@given(
    st.one_of(sse_streams().map(lambda s: s[0]), _noisy_bytes, st.binary(max_size=80)), st.data()
)
@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
def test_the_compiled_decoder_is_the_reference_one(blob: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=12))
    both_decode(split_at(blob, cuts))


def test_the_compiled_decoder_is_the_reference_one_on_every_split_of_mixed() -> None:
    for i in range(len(MIXED) + 1):
        for j in range(i, len(MIXED) + 1):
            both_decode([MIXED[:i], MIXED[i:j], MIXED[j:]])
    both_decode([MIXED[i : i + 1] for i in range(len(MIXED))])
    both_decode([bytearray(MIXED), bytearray(b"data: x\n\n")])


def test_feed_takes_bytes_and_refuses_what_is_not() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(memoryview(b"data: x\n\n")) == [SSEEvent("x")]
    for chunk in (3, "data: x\n\n", None):
        with pytest.raises(TypeError, match="takes bytes"):
            decoder.feed(chunk)
    assert decoder.bytes_seen == 9
