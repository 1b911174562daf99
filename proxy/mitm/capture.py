"""``crosstalk run --capture FILE``: write the proxied traffic as a mitmproxy flow file.

The file is what ``mitmdump -w`` writes (mitmproxy's ``FlowWriter``), readable by
mitmproxy and by ``crosstalk replay``. Two things differ from mitmproxy's own ``save``
addon, both needed for replay:

* Streamed bodies are kept. With ``flow.response.stream`` set (every SSE response),
  mitmproxy forwards chunks without keeping them. ``StreamTee`` wraps the stream
  callable the crosstalk addon installed and keeps the bytes *as received from
  upstream* (what the detector scanned; in enforce mode the client may have got less),
  partial ones too when the exchange breaks off, and the size and arrival time of
  every chunk (``CHUNKS_KEY``, 8 bytes a chunk) for a replay in the live order.
* Flows are written before the crosstalk addon's ``response`` hook, so a non-streamed
  response that enforce mode replaced with a 451 is saved as the upstream sent it; and
  the addon's per-flow state (``flow.metadata``, live objects) is left out: mitmproxy's
  writer would deep-copy it.

Order in the addon chain: ``CaptureWriter``, then ``CrossTalk``, then ``StreamTee``
(``capture_addons``). Each flow is written and flushed when it ends (``response`` or
``error``), so the file is in order of response end, readable while the proxy runs.
"""

from __future__ import annotations

import asyncio
import sys
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mitmproxy import http
from mitmproxy.io import FlowWriter

TEE_KEY = "crosstalk.tee"  # flow.metadata while live: the streamed body so far
#: flow.metadata as saved: how the streamed body arrived, chunk by chunk. Little-endian
#: uint32 pairs (chunk size in bytes, microseconds after response.timestamp_start), so
#: that replay feeds the detector the same chunks at the same times as it was fed live.
CHUNKS_KEY = "crosstalk.chunks"
#: flow.metadata as saved: when the crosstalk addon observed the prompt (epoch seconds).
OBSERVED_KEY = "crosstalk.observed_at"
#: flow.metadata as saved: when the ``response`` (or ``error``) hooks ran, i.e. when the
#: addon scanned a buffered body (or closed a broken exchange), right after this one.
ENDED_KEY = "crosstalk.ended_at"


@dataclass
class _Received:
    """A streamed body as it arrived."""

    start: float
    body: bytearray = field(default_factory=bytearray)
    timing: array = field(default_factory=lambda: array("I"))

    def add(self, chunk: bytes) -> None:
        self.body.extend(chunk)
        micros = int((time.time() - self.start) * 1e6)
        self.timing.extend((len(chunk), min(max(micros, 0), 0xFFFFFFFF)))

    def timing_bytes(self) -> bytes:
        timing = array("I", self.timing)
        if sys.byteorder == "big":
            timing.byteswap()
        return timing.tobytes()


def chunk_timing(blob: bytes, start: float) -> list[tuple[int, float]]:
    """``CHUNKS_KEY`` metadata -> [(chunk size, arrival time)]. Raises ValueError."""
    if len(blob) % 8:
        raise ValueError("chunk timing: not uint32 pairs")
    timing = array("I")
    timing.frombytes(blob)
    if sys.byteorder == "big":
        timing.byteswap()
    return [(timing[i], start + timing[i + 1] / 1e6) for i in range(0, len(timing), 2)]


class StreamTee:
    """Keeps the raw bytes of every streamed response body, and when each chunk came
    (added after CrossTalk, so it wraps the stream callable CrossTalk installed)."""

    def request(self, flow: http.HTTPFlow) -> None:
        def observed() -> None:
            flow.metadata[OBSERVED_KEY] = time.time()

        # CrossTalk observes the prompt on the next turn of the event loop; scheduled
        # after it (call_soon is FIFO), this notes when that happened, so that a replay
        # observes it between the same chunks of other streams as live.
        asyncio.get_running_loop().call_soon(observed)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        assert response is not None  # responseheaders: mitmproxy has the response
        inner = response.stream
        if not inner:
            return  # buffered: mitmproxy keeps the body itself
        received = _Received(response.timestamp_start or time.time())
        flow.metadata[TEE_KEY] = received

        def tee(chunk: bytes) -> Iterable[bytes] | bytes:
            if chunk:
                received.add(chunk)
            out = inner(chunk) if callable(inner) else chunk
            if not chunk:
                response.data.content = bytes(received.body)
            return out

        response.stream = tee


class CaptureWriter:
    """Writes each finished flow to a flow file (added before CrossTalk)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Appended: a capture is evidence, a restart must not overwrite it.
        self._file: IO[bytes] | None = self.path.open("ab")
        self._writer = FlowWriter(self._file)
        self.written = 0

    def response(self, flow: http.HTTPFlow) -> None:
        flow.metadata[ENDED_KEY] = time.time()
        self._write(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        flow.metadata[ENDED_KEY] = time.time()
        received = flow.metadata.get(TEE_KEY)
        if flow.response is not None and flow.response.raw_content is None and received:
            flow.response.data.content = bytes(received.body)  # what came before the break
        self._write(flow)

    def done(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, flow: http.HTTPFlow) -> None:
        if self._file is None:
            return
        metadata = flow.metadata
        # Only plain values are saved: the addon keeps live objects (its exchange
        # monitor) in metadata, which mitmproxy's writer would deep-copy and fail on.
        flow.metadata = {k: v for k, v in metadata.items() if _plain(v)}
        received = metadata.get(TEE_KEY)
        if isinstance(received, _Received) and received.timing:
            flow.metadata[CHUNKS_KEY] = received.timing_bytes()
        try:
            self._writer.add(flow)
            self._file.flush()
            self.written += 1
        finally:
            flow.metadata = metadata


def _plain(value: object) -> bool:
    if value is None or isinstance(value, str | bytes | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def capture_addons(path: str | Path) -> tuple[CaptureWriter, StreamTee]:
    """The two capture addons: add the writer before CrossTalk, the tee after it.
    Raises OSError when ``path`` cannot be opened for appending."""
    return CaptureWriter(path), StreamTee()
