"""``crosstalk replay`` as a job: inputs -> the replayer -> event log and report.

``run_job`` opens every input and the event log first (a bad argument or unreadable
file stops it before anything is replayed: ``JobError``, exit status 2), builds the
engine and tenant rules exactly as the live proxy does (``factory.build_engine``,
``factory.tenant_rules``, the learned state loaded read only), replays the merged inputs
(``proxy.forensics.replayer``), logs what the live proxy logs for the same findings with ``action:
"replayed"``, and writes the incident report (``proxy.forensics.report``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from proxy.config import Config
from proxy.engine import Engine, Finding
from proxy.engine.ordered_replay import RecordReplayer, ReplayedFinding
from proxy.engine.records import OutputRecord
from proxy.eventlog import make_logger
from proxy.factory import build_engine, tenant_rules
from proxy.forensics.partitions import Partition
from proxy.forensics.readers import (
    LOG_FORMATS,
    InputError,
    InputFile,
    Skipped,
    TenantFrom,
    open_input,
    read_records,
)
from proxy.forensics.replayer import (
    DEFAULT_SORT_BUFFER,
    ExchangeRecord,
    InputStats,
    Replayer,
    ReplayStats,
    merge_inputs,
)
from proxy.forensics.report import REPORT_SUFFIXES, IncidentBook, build_report, iso, write_report
from proxy.pipeline.exchange import ExchangeMonitor, leak_event_fields
from proxy.store import journal

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_window(text: str) -> float:
    """``600``, ``90s``, ``30m``, ``2h``, ``3d`` -> seconds (> 0). Raises ValueError."""
    value = text.strip().lower()
    unit = _UNITS.get(value[-1:])
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"window must be seconds or a number with s/m/h/d: {text!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"window must be > 0: {text!r}")
    return seconds


class StatusLine:
    """One line on a terminal, rewritten in place; ``clear`` erases it (before anything
    else is written there). Disabled: writes nothing."""

    def __init__(self, stream: IO[str], enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled
        self._shown = False

    def show(self, text: str) -> None:
        if self.enabled:
            self.stream.write(f"\r\x1b[K{text}")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


class Progress:
    """The replay's progress on a ``StatusLine`` (at most 5 redraws a second)."""

    def __init__(self, stream: IO[str], sources: list[InputFile]) -> None:
        self.line = StatusLine(stream)
        self.sources = sources
        self.total = sum(s.size for s in sources) or 1
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, stats: ReplayStats, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        done = sum(s.progress() for s in self.sources)
        rate = stats.records / max(now - self.started, 1e-9)
        width = 24
        filled = int(width * min(1.0, done / self.total))
        self.line.show(
            f"[{'#' * filled}{'.' * (width - filled)}] {100 * done / self.total:5.1f}% "
            f"{done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB  {stats.records:,} records "
            f"({rate:,.0f}/s)  {stats.findings:,} findings"
        )

    def clear(self) -> None:
        self.line.clear()


@dataclass
class ReplayJob:
    """Everything ``crosstalk replay`` was asked to do (validated by ``prepare``)."""

    paths: list[str]
    config: Config
    log_file: str | None = None  # None: stderr
    log_level: str = "info"
    reports: list[str] = field(default_factory=list)  # .json, .md, .html
    state: str | None = None  # learned state to start from; None: the config's; "none": cold
    sort_buffer: int = DEFAULT_SORT_BUFFER
    fmt: str = "auto"
    progress: bool = False  # draw a progress line on stderr
    tenant_from: TenantFrom = field(default_factory=TenantFrom)  # --tenant-from, --tenant-pattern
    max_log_len: int | None = None  # the engine's --max-log-len (text of that length is cut)
    jobs: int = 1  # --jobs: time partitions replayed by this many processes
    warm_up: float | None = None  # --warm-up: seconds replayed before a partition
    learn_every: int = 1  # --learn-every: of the traffic before a warm-up, every Nth exchange
    # teaches its words (0: none)
    ray: str | None = None  # --ray [ADDRESS]: partitions as Ray tasks ("": a local Ray)
    ray_ship: bool = False  # --ray-ship: inputs go to the workers through Ray's object store


@dataclass
class ReplayOutcome:
    stats: ReplayStats
    skipped: int
    incidents: int
    seconds: float
    empty_inputs: list[str] = field(default_factory=list)  # no LLM exchange read from them


class JobError(Exception):
    """The job cannot run: unusable arguments or unreadable input (exit status 2)."""


