"""Forensic replay: recorded traffic through the live detector, in recorded time order.

``crosstalk replay`` feeds captured exchanges (``proxy.forensics.readers``) to the same engine,
tenant rules and ``ExchangeMonitor`` as the live proxy in shadow mode, so it makes the
findings live shadow mode made (or would have made) on that traffic.

Live, a request's prompt is observed when the request reaches the proxy, and its
response is scanned as it streams, so concurrent exchanges interleave: a prompt that
arrives while another response is streaming is already known to the rest of that
stream. Replay keeps that order. It is a small discrete-event simulation: every record
is a generator of steps, each step says at which recorded time it runs next, and a heap
runs the steps of all open exchanges in time order. A streamed body is fed in the
chunks it arrived in, at their arrival times, when the capture recorded them
(``crosstalk run --capture``); otherwise (``mitmdump -w``, HAR, JSON lines) it is cut
into its SSE events, paced evenly between the response's first and last byte.

Input: several files, each roughly in time order (a mitmdump flow file is in order of
response end), are each sorted within a bounded buffer of records and merged with a
heap, so memory is bounded by the buffer and the open exchanges, not by the input size.
A record older than one already replayed (out of order beyond the buffer) is replayed
late and counted.

Other record types plug in here (a fingerprint journal): anything with ``time``,
``position`` and a ``steps(replayer)`` generator, yielded in time order by its reader.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from mitmproxy.net import encoding as http_encoding

from proxy.config import Config
from proxy.engine import Engine, Finding
from proxy.engine.degenerate import ExchangeWatch
from proxy.pipeline.exchange import ExchangeMonitor
from proxy.protocols import ParsedRequest, ProtocolError, route_for
from proxy.protocols.sse import SSEDecoder, SSEFramer
from proxy.redaction import error_text
from proxy.tenants import HeaderView, TenantRules, request_id_of, resolve_tenant

#: Records sorted per input file before the merge (``--sort-buffer``), and the body
#: bytes they may hold together: whichever bound is reached first releases the oldest.
DEFAULT_SORT_BUFFER = 1024
SORT_BUFFER_BYTES = 64 << 20
#: Compressed streams cannot be cut into events: they are paced in pieces of this size.
COMPRESSED_PIECE = 4096
#: Request ids of exchanges with cut text, remembered to mark findings whose source
#: text was cut (the oldest are forgotten first).
PARTIAL_SOURCES_KEPT = 65536


class ReplayRecord(Protocol):
    """One unit of recorded traffic. ``steps`` runs it: each value it yields is the
    recorded time at which it wants to continue (the replayer resumes it then)."""

    time: float  # when it reached the proxy: the merge key
    position: str  # where it was read (file and record), for messages

    def steps(self, replayer: Replayer) -> Iterator[float]: ...


@dataclass(slots=True)
class RecordedResponse:
    """A response as the proxy received it from upstream."""

    status: int
    headers: HeaderView
    body: bytes  # as received, still content-encoded (``content-encoding`` header)
    start: float  # first byte (epoch seconds)
    end: float  # last byte, or when the exchange broke off
    complete: bool = True  # False: the exchange ended in an error before the end
    chunks: list[tuple[int, float]] | None = None  # streamed: (size, arrival) as received
    recorded: bool = True  # False: the capture kept no body (mitmproxy stream_large_bodies)


@dataclass(slots=True)
class ExchangeRecord:
    """One recorded HTTP exchange, whatever file format it came from."""

    time: float  # the request reached the proxy (epoch seconds)
    position: str
    method: str
    path: str
    headers: HeaderView  # request headers (case-insensitive ``get``)
    body: bytes  # request body, decoded
    response: RecordedResponse | None  # None: the exchange failed before a response
    fallback_id: str  # request id when the headers carry none (stable across runs)
    tenant: str | None = None  # given by the record itself; else the tenant rules decide
    end: float | None = None  # when an exchange without response failed
    body_recorded: bool = True  # False: the capture kept no request body
    origin: str = ""  # the input it was read from (per-input accounting)
    partial: str | None = None  # what of the text the input cut (a log's length limit)
    tenant_missing: str | None = None  # the input names no tenant: why, and what to do
    missing_note: str | None = None  # why a body is not in the input (a log's settings)
    # When the proxy had the whole request (a flow's ``timestamp_end``): the engine's
    # clock for the prompt, as live. None: ``time``.
    arrived: float | None = None

    def unrecorded(self) -> str | None:
        """What of this exchange the capture did not keep, or None: a replay must not
        call text it never saw clean."""
        missing = [
            part
            for part, kept in (
                ("request", self.body_recorded),
                ("response", self.response is None or self.response.recorded),
            )
            if not kept
        ]
        if not missing:
            return None
        note = f" ({self.missing_note})" if self.missing_note else ""
        return " and ".join(missing) + " body not in the capture" + note

    def steps(self, replayer: Replayer) -> Iterator[float]:
        return replayer.exchange_steps(self)

    @property
    def nbytes(self) -> int:
        """Body bytes held (what bounds the sort buffer)."""
        return len(self.body) + (len(self.response.body) if self.response else 0)


@dataclass(slots=True)
class InputStats:
    """What one input let the replay see, in LLM exchanges."""

    exchanges: int = 0
    complete: int = 0  # scanned whole: both texts, uncut, with a tenant
    partial: int = 0  # some text cut by the input (a log's length limit)
    unrecorded: int = 0  # a body the input does not hold
    untenanted: int = 0  # the input names no tenant for it
    detector_errors: int = 0


@dataclass(slots=True)
class ReplayStats:
    records: int = 0  # records replayed (any kind)
    exchanges: int = 0  # LLM exchanges scanned
    passthrough: int = 0  # not an LLM call: passed untouched live, skipped here
    rejected: int = 0  # no tenant and ``tenants.unknown = "reject"``
    unparsed: int = 0  # request body not a valid API request (response still scanned)
    detector_errors: int = 0  # exchanges the detector could not scan (fail open live)
    unrecorded: int = 0  # exchanges whose capture holds no body (not scannable either)
    partial: int = 0  # exchanges whose input cut some of their text (scanned what is left)
    untenanted: int = 0  # exchanges of an input that names no tenant (one "anonymous")
    degenerate: int = 0  # exchanges whose output turned to garbage (output.degenerate live)
    findings: int = 0
    late: int = 0  # records older than one already replayed (beyond the sort buffer)
    failures: int = 0  # unexpected errors while replaying a record (reported, skipped)
    first_time: float | None = None
    last_time: float | None = None
    per_input: dict[str, InputStats] = field(default_factory=dict)


class ReplaySink(Protocol):
    """Where the replayer reports (the command: event log, report, progress)."""

    def finding(
        self,
        monitor: ExchangeMonitor,
        finding: Finding,
        when: float,
        record: ExchangeRecord,
        partial: list[str],
    ) -> None:
        """``partial``: which of the texts the finding rests on were cut by their input
        (``victim: ...``, ``source: ...``); empty when both were whole."""

    def no_tenant(self, record: ExchangeRecord) -> None:
        """The first exchange of an input that names no tenant (once per input)."""

    def detector_error(self, monitor: ExchangeMonitor, record: ExchangeRecord) -> None: ...

    def unrecorded(self, monitor: ExchangeMonitor, record: ExchangeRecord, what: str) -> None: ...

    def degenerate(
        self, monitor: ExchangeMonitor, record: ExchangeRecord, reason: str, choice: int
    ) -> None: ...

    def failure(self, position: str, reason: str) -> None: ...


class _Silent:
    """The sink of warm-up and tail records: replayed for what the engine learns of
    them, reported by the partition whose span holds them."""

    def finding(self, *args: object) -> None:
        pass

    no_tenant = detector_error = unrecorded = degenerate = failure = finding


SILENT: ReplaySink = _Silent()


def time_ordered[R: ReplayRecord](
    records: Iterable[R], buffer: int = DEFAULT_SORT_BUFFER, max_bytes: int = SORT_BUFFER_BYTES
) -> Iterator[R]:
    """``records`` sorted by time within a sliding buffer of ``buffer`` records (and at
    most ``max_bytes`` of bodies): exact for inputs whose records are never more than
    that many places out of order."""
    heap: list[tuple[float, int, R]] = []
    seq = itertools.count()
    held = 0
    for record in records:
        heapq.heappush(heap, (record.time, next(seq), record))
        held += getattr(record, "nbytes", 0)
        while len(heap) > buffer or (held > max_bytes and len(heap) > 1):
            released = heapq.heappop(heap)[2]
            held -= getattr(released, "nbytes", 0)
            yield released
    while heap:
        yield heapq.heappop(heap)[2]


def merge_inputs[R: ReplayRecord](
    inputs: Iterable[Iterable[R]], buffer: int = DEFAULT_SORT_BUFFER
) -> Iterator[R]:
    """One time-ordered stream of several inputs: each sorted within its buffer, then
    heap-merged (lazily: one pending record per input)."""
    return heapq.merge(*(time_ordered(i, buffer) for i in inputs), key=lambda r: r.time)


def paced_pieces(response: RecordedResponse) -> Iterable[tuple[float, bytes]]:
    """A streamed body as the proxy received it, with arrival times: the recorded chunks
    when the capture has them (``crosstalk run --capture``); else its SSE events (pieces
    of ``COMPRESSED_PIECE`` bytes when compressed) evenly paced between the response's
    first and last byte."""
    body = response.body
    if not body:
        return []
    chunks = response.chunks
    if chunks and sum(size for size, _ in chunks) == len(body):
        ends = itertools.accumulate(size for size, _ in chunks)  # cut as they come
        return (
            (when, body[end - size : end]) for (size, when), end in zip(chunks, ends, strict=True)
        )
    encoding = (response.headers.get("content-encoding") or "identity").strip().lower()
    if encoding in ("", "identity", "none"):
        framer = SSEFramer()
        pieces = framer.feed(body)
        if rest := framer.close():
            pieces.append(rest)
    else:
        pieces = [body[i : i + COMPRESSED_PIECE] for i in range(0, len(body), COMPRESSED_PIECE)]
    # Each piece arrives when its last byte does: a list made at once, where a generator
    # took a resume and four attribute reads a piece.
    start, span, size = response.start, max(0.0, response.end - response.start), len(body)
    ends = itertools.accumulate(map(len, pieces))
    return [(start + span * end / size, piece) for end, piece in zip(ends, pieces, strict=True)]


def decoded_body(response: RecordedResponse) -> bytes:
    """The body without its content-encoding, as the live addon decodes a buffered
    response (mitmproxy's decoders, strict). Raises ValueError when it cannot."""
    ce = response.headers.get("content-encoding")
    if not ce:
        return response.body
    content = http_encoding.decode(response.body, ce)
    if isinstance(content, str):  # a text "encoding" (e.g. utf8): not a content-encoding
        raise ValueError(f"invalid content-encoding {ce!r}")
    return content


class Replayer:
    """Runs recorded traffic through an engine in recorded time order (shadow mode)."""

    def __init__(
        self,
        engine: Engine,
        rules: TenantRules,
        config: Config,
        sink: ReplaySink,
        *,
        on_progress: Callable[[ReplayStats], None] | None = None,
        reported: tuple[float, float] | None = None,
    ) -> None:
        """``reported``: replay every record, but report (sink, ``stats``) only those whose
        time lies in ``[start, end)``; the others are warm-up and tail of a partition
        (``proxy.forensics.partitions``) and are counted in ``quiet_stats``."""
        self.engine = engine
        self.rules = rules
        self.config = config
        self.sink = sink
        self.on_progress = on_progress
        self.stats = ReplayStats()
        self.quiet_stats = ReplayStats()
        self.reported = reported
        self.clock = 0.0  # recorded time of the step being run
        self._pending: list[tuple[float, int, Iterator[float], str]] = []
        self._quiet_positions: set[str] = set()
        self._seq = itertools.count()
        self._partial_sources: OrderedDict[str, str] = OrderedDict()
        self._untenanted_inputs: set[str] = set()

    def run(self, records: Iterable[ReplayRecord]) -> ReplayStats:
        """Replay ``records`` (time-ordered, e.g. from ``merge_inputs``) to the end."""
        latest = float("-inf")
        for count, record in enumerate(records, 1):
            self._advance(record.time)
            stats = self._ledger(record.time)[0]
            if record.time < latest:
                stats.late += 1
            latest = max(latest, record.time)
            self.clock = record.time
            stats.records += 1
            if stats.first_time is None:
                stats.first_time = record.time
            stats.last_time = (
                record.time if stats.last_time is None else max(stats.last_time, record.time)
            )
            if stats is self.quiet_stats:
                self._quiet_positions.add(record.position)
            self._start(record.steps(self), record.position)
            if self.on_progress is not None and count % 64 == 0:
                self.on_progress(self.stats)
        self._advance(float("inf"))
        if self.on_progress is not None:
            self.on_progress(self.stats)
        return self.stats

    def _ledger(self, when: float) -> tuple[ReplayStats, ReplaySink]:
        """Where a record at ``when`` is counted and reported: the replay's own stats and
        sink, or (outside ``reported``) the quiet ones."""
        span = self.reported
        if span is None or span[0] <= when < span[1]:
            return self.stats, self.sink
        return self.quiet_stats, SILENT

    def _advance(self, until: float) -> None:
        """Run every pending step due at or before ``until``, in time order. A stream
        whose next step is due before every other pending one (and not after ``until``)
        runs on at once; else that step joins the heap and the earliest one runs (one
        ``heappushpop``: each of a replay's ~260,000 events passes here). Equal times
        run in the order they were queued: a tie waits its turn."""
        pending = self._pending
        if not pending or pending[0][0] > until:
            return
        when, _, steps, position = heapq.heappop(pending)
        while True:
            if when > self.clock:
                self.clock = when
            try:
                when = next(steps)
            except StopIteration:
                pass  # the stream ended: nothing to queue
            except Exception as e:  # noqa: BLE001 -- one broken record never ends a replay
                if position in self._quiet_positions:
                    self.quiet_stats.failures += 1
                else:
                    self.stats.failures += 1
                    self.sink.failure(position, error_text(e))
            else:
                if when <= until:
                    when, _, steps, position = heapq.heappushpop(
                        pending, (when, next(self._seq), steps, position)
                    )
                    continue
                heapq.heappush(pending, (when, next(self._seq), steps, position))
            if not pending or pending[0][0] > until:
                return
            when, _, steps, position = heapq.heappop(pending)

    def _start(self, steps: Iterator[float], position: str) -> None:
        """Run a record's steps up to their first time, at once (ahead of every pending
        step: its entry is due at -inf), and queue them there."""
        heapq.heappush(self._pending, (-math.inf, next(self._seq), steps, position))
        self._advance(-math.inf)

    # -- one HTTP exchange, as the live addon's hooks handle it ---------------------------

    def exchange_steps(self, record: ExchangeRecord) -> Iterator[float]:
        """The addon's sequence: ``request`` (tenant, request id, observe the prompt at
        the request's time), ``responseheaders`` + stream chunks (SSE), or ``response``
        (a buffered body, at its last byte), or ``error``."""
        stats, sink = self._ledger(record.time)
        begun = self._begin(record, stats, sink)
        if begun is None:
            return
        monitor, untenanted = begun
        seen = stats.per_input.setdefault(record.origin, InputStats())
        seen.exchanges += 1
        whole = True
        missing = record.unrecorded()
        if missing is not None:
            stats.unrecorded += 1
            seen.unrecorded += 1
            whole = False
            sink.unrecorded(monitor, record, missing)
        if record.partial is not None:
            stats.partial += 1
            seen.partial += 1
            whole = False
            self._remember_partial(monitor.request_id, record.partial)
        if untenanted:
            seen.untenanted += 1
            whole = False
        watch = self._watch_degenerate(monitor, record, stats, sink)
        response = record.response
        if response is None:
            yield record.end if record.end is not None else record.time
            monitor.close()
        elif "text/event-stream" in (response.headers.get("content-type") or ""):
            yield response.start
            monitor.start_stream(response.headers.get("content-encoding"))
            for when, piece in paced_pieces(response):
                yield when
                monitor.on_chunk(piece)
            yield response.end
            if response.complete:
                monitor.on_chunk(b"")
            else:
                monitor.close()
        else:
            yield response.end
            body: bytes | None = None
            if response.complete and response.recorded:
                try:
                    body = decoded_body(response)
                except ValueError as e:
                    monitor.undecodable(response.headers.get("content-encoding"), e)
            if body is not None and 200 <= response.status < 300:
                monitor.on_body(body)
            else:
                monitor.close()
        if monitor.scan_capped and record.partial is None:
            # Past limits.max_scanned_output_chars the live proxy scans nothing: neither
            # does its replay, and the rest of the output was not looked at.
            stats.partial += 1
            seen.partial += 1
            whole = False
        if monitor.detector_error is not None:
            stats.detector_errors += 1
            seen.detector_errors += 1
            whole = False
            sink.detector_error(monitor, record)
        seen.complete += whole
        if watch is not None:
            watch.finish()

    def _remember_partial(self, request_id: str, what: str) -> None:
        kept = self._partial_sources
        kept[request_id] = what
        if len(kept) > PARTIAL_SOURCES_KEPT:
            kept.popitem(last=False)

    def _watch_degenerate(
        self, monitor: ExchangeMonitor, record: ExchangeRecord, stats: ReplayStats, sink: ReplaySink
    ) -> ExchangeWatch | None:
        """The live proxy's degenerate-output signal, on the replayed output."""
        if not self.config.degenerate.enabled:
            return None

        def on_trip(reason: str, choice: int) -> None:
            stats.degenerate += 1
            sink.degenerate(monitor, record, reason, choice)

        watch = ExchangeWatch(on_trip)
        monitor.on_delta = watch.feed
        return watch

    def learn_only(self, record: ExchangeRecord) -> None:
        """What the engine would never forget of ``record``, learned without replaying
        it: the words of its prompt and output (``Engine.learn_words``), under the tenant
        the replay would give it (none when the replay would reject it). For the traffic
        before a partition's warm-up; a record that cannot be read teaches nothing."""
        try:
            self._learn_words(record)
        except Exception:  # noqa: BLE001 -- as ``_advance``: one record never ends a replay
            return

    def _learn_words(self, record: ExchangeRecord) -> None:
        route = route_for(record.method, record.path)
        if route is None:
            return
        try:
            parsed = route.parse_request(record.body)
        except ProtocolError:
            return
        tenant, _ = self._tenant_of(record, parsed)
        if tenant is None:
            return
        self.engine.learn_words(tenant, parsed.prompt)
        response = record.response
        if response is None or not response.recorded or not response.complete:
            return
        by_choice: dict[int, list[str]] = {}
        try:
            body = decoded_body(response)
            if "text/event-stream" in (response.headers.get("content-type") or ""):
                feed = route.stream_parser().feed
                for event in SSEDecoder().feed(body):
                    for choice, text in feed(event):
                        by_choice.setdefault(choice, []).append(text)
            else:
                for choice, text in route.parse_response(body):
                    by_choice.setdefault(choice, []).append(text)
        except (ValueError, ProtocolError):
            return
        for texts in by_choice.values():
            self.engine.learn_words(tenant, "".join(texts))

    def _tenant_of(
        self, record: ExchangeRecord, parsed: ParsedRequest | None
    ) -> tuple[str | None, bool]:
        """The tenant the live proxy would give ``record`` (None: rejected, with
        ``tenants.unknown = "reject"``), and whether its input names no tenant at all
        (then "anonymous", never rejected: the input's fault, counted apart)."""
        tenant = record.tenant or resolve_tenant(
            self.rules, record.headers, parsed.user if parsed else None
        )
        untenanted = tenant is None and record.tenant_missing is not None
        if tenant is None:
            if self.config.tenants.unknown == "reject" and not untenanted:
                return None, False
            tenant = "anonymous"
        return tenant, untenanted

    def _begin(
        self, record: ExchangeRecord, stats: ReplayStats, sink: ReplaySink
    ) -> tuple[ExchangeMonitor, bool] | None:
        """The addon's ``request`` hook, in shadow mode: the monitor, and whether the
        input named no tenant for it; None when the exchange is not scanned (not an LLM
        call, or no tenant with ``unknown = "reject"``)."""
        route = route_for(record.method, record.path)
        if route is None:
            stats.passthrough += 1
            return None
        headers = record.headers
        has_id = (headers.get("x-request-id") or "").strip()
        request_id = request_id_of(headers) if has_id else record.fallback_id
        try:
            parsed = route.parse_request(record.body)
        except ProtocolError:
            stats.unparsed += 1
            parsed = None
        tenant, untenanted = self._tenant_of(record, parsed)
        if tenant is None:
            stats.rejected += 1
            return None
        if untenanted:
            # A log without a tenant field: its exchanges are all one tenant to the
            # engine, so a leak between two of them cannot be seen. Counted, never clean.
            stats.untenanted += 1
            if record.origin not in self._untenanted_inputs:
                self._untenanted_inputs.add(record.origin)
                sink.no_tenant(record)
        stats.exchanges += 1
        monitor = ExchangeMonitor.begin(
            route,
            tenant,
            request_id,
            parsed,
            lambda m, found: self._found(m, found, record, stats, sink),
            scan_batch_chars=self.config.policy.shadow_batch_chars,
            max_scan_chars=self.config.limits.max_scanned_output_chars,
        )
        if parsed is not None:
            try:
                monitor.scan = self.engine.observe_prompt(
                    tenant,
                    request_id,
                    parsed.prompt,
                    now=record.time if record.arrived is None else record.arrived,
                    model_text=parsed.model_text,
                    turns_known=parsed.turns_known,
                )
            except Exception as e:  # noqa: BLE001 -- fail open, as live
                monitor.detector_error = error_text(e)
        return monitor, untenanted

    def _found(
        self,
        monitor: ExchangeMonitor,
        findings: list[Finding],
        record: ExchangeRecord,
        stats: ReplayStats,
        sink: ReplaySink,
    ) -> None:
        for finding in findings:
            stats.findings += 1
            partial = [f"victim: {record.partial}"] if record.partial else []
            if not record.body_recorded:
                # Its output was scanned alone: another tenant's answer to the same
                # question would look the same (the prompt would have told).
                partial.append("victim: no prompt in the input, its answer compared alone")
            if (cut := self._partial_sources.get(finding.source_request_id)) is not None:
                partial.append(f"source: {cut}")
            sink.finding(monitor, finding, self.clock, record, partial)
