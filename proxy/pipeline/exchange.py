"""One proxied LLM exchange, as the detector sees it: bytes in, deltas to the engine.

``ExchangeMonitor`` sits between the proxy's hooks and the engine. It decodes the
response body (content-encoding, SSE, the API's JSON), feeds every output delta to the
engine's ``ResponseScan`` and keeps what the exchange log needs. It has no mitmproxy
imports: the addon hands it raw chunks and forwards what it returns.

Shadow: every chunk is forwarded as it came. Enforce: the stream is cut into whole SSE
events, each scanned before it joins the holdback (``StreamGate``); on a finding the
held events are dropped and the client gets one error event in the API's format.

The detector must never break clean traffic. An engine or parser failure, or a scan
slower than the time budget, is caught here: the exchange carries on unscanned
("fails open", the held events are released) or, when configured, is cut ("fails
closed"); ``detector_error`` says why and the caller logs it once.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from proxy.engine import Finding, ResponseScan
from proxy.engine.tokens import words_in  # noqa: F401 -- part of this module's API
from proxy.pipeline._monitor import MonitorFields, expose
from proxy.pipeline.gate import StreamGate
from proxy.protocols import ParsedRequest, ProtocolError, Route, StreamParserLike, as_route
from proxy.protocols.decoding import Decoder, UnsupportedEncoding, stream_decoder
from proxy.protocols.sse import SSEDecoder, SSEFramer
from proxy.redaction import error_text


class OverBudget(TimeoutError):
    """A scan call over the time budget (the message gives its wall and CPU time)."""

    quotes_no_text = True  # for the log (``redaction.error_text``)


FindingsCallback = Callable[["ExchangeMonitor", list[Finding]], None]
BLOCK_MESSAGE = (
    "The response was stopped by crosstalk: it contained another tenant's data "
    "(cross-tenant leak in the serving engine)."
)
FAILED_CLOSED_MESSAGE = "The response was stopped by crosstalk: the leak detector failed."


class GcPauses:
    """Seconds the cyclic garbage collector has stopped this process for, so far, as
    ``gc.callbacks`` report them. A collection runs inside whatever call allocated last,
    often an engine call, and over a large heap takes tens of milliseconds: time that
    says nothing about the detector, so the time budget leaves it out.

    Each pause is measured twice: on the wall clock (what a stream waits) and in this
    thread's CPU time (what the collector itself costs). On a busy machine the first
    also holds the time the process was not scheduled while collecting."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        # Per generation (0, 1, 2): a full collection walks the whole tracked heap, a
        # young one only what was allocated since; which one stalls says what to shrink.
        self.longest = [0.0, 0.0, 0.0]
        self.longest_cpu = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: float | None = None
        self._started_cpu = 0.0

    def settle(self) -> None:
        """Start-up is over. What it built (modules, the engine's tables, the baseline)
        lives as long as the process: collected once, then frozen out of the collector's
        sight, so that a full collection walks only what exchanges made since. The
        longest pause is counted from here: start-up's stalled no stream."""
        gc.collect()
        gc.freeze()
        self.longest = [0.0, 0.0, 0.0]
        self.longest_cpu = [0.0, 0.0, 0.0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
        elif self._started is not None:
            pause = time.perf_counter() - self._started
            cpu = time.thread_time() - self._started_cpu
            generation = min(info.get("generation", 2), 2)
            self.seconds += pause
            self.cpu_seconds += cpu
            self.longest[generation] = max(self.longest[generation], pause)
            self.longest_cpu[generation] = max(self.longest_cpu[generation], cpu)
            self.collections[generation] += 1
            self._started = None


GC_PAUSES = GcPauses()
gc.callbacks.append(GC_PAUSES)


@dataclass(frozen=True, slots=True)
class Enforcement:
    """How an enforced exchange behaves (per tenant and route, from the policy)."""

    holdback_words: float = 16.0
    min_foreign_words: float = 0.0  # findings below this are logged, not blocked
    fail_closed: bool = False
    budget_ms: float = 50.0  # one scan call slower than this counts as a detector failure


def leak_event_fields(
    request_id: str, tenant: str, finding: Finding, action: str
) -> dict[str, Any]:
    """The fields of a ``leak.detected`` event, built in one place so that the live
    proxy and ``crosstalk replay`` (captures and journals) log findings identically.
    Ids, counts and keyed hashes only."""
    return {
        "request_id": request_id,
        "tenant": tenant,
        "source_tenant": finding.source_tenant,
        "source_request_id": finding.source_request_id,
        "action": action,
        "kind": finding.kind,
        "score": finding.score,
        "foreign_units": finding.foreign_units,
        "output_offset": [finding.start, finding.end],
        "detected_at": finding.detected_at,
        "choice": finding.choice,
        "evidence": finding.evidence,
    }


def _no_findings(monitor: ExchangeMonitor, findings: list[Finding]) -> None:
    """The findings callback of a released monitor (none can come)."""


@expose
@dataclass
class ExchangeMonitor(MonitorFields):
    """Per-exchange state: identity, timings, the scan, the gate, and what was seen.
    Every event's steps (``on_chunk``, ``_deliver``) are compiled, in ``MonitorFields``."""

    route: Route  # an OpenAI route name ("chat", "completions") is accepted too
    tenant: str
    request_id: str
    scan: ResponseScan | None
    on_findings: FindingsCallback
    enforcement: Enforcement | None = None  # None: shadow
    on_block: Callable[[ExchangeMonitor], None] | None = None
    model: str | None = None
    stream: bool = False
    prompt_chars: int = 0
    started: float = field(default_factory=time.monotonic)
    first_output: float | None = None
    ended: float | None = None  # the response's end (time.monotonic), once known
    output_chars: int = 0
    findings: list[Finding] = field(default_factory=list)
    blocked_by: Finding | None = None
    failed_closed: bool = False
    detector_error: str | None = None
    upstream_error: dict | None = None
    truncated: bool = False
    _decode: Decoder | None = None
    _sse: SSEDecoder | None = None
    _parser: StreamParserLike | None = None
    _framer: SSEFramer | None = None
    _gate: StreamGate | None = None
    keep_text: bool = False  # keep the output text (log_evidence_text)
    # The engine was still in its learning period when the exchange began: its findings
    # say so (``learning: true``), so that the cold start's false alarms can be told
    # apart, and enforce mode logs its fragment findings instead of blocking them
    # (entities and canaries still block).
    learning: bool = False
    # Shadow: feed the engine this many characters of output at a time (0: every
    # delta). Nothing waits on a shadow verdict, and the engine's cost is mostly per
    # call: batching a few words cuts the CPU it takes from mitmproxy's event loop.
    scan_batch_chars: int = 0
    # Output characters scanned at most (0: all; ``limits.max_scanned_output_chars``).
    # Beyond, the rest passes unscanned (``scan_capped``): an endless or huge answer
    # never costs more CPU than this, and enforce mode stops holding it back.
    max_scan_chars: int = 0
    scan_capped: bool = False
    # records the prompt (sets scan); a generator function when it runs in steps
    pending_observe: Callable[[], Generator[None, None, None] | None] | None = None
    # Shadow: where the work on the stream goes, ``defer(fn, *args)``, to run later in
    # order with all other deferred work (proxy/mitm/idle.py). None: at once. Chunks are
    # forwarded at once and parsed, observed and scanned later: nothing of the detector
    # runs on the path of a byte to the client.
    defer: Callable[..., None] | None = None
    # Observers set by other addons (proxy/mitm/degenerate_addon.py, proxy/mitm/metrics.py): every output
    # delta (choice, text), and the seconds each engine scan call took. An ``on_delta``
    # that raises is switched off for the exchange (never a detector failure).
    on_delta: Callable[[int, str], None] | None = None
    on_scan: Callable[[float], None] | None = None
    scan_seconds: float = 0.0  # the engine's scan calls on this exchange, in all
    _texts: dict[int, list[str]] = field(default_factory=dict)
    _batched: dict[int, list[str]] = field(default_factory=dict)
    _batched_chars: int = 0
    _unscanned: deque[bytes] = field(default_factory=deque)
    # Shadow with ``defer``: the batch of chunks of this exchange's last queued item, and
    # ``deferred_count()`` when it was queued (items queued so far; None: one item a chunk)
    deferred_count: Callable[[], int] | None = None
    _open_batch: deque[bytes] | None = None
    _queued_at: int = -1
    _cut_sent: bool = False
    # Enforce: this thread's CPU time and the collector's share of it when the call
    # being served (a chunk, a body, the end) began: see ``_over_budget``.
    _cpu_mark: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        self.route = as_route(self.route)

    @classmethod
    def begin(
        cls,
        route: Route,
        tenant: str,
        request_id: str,
        parsed: ParsedRequest | None,
        on_findings: FindingsCallback,
        *,
        scan_batch_chars: int,
        max_scan_chars: int,
        enforcement: Enforcement | None = None,
        on_block: Callable[[ExchangeMonitor], None] | None = None,
        learning: bool = False,
    ) -> ExchangeMonitor:
        """An exchange as the live proxy (``CrossTalk.request``) and a replay
        (``forensics.replayer``) begin it: who and which request, what its parsed body
        says (model, prompt size; nothing for a body that did not parse), and no scan
        until its prompt is observed."""
        return cls(
            route=route,
            tenant=tenant,
            request_id=request_id,
            scan=None,
            on_findings=on_findings,
            enforcement=enforcement,
            on_block=on_block,
            model=parsed.model if parsed else None,
            prompt_chars=len(parsed.prompt) if parsed else 0,
            scan_batch_chars=scan_batch_chars,
            learning=learning,
            max_scan_chars=max_scan_chars,
        )

    def __deepcopy__(self, memo: dict) -> None:
        """Live state (the engine's scan, callbacks): never part of a copied or saved
        flow. mitmproxy deep-copies ``flow.metadata`` when it saves a flow (``-w``)."""
        return None

    def release(self) -> None:
        """Let go of the callbacks, once the exchange has settled and nothing will run
        on it again. They close over the flow and this monitor: reference cycles that
        only a full collection frees, and it frees all the exchanges of the last minutes
        at once (measured in a detector process: 16-64 ms of its full collections)."""
        self.on_findings = _no_findings
        self.on_block = self.on_delta = self.on_scan = None
        self.pending_observe = self.defer = self.deferred_count = None

    def observe_steps(self) -> Generator[None, None, None] | None:
        """Record the prompt, in steps when ``pending_observe`` is a generator function
        (the idle queue runs one step per turn); None when there is nothing to record."""
        observe, self.pending_observe = self.pending_observe, None
        result = observe() if observe is not None else None
        return result if isinstance(result, Generator) else None

    # -- streamed responses ----------------------------------------------------------

    def start_stream(self, content_encoding: str | None) -> None:
        self.stream = True
        self._sse = SSEDecoder()
        self._parser = self.route.stream_parser()
        try:
            self._decode = stream_decoder(content_encoding)
        except UnsupportedEncoding as e:
            self._fail(e)
            return
        if self.enforcement is not None:
            if content_encoding not in (None, "", "identity"):
                # The gate releases whole events; compressed bytes cannot be cut into
                # events. The addon asks for identity encoding upstream in enforce mode.
                self._fail(UnsupportedEncoding(f"compressed stream ({content_encoding})"))
                return
            self._framer = SSEFramer()
            self._gate = StreamGate(self.enforcement.holdback_words)

    # on_chunk(chunk) -> list[bytes], and the shadow path it takes (_shadow_chunk,
    # _deliver): compiled, MonitorFields' (proxy/pipeline/_monitor.pyx).

    def _gated_chunk(self, chunk: bytes) -> list[bytes]:
        """``on_chunk`` of an enforced stream (the gate holds back its words)."""
        assert self._gate is not None  # on_chunk comes here only while the gate is on
        if self._gate.cut_done:
            return []
        self._mark_cpu()
        try:
            out = self._enforce_chunk(chunk)
        except Exception as e:  # noqa: BLE001 -- fail open/closed, reported by the caller
            self._fail(e)
            return self._after_failure(ended=not chunk)
        if self.blocked_by is not None:
            return out + self._cut(BLOCK_MESSAGE, "cross_tenant_leak")
        return out

    def when_settled(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the work on everything received so far is done: at once,
        or after the deferred work (``defer``). What reads the outcome (verdict,
        findings, counts) at the end of an exchange goes through here."""
        if self.defer is None:
            fn()
        else:
            self.defer(self._in_turn, fn)

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` now (its exceptions reach the caller, which fails open or
        closed), or deferred (a shadow exchange: a failure there fails open)."""
        if self.defer is None:
            fn(*args)
        else:
            self.defer(self._failing_open, fn, args)

    def _failing_open(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _queue_chunk(self, chunk: bytes) -> None:
        """Shadow with ``defer``: the chunk is parsed and scanned later, in this
        exchange's last queued item if nothing was queued after that item, else in a
        new one: work never runs ahead of what was queued before it arrived."""
        batch = self._open_batch
        count = self.deferred_count
        if batch is None or count is None or count() != self._queued_at:
            # Something else was queued after this exchange's last item (another
            # request's prompt, say): the chunk must not run before it.
            batch = self._open_batch = deque()
            assert self.defer is not None  # on_chunk queues a chunk only with defer
            self.defer(self._run_queued, batch)
            self._queued_at = count() if count is not None else -1
        batch.append(chunk)

    def _run_queued(self, batch: deque[bytes]) -> Generator[None, None, None]:
        """Queued chunks, one per step: the idle queue runs a step per turn, so the event
        loop is held for one chunk's parsing and scanning at a time, never for a
        backlog. Chunks that arrive while this item is still the last one join it."""
        while batch:
            self._in_turn(self._shadow_chunk, batch.popleft())
            if batch:
                yield
        if self._open_batch is batch:
            self._open_batch = None

    def _in_turn(self, fn: Callable[..., None], *args: Any) -> None:
        """Run deferred ``fn(*args)`` with the engine calls it makes done at once, in
        the same queued item: deferred again, they would fall behind what was queued
        meanwhile (the exchange's log, which must see the final scan)."""
        defer, self.defer = self.defer, None
        try:
            fn(*args)
        finally:
            self.defer = defer

    def _enforce_chunk(self, chunk: bytes) -> list[bytes]:
        # A failure before the stream (its prompt not observed) leaves it unscanned and
        # gated as it was; one while scanning it fails open or closed at once.
        failed_before = self.detector_error is not None
        # The gated stream's parts, all set by start_stream (on_chunk gates only then).
        assert self._framer is not None and self._sse is not None
        assert self._parser is not None and self._gate is not None
        self._unscanned.extend(self._framer.feed(chunk) if chunk else [])
        if not chunk and (rest := self._framer.close()):
            self._unscanned.append(rest)  # an unterminated last event: scanned, then sent
        while self._unscanned:
            raw = self._unscanned.popleft()
            before = self._scanned_words()
            try:
                for event in self._sse.feed(raw):
                    self._deliver(self._parser.feed(event))
            finally:
                # Held even when its parsing raised: released (fail open) with what the
                # gate holds, never parsed a second time with what was not parsed yet.
                # The gate counts the words the engine tokenised: no second pass.
                self._gate.push(raw, self._scanned_words() - before)
            if self.blocked_by is not None:
                return []
            if self.detector_error is not None and not failed_before:
                return self._after_failure(ended=not chunk)
            if self.scan_capped:
                return self._stop_gating(ended=not chunk)
        if chunk:
            return self._gate.release()
        self._sse.close()
        self._end_of_stream()
        return [] if self.blocked_by is not None else self._gate.flush()

    def _stop_gating(self, *, ended: bool) -> list[bytes]:
        """The scan reached ``max_scan_chars``: the words held back are checked to the
        end of what was scanned (the scan's finish; a leak there is still cut), then
        everything passes. The rest of the stream is still parsed (its counts, model
        and errors) but not scanned."""
        if self.scan is not None and not self.scan.finished:
            self._scan(self.scan.finish)
        if self.blocked_by is not None:
            return []  # on_chunk appends the cut
        return self._release_all(ended=ended)

    def _scanned_words(self) -> float:
        return self.scan.output_words if self.scan is not None else 0.0

    def _must_fail_closed(self) -> bool:
        return bool(
            self.detector_error and self.enforcement is not None and self.enforcement.fail_closed
        )

    def _after_failure(self, *, ended: bool) -> list[bytes]:
        """The detector failed mid-stream. Fail closed: cut. Fail open: release every
        byte received so far, in order, and pass the rest through unscanned."""
        if self._must_fail_closed():
            return self._cut_failed()
        return self._release_all(ended=ended)

    def _cut_failed(self) -> list[bytes]:
        return self._cut(FAILED_CLOSED_MESSAGE, "detector_failed")

    def _release_all(self, *, ended: bool) -> list[bytes]:
        """Stop gating: every byte held or received so far, in order; later chunks
        pass at once (the shadow path). The bytes released unscanned are still parsed,
        like later chunks: the exchange line counts all of the output and, once the
        stream ``ended``, says how it ended."""
        # Reached from the gated path only: start_stream set the framer, the gate is on.
        assert self._framer is not None and self._gate is not None
        unparsed = [*self._unscanned, self._framer.close()]
        out = [*self._gate.flush(), *filter(None, unparsed)]
        self._unscanned.clear()
        self._gate = None
        for raw in unparsed:
            if raw:
                self._shadow_chunk(raw)
        if ended:
            self._shadow_chunk(b"")
        return out

    def _cut(self, message: str, code: str) -> list[bytes]:
        """End the client's stream with one error event (once)."""
        if self._cut_sent:
            return []
        self._cut_sent = True
        if self.blocked_by is None:
            self.failed_closed = True
        if self._gate is not None:
            self._gate.cut()
        if self.on_block is not None:
            self.on_block(self)
        return [
            self.route.error_event(message, type="leak_blocked", code=code, parser=self._parser)
        ]

    # -- whole responses ---------------------------------------------------------------

    def on_body(self, body: bytes) -> None:
        """A whole (decoded) non-streamed response body."""
        self._mark_cpu()
        self.first_output = self.first_output or self.ended or time.monotonic()
        if self.detector_error is not None:
            return
        try:
            deltas = self.route.parse_response(body)
        except ProtocolError as e:
            self.detector_error = f"response not understood: {e}"
            self._finish()
            return
        try:
            self._deliver(deltas)
            self._finish()
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def undecodable(self, content_encoding: str | None, error: Exception) -> None:
        """The body could not be decoded: a detector failure that names the header's
        encoding and the error's type (the codec's message may quote the body)."""
        named = (content_encoding or "")[:40]
        self.detector_error = (
            f"body not decodable (content-encoding {named!r}): {error_text(error)}"
        )

    def close(self) -> None:
        """The exchange ended without a normal end of body (error, disconnect): keep
        what the stream said so far (an upstream error event, the model)."""
        self._mark_cpu()
        if self._parser is not None:
            self.upstream_error = self.upstream_error or self._parser.error
            self.model = self.model or self._parser.model
            self.truncated = self.truncated or not self._parser.done
        if self.detector_error is None:
            try:
                self._finish()
            except Exception as e:  # noqa: BLE001
                self._fail(e)

    # -- internals -------------------------------------------------------------------

    def _end_of_stream(self) -> None:
        # The end of a stream start_stream began (and the shadow path has its decoder).
        assert self._sse is not None and self._parser is not None
        self.truncated = self._sse.truncated or not self._parser.done
        self.upstream_error = self._parser.error
        self.model = self.model or self._parser.model
        self._finish()

    def _feed_batched(self) -> None:
        batched, self._batched, self._batched_chars = self._batched, {}, 0
        if batched:
            self._later(self._scan_batched, batched)

    def _scan_batched(self, batched: dict[int, list[str]]) -> None:
        if self.scan is None or self.detector_error is not None:
            return
        for choice, texts in batched.items():
            self._scan(self.scan.feed, "".join(texts), choice)

    def _finish(self) -> None:
        self._feed_batched()
        self._later(self._finish_scan)

    def _finish_scan(self) -> None:
        if self.scan is None or self.scan.finished or self.detector_error is not None:
            return
        self._scan(self.scan.finish)

    def _scan(self, call, *args) -> None:
        """One engine call: its findings reported, then its time held to the budget.
        Findings come first: a scan that ran late still found what it found (a leak in
        it is cut). Garbage-collector pauses inside the call are not the detector's."""
        start, paused = time.perf_counter(), GC_PAUSES.seconds
        found = call(*args)
        elapsed = time.perf_counter() - start - (GC_PAUSES.seconds - paused)
        self.scan_seconds += elapsed
        if self.on_scan is not None:
            self.on_scan(elapsed)
        self._report(found)
        if self.blocked_by is None and (over := self._over_budget(elapsed)):
            raise OverBudget(over)

    def _mark_cpu(self) -> None:
        if self.enforcement is not None:
            self._cpu_mark = (time.thread_time(), GC_PAUSES.cpu_seconds)

    def _over_budget(self, elapsed: float) -> str | None:
        """Why a scan that took ``elapsed`` seconds (wall clock, collections left out)
        broke the time budget, or None. Over budget on the wall clock, it is judged on
        this thread's CPU time since the call it serves began (an upper bound of its
        own): a machine too busy to schedule the process is not a slow detector, and
        failing then would cut (fail closed) or wave through (open) streams under load.
        A CPU clock reading costs a system call (~0.75 us): it is read once a call in
        enforce mode (``_mark_cpu``) and here only past the wall-clock budget."""
        budget_ms = self.enforcement.budget_ms if self.enforcement is not None else None
        if budget_ms is None or elapsed * 1000 <= budget_ms:
            return None
        cpu_then, collector_then = self._cpu_mark
        cpu = time.thread_time() - cpu_then - (GC_PAUSES.cpu_seconds - collector_then)
        if cpu * 1000 <= budget_ms:
            return None
        return (
            f"scan took {elapsed * 1000:.1f} ms, {cpu * 1000:.1f} ms of CPU (budget {budget_ms} ms)"
        )

    def _report(self, findings: list[Finding]) -> None:
        if not findings:
            return
        self.findings += findings
        if self.enforcement is not None and self.blocked_by is None:
            for finding in findings:
                if finding.kind != "fragment" or (
                    not self.learning
                    and finding.foreign_units >= self.enforcement.min_foreign_words
                ):
                    self.blocked_by = finding
                    break
        self.on_findings(self, findings)

    def _fail(self, error: Exception) -> None:
        self.detector_error = error_text(error)

    def text_of(self, finding: Finding) -> str | None:
        """The leaked span as the client's output had it (only with ``keep_text``)."""
        if not self.keep_text:
            return None
        return "".join(self._texts.get(finding.choice, []))[finding.start : finding.end]

    def action_for(self, finding: Finding) -> str:
        """What was done about ``finding``: blocked, or only logged."""
        return "blocked" if finding is self.blocked_by else "logged"

    def leak_fields(self, finding: Finding, *, evidence_text: bool = False) -> dict[str, Any]:
        """The fields of a ``leak.detected`` event for ``finding`` (``leak_event_fields``);
        the leaked text only with ``evidence_text``."""
        fields = leak_event_fields(self.request_id, self.tenant, finding, self.action_for(finding))
        if self.learning:
            fields["learning"] = True
        if evidence_text:
            fields["evidence_text"] = self.text_of(finding)
        return fields

    @property
    def verdict(self) -> str:
        if self.blocked_by is not None or self.failed_closed:
            return "blocked"
        return "leak" if self.findings else "clean"

    @property
    def duration_ms(self) -> float:
        ended = self.ended if self.ended is not None else time.monotonic()
        return round((ended - self.started) * 1000, 2)

    @property
    def ttft_ms(self) -> float | None:
        if self.first_output is None:
            return None
        return round((self.first_output - self.started) * 1000, 2)