class FindingBook(Protocol):
    """Where findings go besides the log: the incident book (``IncidentBook``), or a
    partition's list of them for the book of the whole replay."""

    def add(self, event: dict[str, Any], when: float) -> None: ...


class EventSink:
    """The replayer's reports, as the live proxy's: ``leak.detected`` events (with
    ``action: "replayed"`` and the recorded time), ``detector.error``, plus replay's own
    ``replay.skipped`` / ``replay.failed``; findings also go to the incident book."""

    def __init__(
        self,
        log: Any,
        book: FindingBook,
        progress: Progress | None,
        reports_skip: Callable[[Skipped], bool] | None = None,
    ) -> None:
        self.log = log
        self.book = book
        self.progress = progress
        self.reports_skip = reports_skip  # a partition's: is an unreadable record its own?
        self.skipped: list[Skipped] = []
        self.skipped_count = 0

    def _quiet(self) -> None:
        if self.progress is not None:
            self.progress.clear()

    def finding(
        self,
        monitor: ExchangeMonitor,
        finding: Finding,
        when: float,
        record: ExchangeRecord,
        partial: list[str],
    ) -> None:
        fields = monitor.leak_fields(finding)  # never the text, whatever the config says
        fields["action"] = "replayed"
        fields["recorded_at"] = iso(when, "milliseconds")
        fields["capture"] = record.position
        if partial:
            fields["partial_text"] = partial
        self._quiet()
        self.log.warning("leak.detected", **fields)
        self.book.add(fields, when)

    def journal_finding(self, found: ReplayedFinding, position: str) -> None:
        """A finding of a replayed fingerprint journal (no monitor: keyed records)."""
        fields = leak_event_fields(found.request_id, found.tenant, found.finding, "replayed")
        fields["recorded_at"] = iso(found.time, "milliseconds")
        fields["capture"] = position
        self._quiet()
        self.log.warning("leak.detected", **fields)
        self.book.add(fields, found.time)

    def no_tenant(self, record: ExchangeRecord) -> None:
        self._quiet()
        self.log.warning("replay.no_tenant", input=record.origin, reason=record.tenant_missing)
        print(f"crosstalk replay: {record.origin}: {record.tenant_missing}", file=sys.stderr)

    def detector_error(self, monitor: ExchangeMonitor, record: ExchangeRecord) -> None:
        self._quiet()
        self.log.error(
            "detector.error",
            request_id=monitor.request_id,
            tenant=monitor.tenant,
            reason=monitor.detector_error,
            action="replayed",
            capture=record.position,
        )

    def unrecorded(self, monitor: ExchangeMonitor, record: ExchangeRecord, what: str) -> None:
        self._quiet()
        self.log.warning(
            "replay.not_scannable",
            request_id=monitor.request_id,
            tenant=monitor.tenant,
            reason=what,
            capture=record.position,
        )

    def degenerate(
        self, monitor: ExchangeMonitor, record: ExchangeRecord, reason: str, choice: int
    ) -> None:
        self._quiet()
        self.log.warning(
            "output.degenerate",
            request_id=monitor.request_id,
            tenant=monitor.tenant,
            reason=reason,
            choice=choice,
            output_chars=monitor.output_chars,
            capture=record.position,
        )

    def failure(self, position: str, reason: str) -> None:
        self._quiet()
        self.log.error("replay.failed", capture=position, reason=reason)

    def skip(self, skipped: Skipped) -> None:
        if self.reports_skip is not None and not self.reports_skip(skipped):
            return
        self.skipped_count += 1
        if len(self.skipped) < 100:
            self.skipped.append(skipped)
        self._quiet()
        self.log.warning(
            "replay.skipped",
            path=skipped.path,
            record=skipped.record,
            offset=skipped.offset,
            reason=skipped.reason,
        )
        print(f"crosstalk replay: skipped {skipped.position}: {skipped.reason}", file=sys.stderr)


def open_sources(
    paths: list[str], job: ReplayJob, formats: list[str] | None = None
) -> list[InputFile]:
    """``paths`` opened for replay (in ``formats`` when known, else ``job.fmt``). Raises
    JobError, with every file it opened closed again."""
    sources: list[InputFile] = []
    try:
        for i, path in enumerate(paths):
            fmt = formats[i] if formats else job.fmt
            sources.append(open_input(path, fmt, job.tenant_from, job.max_log_len))
    except InputError as e:
        for source in sources:
            source.close()
        raise JobError(str(e)) from e
    return sources


