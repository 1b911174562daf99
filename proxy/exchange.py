"""One proxied LLM exchange, as the detector sees it: bytes in, deltas to the engine.

``ExchangeMonitor`` sits between the proxy's hooks and the engine. It decodes the
response body (content-encoding, SSE, the API's JSON), feeds every output delta to the
engine's ``ResponseScan`` and keeps what the exchange log needs. It has no mitmproxy
imports: the addon hands it raw chunks, tests and replay can do the same.

The detector must never break clean traffic. Every engine or parser failure is caught
here: the exchange carries on unscanned ("fails open"), ``detector_error`` says why,
and the caller logs it once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .decoding import Decoder, UnsupportedEncoding, stream_decoder
from .engine import Finding, ResponseScan
from .protocols.openai import OutputDelta, ProtocolError, Route, StreamParser, parse_response
from .sse import SSEDecoder

FindingsCallback = Callable[["ExchangeMonitor", list[Finding]], None]


@dataclass
class ExchangeMonitor:
    """Per-exchange state: identity, timings, the scan, and what was seen."""

    route: Route
    tenant: str
    request_id: str
    scan: ResponseScan | None
    on_findings: FindingsCallback
    model: str | None = None
    stream: bool = False
    prompt_chars: int = 0
    started: float = field(default_factory=time.monotonic)
    first_output: float | None = None
    output_chars: int = 0
    findings: list[Finding] = field(default_factory=list)
    detector_error: str | None = None
    upstream_error: dict | None = None
    truncated: bool = False
    _decode: Decoder | None = None
    _sse: SSEDecoder | None = None
    _parser: StreamParser | None = None

    # -- streamed responses ----------------------------------------------------------

    def start_stream(self, content_encoding: str | None) -> None:
        self.stream = True
        self._sse = SSEDecoder()
        self._parser = StreamParser(self.route)
        try:
            self._decode = stream_decoder(content_encoding)
        except UnsupportedEncoding as e:
            self._fail(e)

    def on_chunk(self, chunk: bytes) -> None:
        """One raw chunk of the SSE body, as received; ``b""`` at the end."""
        if self.first_output is None and chunk:
            self.first_output = time.monotonic()
        if self.detector_error is not None or self._sse is None or self._decode is None:
            return
        try:
            plain = self._decode(chunk)
            events = self._sse.feed(plain) if chunk else self._sse.close()
            for event in events:
                self._deliver(self._parser.feed(event))
            if not chunk:
                self.truncated = self._sse.truncated or not self._parser.done
                self.upstream_error = self._parser.error
                self.model = self.model or self._parser.model
                self._finish()
        except Exception as e:  # noqa: BLE001 -- fail open, reported by the caller
            self._fail(e)

    # -- whole responses ---------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        """A whole (decoded) non-streamed response body."""
        self.first_output = self.first_output or time.monotonic()
        if self.detector_error is not None:
            return
        try:
            deltas = parse_response(self.route, body)
        except ProtocolError as e:
            self.detector_error = f"response not understood: {e}"
            self._finish()
            return
        try:
            self._deliver(deltas)
            self._finish()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def close(self) -> None:
        """The exchange ended without a normal end of body (error, disconnect)."""
        if self.detector_error is None:
            try:
                self._finish()
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    # -- internals -------------------------------------------------------------------

    def _deliver(self, deltas: list[OutputDelta]) -> None:
        for delta in deltas:
            self.output_chars += len(delta.text)
            if self.scan is not None:
                self._report(self.scan.feed(delta.text, delta.choice))

    def _finish(self) -> None:
        if self.scan is not None and not self.scan.finished:
            self._report(self.scan.finish())

    def _report(self, findings: list[Finding]) -> None:
        if findings:
            self.findings += findings
            self.on_findings(self, findings)

    def _fail(self, error: Exception) -> None:
        self.detector_error = f"{type(error).__name__}: {error}"

    @property
    def verdict(self) -> str:
        return "leak" if self.findings else "clean"

    @property
    def ttft_ms(self) -> float | None:
        if self.first_output is None:
            return None
        return round((self.first_output - self.started) * 1000, 2)