def prepare(job: ReplayJob) -> tuple[list[InputFile], Any]:
    """Open every input and the event log up front, so that bad arguments or an
    unreadable file stop the job before anything is replayed. Raises JobError.
    Fingerprint journals are not opened here (``replay_journal`` checks them)."""
    for report in job.reports:
        if Path(report).suffix.lower() not in REPORT_SUFFIXES:
            raise JobError(f"--report must end in one of {', '.join(REPORT_SUFFIXES)}: {report}")
    if job.sort_buffer < 1:
        raise JobError("--sort-buffer must be >= 1")
    if job.max_log_len is not None and job.max_log_len < 1:
        raise JobError("--max-log-len must be >= 1")
    if job.jobs < 1:
        raise JobError("--jobs must be >= 1")
    if job.learn_every < 0:
        raise JobError("--learn-every must be >= 0 (0: no words learned before a warm-up)")
    if job.warm_up is not None and job.warm_up < job.config.detection.window_seconds:
        raise JobError(
            f"--warm-up must be at least the detection window "
            f"({job.config.detection.window_seconds:g} s): a partition's engine must "
            "hold what the serial replay's holds at its start"
        )
    if job.ray_ship and job.ray is None:
        raise JobError("--ray-ship ships the inputs to Ray's workers: give --ray too")
    if job.state not in (None, "none") and not Path(job.state).is_file():
        raise JobError(f"--state {job.state}: no such file")
    journals = [p for p in job.paths if journal.is_journal(p)]
    if journals and len(journals) != len(job.paths):
        raise JobError(
            "fingerprint journals and captured traffic cannot be replayed together "
            "(the engine replays its own records, captures go through the proxy's path): "
            "replay them separately"
        )
    if journals and (job.jobs > 1 or job.ray is not None):
        raise JobError(
            "--jobs and --ray cut captured traffic and logs into time partitions; "
            "fingerprint journals replay in one process: drop --jobs/--ray"
        )
    sources = [] if journals else open_sources(job.paths, job)
    captures = [s.name for s in sources if s.format not in LOG_FORMATS]
    if job.tenant_from.fields and (captures or journals):
        for source in sources:
            source.close()
        raise JobError(
            "--tenant-from reads a field of a log record; the tenant of HTTP captures and "
            f"journals comes from the configuration's [tenants] rules: {(captures or journals)[0]}"
        )
    try:
        log = make_logger(job.log_file, job.log_level)
    except (OSError, ValueError) as e:
        for source in sources:
            source.close()
        raise JobError(f"--log-file {job.log_file}: {e}") from e
    return sources, log


def start_engine(job: ReplayJob, log: Any) -> tuple[Engine, str]:
    """The engine the live proxy would have: ``job``'s config, its learned state loaded
    read only (replay never writes it), and what became of the state, as logged:
    ``state.loaded``, ``state.absent``, ``state.unusable`` or ``state.none``."""
    engine = build_engine(job.config)
    state = state_path(job)
    if state is None:
        return engine, "state.none"
    try:
        engine.load_commonness(state)
    except FileNotFoundError:
        log.info("state.absent", path=state, detail="replaying from a cold engine")
        return engine, "state.absent"
    except (OSError, ValueError, KeyError) as e:
        log.warning("state.unusable", path=state, reason=str(e))
        return engine, "state.unusable"
    log.info("state.loaded", path=state)
    return engine, "state.loaded"


def state_path(job: ReplayJob) -> str | None:
    """The learned state ``job`` starts from (``--state``, else the config's), or None."""
    state = job.config.detection.state_file if job.state is None else job.state
    return state if state and state != "none" else None


def replay_sources(
    job: ReplayJob,
    engine: Engine,
    sources: list[InputFile],
    sink: EventSink,
    on_progress: Callable[[ReplayStats], None] | None = None,
    partition: Partition | None = None,
) -> ReplayStats:
    """``sources`` merged in time order through a ``Replayer`` (all of them, or what
    ``partition`` replays, reporting its own span); closes them."""
    rules = tenant_rules(job.config, engine.hasher.key)
    reported = None if partition is None else (partition.start, partition.end)
    replayer = Replayer(engine, rules, job.config, sink, on_progress=on_progress, reported=reported)
    try:
        streams = [read_records(s, sink.skip) for s in sources]
        records = merge_inputs(streams, job.sort_buffer)
        if partition is not None:
            learn = sampled(replayer.learn_only, job.learn_every) if job.learn_every else None
            records = partition.records(records, learn)
        return replayer.run(records)
    finally:
        if on_progress is not None:
            on_progress(replayer.stats)
        for source in sources:
            source.close()


def sampled[T](learn: Callable[[T], None], every: int) -> Callable[[T], None]:
    """``learn``, called with every ``every``-th of the values it is given (the first,
    then each ``every``-th after it)."""
    seen = 0

    def maybe(value: T) -> None:
        nonlocal seen
        if seen % every == 0:
            learn(value)
        seen += 1

    return maybe


def run_job(job: ReplayJob) -> ReplayOutcome:
    """Replay ``job``'s inputs, log the findings and write the report."""
    sources, log = prepare(job)
    started = time.monotonic()
    engine, state_outcome = start_engine(job, log)
    engine_config, key_id = engine.config, engine.hasher.key_id
    log.info(
        "replay.started",
        inputs=[f"{s.name} ({s.format})" for s in sources] or [f"{p} (journal)" for p in job.paths],
        key_id=key_id,
        k=engine_config.k,
        window_seconds=engine_config.window_seconds,
        **({"jobs": job.jobs} if job.jobs > 1 else {}),
        **({"ray": job.ray or "local"} if job.ray is not None else {}),
    )
    book = IncidentBook()
    if not sources:
        sink = EventSink(log, book, None)
        stats = replay_journal(job.paths, engine, sink)
        skipped_count, skipped = sink.skipped_count, sink.skipped
    elif job.jobs > 1 or job.ray is not None:
        from proxy.forensics.parallel import replay_partitioned

        del engine  # each worker builds its own
        merged = replay_partitioned(job, sources, log, book, state_outcome)
        stats, skipped_count, skipped = merged.stats, merged.skipped_count, merged.skipped
    else:
        progress = Progress(sys.stderr, sources) if job.progress else None
        sink = EventSink(log, book, progress)
        try:
            stats = replay_sources(
                job, engine, sources, sink, progress.update if progress else None
            )
        finally:
            if progress is not None:
                progress.clear()
        skipped_count, skipped = sink.skipped_count, sink.skipped
    seconds = time.monotonic() - started
    summary = {
        "inputs": [s.name for s in sources] or list(job.paths),
        "per_input": [
            {
                "input": s.name,
                "format": s.format,
                **asdict(stats.per_input.get(s.name) or InputStats()),
            }
            for s in sources
        ],  # fmt: skip
        "traffic_from": iso(stats.first_time),
        "traffic_to": iso(stats.last_time),
        **{
            k: v
            for k, v in asdict(stats).items()
            if k not in ("first_time", "last_time", "per_input")
        },
        "skipped": skipped_count,
        "skipped_records": [{"position": s.position, "reason": s.reason} for s in skipped],
        "window_seconds": engine_config.window_seconds,
        "key_id": key_id,
        "seconds": round(seconds, 3),
    }
    log.info("replay.finished", **{k: v for k, v in summary.items() if k != "skipped_records"})
    if job.reports:
        report = build_report(book, summary)
        for path in job.reports:
            write_report(path, report)
    empty = [s.name for s in sources if s.name not in stats.per_input]
    return ReplayOutcome(stats, skipped_count, len(book.incidents), seconds, empty)


def replay_journal(paths: list[str], engine: Engine, sink: EventSink) -> ReplayStats:
    """Replay fingerprint journals through ``engine`` (its key must be the journal's):
    the findings live shadow mode made, from keyed records alone. Raises JobError when a
    segment is of another key or format; a corrupt line is skipped with its position."""
    key_id, k = engine.hasher.key_id, engine.config.k
    try:
        journal.check(paths, key_id, k)
    except journal.JournalError as e:
        raise JobError(str(e)) from e
    stats = ReplayStats()
    replayer = RecordReplayer(engine)
    where = ", ".join(paths)

    def skip(corrupt: journal.Corrupt) -> None:
        sink.skip(Skipped(corrupt.path, corrupt.line, None, corrupt.reason))

    def report(findings: list[ReplayedFinding]) -> None:
        for found in findings:
            stats.findings += 1
            sink.journal_finding(found, where)

    for record in journal.read(paths, key_id, k, skip):
        stats.records += 1
        if isinstance(record, OutputRecord):
            stats.exchanges += 1
        if stats.first_time is None:
            stats.first_time = record.time
        stats.last_time = max(stats.last_time or record.time, record.time)
        report(replayer.push(record))
    report(replayer.close())
    return stats
