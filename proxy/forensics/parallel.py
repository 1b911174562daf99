"""``crosstalk replay --jobs N`` and ``--ray [ADDRESS]``: one replay cut into time
partitions (``proxy.forensics.partitions``), each replayed by its own worker with its own
engine, the results merged into one event log, one report and one exit status.

Workers are processes on this machine (``--jobs``) or Ray tasks (``--ray``; the ``ray``
extra). A worker reads its inputs where they lie (a path every worker can open: this
machine, or a file system the cluster shares); with ``--ray-ship`` the inputs travel
through Ray's object store instead. A worker writes its events to a file of its own (a
Ray worker returns them); the parent appends them to the job's log in partition order,
so the log reads as the serial replay's does, partition after partition.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from proxy.eventlog import make_logger
from proxy.forensics.inputs import InputFile, Skipped
from proxy.forensics.job import (
    EventSink,
    JobError,
    ReplayJob,
    StatusLine,
    open_sources,
    replay_sources,
    start_engine,
    state_path,
)
from proxy.forensics.partitions import (
    Partition,
    Timeline,
    plan,
    sampled_timeline,
    scanned_timeline,
    seekable,
)
from proxy.forensics.readers import read_records
from proxy.forensics.replayer import InputStats, ReplayStats
from proxy.forensics.report import IncidentBook
from proxy.redaction import error_text


@dataclass
class PartitionTask:
    """What one worker is given: the job, its partition, its inputs' formats, and where
    its events go (``log_path``; None: returned in the result)."""

    job: ReplayJob
    partition: Partition
    formats: list[str]
    names: list[str]  # the inputs as the parent names them (its positions, its spans)
    log_format: str
    log_path: str | None
    shipped: dict[str, Any] | None = None  # input path -> Ray object holding its bytes


@dataclass
class PartitionResult:
    index: int
    stats: ReplayStats
    skipped_count: int
    skipped: list[Skipped]
    findings: list[tuple[dict[str, Any], float]]
    seconds: float
    state: str  # what became of the learned state in the worker (``start_engine``)
    log: bytes | None = None  # the events, when the worker could not write them to log_path


@dataclass
class Merged:
    """The partitions' results as one replay's."""

    stats: ReplayStats
    skipped_count: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per partition


class FindingList(list[tuple[dict[str, Any], float]]):
    """A worker's findings, for the parent's incident book."""

    def add(self, event: dict[str, Any], when: float) -> None:
        self.append((event, when))


class _Quiet:
    """A logger that drops everything (a worker's state loading: the parent logged it)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def run_partition(
    task: PartitionTask, on_progress: Callable[[ReplayStats], None] | None = None
) -> PartitionResult:
    """Replay one partition (in a worker: a process of ``--jobs`` or a Ray task)."""
    started = time.monotonic()
    job, partition = task.job, task.partition
    with tempfile.TemporaryDirectory(prefix="crosstalk-part-") as scratch:
        paths = list(job.paths)
        if task.shipped is not None:
            paths = _unship(task.shipped, paths, Path(scratch))
            if STATE in task.shipped:
                state_copy = Path(scratch) / "state.npz"
                state_copy.write_bytes(_ray().get(task.shipped[STATE]))
                job = replace(job, state=str(state_copy))
        log_path = task.log_path or str(Path(scratch) / "events.log")
        sources = open_sources(paths, job, task.formats)
        for name, source in zip(task.names, sources, strict=True):
            source.path = Path(name)  # positions name the input as the parent does
            span = partition.spans.get(name)
            if span is not None and seekable(source) and not job.learn_every:
                source.first_offset, source.first_line = span.offset, span.number
        log = make_logger(log_path, job.log_level, task.log_format)
        engine, state = start_engine(job, _Quiet())
        findings = FindingList()
        sink = EventSink(log, findings, None, partition.reports_skip)
        stats = replay_sources(job, engine, sources, sink, on_progress, partition)
        events = Path(log_path).read_bytes() if task.log_path is None else None
    return PartitionResult(
        partition.index,
        stats,
        sink.skipped_count,
        sink.skipped,
        findings,
        time.monotonic() - started,
        state,
        events,
    )


#: The key of the learned state among a task's shipped inputs.
STATE = "\0state"


def _unship(shipped: dict[str, Any], paths: list[str], scratch: Path) -> list[str]:
    ray = _ray()
    local = []
    for i, path in enumerate(paths):
        copy = scratch / f"{i}-{Path(path).name}"
        copy.write_bytes(ray.get(shipped[path]))
        local.append(str(copy))
    return local


def timelines(job: ReplayJob, sources: Sequence[InputFile]) -> list[Timeline]:
    """Each input's timeline: sampled when a worker can seek in it, else read whole."""
    out = []
    for source in sources:
        if seekable(source):
            out.append(sampled_timeline(source, seek=not job.learn_every))
            continue
        (again,) = open_sources([source.name], job, [source.format])
        try:
            out.append(scanned_timeline(again, read_records(again, lambda _s: None)))
        finally:
            again.close()
    return out


def warm_up_seconds(job: ReplayJob) -> float:
    """How much traffic before its start a partition replays: ``--warm-up``, else the
    detection window (what the engine holds at the partition's start; the words of what
    came before are learned, ``prefix_cost``). Chosen on the replay bench's seed 9
    (2026-12-06, every earlier exchange's words learned: a warm-up of 600, 1,800 and
    3,600 s left 4, 2 and 2 of 2,973 findings differing), reported on seed 11."""
    if job.warm_up is not None:
        return job.warm_up
    return job.config.detection.window_seconds


def prefix_cost(job: ReplayJob) -> float:
    """What a byte of input before a partition's warm-up costs its worker, as a share of
    what replaying it costs: reading it (each worker reads from the start when words are
    learned there), and learning the words of every ``--learn-every``-th exchange.
    Measured on the replay bench's capture (2026-12-06): reading ~4%, learning every
    exchange's words ~20% of a replay."""
    if not job.learn_every:
        return 0.0
    return READ_COST + LEARN_COST / job.learn_every


#: Shares of a replay's cost per byte (``prefix_cost``).
READ_COST, LEARN_COST = 0.04, 0.20


def merge_stats(parts: Sequence[ReplayStats]) -> ReplayStats:
    """The replay's stats from its partitions' (each reports its own span only)."""
    total = ReplayStats()
    for part in parts:
        for f in fields(ReplayStats):
            name = f.name
            value = getattr(part, name)
            if name == "per_input":
                for input_name, seen in value.items():
                    into = total.per_input.setdefault(input_name, InputStats())
                    for g in fields(InputStats):
                        setattr(into, g.name, getattr(into, g.name) + getattr(seen, g.name))
            elif name == "first_time":
                if value is not None:
                    total.first_time = (
                        value if total.first_time is None else min(total.first_time, value)
                    )
            elif name == "last_time":
                if value is not None:
                    total.last_time = (
                        value if total.last_time is None else max(total.last_time, value)
                    )
            else:
                setattr(total, name, getattr(total, name) + value)
    return total


def replay_partitioned(
    job: ReplayJob, sources: list[InputFile], log: Any, book: IncidentBook, state: str
) -> Merged:
    """Plan the partitions, run them (processes or Ray), merge: findings into ``book``,
    the workers' events into the job's log, in partition order. ``state``: what became
    of the learned state here; a worker whose state fared otherwise (a node without the
    file) is logged (``replay.partition_state``) and said on stderr."""
    # Workers may run elsewhere (another working directory, another node): absolute paths.
    learned = state_path(job)
    job = replace(
        job,
        paths=[str(Path(p).resolve()) for p in job.paths],
        state=str(Path(learned).resolve()) if learned else "none",
    )
    inputs = timelines(job, sources)
    formats, names = [s.format for s in sources], [s.name for s in sources]
    for source in sources:
        source.close()
    workers = job.jobs if job.ray is None else _ray_workers(job)
    warm_up = warm_up_seconds(job)
    partitions = plan(inputs, workers, warm_up, prefix_cost(job), back_lines=job.sort_buffer)
    log.info(
        "replay.partitioned",
        partitions=len(partitions),
        edges=[p.start for p in partitions[1:]],
        warm_up_seconds=warm_up,
        executor="ray" if job.ray is not None else "processes",
    )
    console = job.log_file is None and sys.stderr.isatty()
    log_format = "console" if console else "json"
    with tempfile.TemporaryDirectory(prefix="crosstalk-replay-") as scratch:
        tasks = [
            PartitionTask(
                job=replace(job, progress=False),
                partition=p,
                formats=formats,
                names=names,
                log_format=log_format,
                log_path=None if job.ray is not None else str(Path(scratch) / f"{p.index}.log"),
            )
            for p in partitions
        ]
        results = _run_ray(job, tasks) if job.ray is not None else _run_processes(job, tasks)
        merged = Merged(merge_stats([r.stats for r in results]))
        for result, task in zip(results, tasks, strict=True):
            events = result.log
            if events is None and task.log_path is not None:
                events = Path(task.log_path).read_bytes()
            _append_events(events or b"", job.log_file)
            for event, when in result.findings:
                book.add(event, when)
            merged.skipped_count += result.skipped_count
            merged.skipped.extend(result.skipped[: 100 - len(merged.skipped)])
            merged.seconds.append(round(result.seconds, 3))
            if result.state != state:
                log.warning(
                    "replay.partition_state",
                    partition=result.index,
                    state=result.state,
                    expected=state,
                    detail="this partition's engine did not start from the same learned state",
                )
                print(
                    f"crosstalk replay: partition {result.index + 1}: {result.state}, "
                    f"expected {state} (is the state file on every node? --ray-ship)",
                    file=sys.stderr,
                )
    log.info("replay.partitions_done", seconds=merged.seconds)
    return merged


def _append_events(events: bytes, log_file: str | None) -> None:
    if log_file:
        with open(log_file, "ab") as out:
            out.write(events)
    else:
        sys.stderr.buffer.write(events)
        sys.stderr.flush()


def _all_results(
    results: list[PartitionResult | None], errors: list[str], what: str
) -> list[PartitionResult]:
    """Every partition's result, in order; JobError naming each failed partition."""
    if errors:
        raise JobError(f"{what}: " + "; ".join(errors))
    return [r for r in results if r is not None]


# -- processes on this machine ------------------------------------------------------------


def _process_main(
    task: PartitionTask, conn: Connection, progress: Any, slot: int
) -> None:  # pragma: no cover -- runs in the child
    def report(stats: ReplayStats) -> None:
        progress[2 * slot] = stats.records
        progress[2 * slot + 1] = stats.findings

    try:
        result: object = run_partition(task, report)
    except BaseException as e:  # noqa: BLE001 -- the parent reports it
        result = f"{type(e).__name__}: {error_text(e)}"
    conn.send(result)
    conn.close()


def _run_processes(job: ReplayJob, tasks: list[PartitionTask]) -> list[PartitionResult]:
    """One spawned process a partition; a line of progress on a terminal."""
    context = multiprocessing.get_context("spawn")
    progress = context.Array("d", 2 * len(tasks), lock=False)
    running = []
    for i, task in enumerate(tasks):
        receive, send = context.Pipe(duplex=False)
        proc = context.Process(
            target=_process_main, args=(task, send, progress, i), name=f"crosstalk-part-{i}"
        )
        proc.start()
        send.close()
        running.append((proc, receive))
    results: list[PartitionResult | None] = [None] * len(tasks)
    errors: list[str] = []
    line = StatusLine(sys.stderr, job.progress)
    try:
        pending = set(range(len(tasks)))
        while pending:
            for i in sorted(pending):
                proc, receive = running[i]
                if receive.poll(0.1 if len(pending) == 1 else 0.05):
                    try:
                        got = receive.recv()
                    except EOFError:
                        got = f"worker exited with status {proc.exitcode}"
                    pending.discard(i)
                    proc.join()
                    if isinstance(got, PartitionResult):
                        results[i] = got
                    else:
                        errors.append(f"partition {i + 1}/{len(tasks)}: {got}")
                elif not proc.is_alive() and not receive.poll():
                    pending.discard(i)
                    errors.append(
                        f"partition {i + 1}/{len(tasks)}: worker exited with status "
                        f"{proc.exitcode} before its result"
                    )
            line.show(
                f"{len(tasks) - len(pending)}/{len(tasks)} partitions done  "
                f"{int(sum(progress[0::2])):,} records  {int(sum(progress[1::2])):,} findings"
            )
    finally:
        line.clear()
        for proc, _ in running:
            if proc.is_alive():
                proc.terminate()
            proc.join()
    return _all_results(results, errors, "replay worker failed")


# -- Ray ------------------------------------------------------------------------------------


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise JobError(
            "--ray needs Ray: pip install 'crosstalk[ray]' (on the driver and the cluster)"
        ) from None
    return ray


def _connect(job: ReplayJob) -> Any:
    ray = _ray()
    if ray.is_initialized():
        return ray
    try:
        if job.ray:
            ray.init(address=job.ray, log_to_driver=False)
        else:  # a Ray of this machine only, started for this replay
            ray.init(
                num_cpus=job.jobs if job.jobs > 1 else None,
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",
            )
    except Exception as e:  # noqa: BLE001 -- Ray's errors are many; all end the job
        where = job.ray or "a local Ray"
        raise JobError(f"--ray: cannot start or reach {where}: {error_text(e)}") from e
    return ray


def _ray_workers(job: ReplayJob) -> int:
    """Partitions for a Ray run: ``--jobs`` when given, else the cluster's CPUs."""
    ray = _connect(job)
    if job.jobs > 1:
        return job.jobs
    return max(1, math.floor(ray.cluster_resources().get("CPU", 1)))


def _run_ray(job: ReplayJob, tasks: list[PartitionTask]) -> list[PartitionResult]:
    ray = _connect(job)
    if job.ray_ship:
        shipped = {path: ray.put(Path(path).read_bytes()) for path in job.paths}
        learned = state_path(job)
        if learned and Path(learned).is_file():
            shipped[STATE] = ray.put(Path(learned).read_bytes())
        tasks = [replace(t, shipped=shipped) for t in tasks]
    remote = ray.remote(num_cpus=1, max_retries=0)(run_partition)
    refs = [remote.remote(task) for task in tasks]
    order = {ref: i for i, ref in enumerate(refs)}
    results: list[PartitionResult | None] = [None] * len(tasks)
    pending = list(refs)
    errors: list[str] = []
    line = StatusLine(sys.stderr, job.progress)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                i = order[ref]
                try:
                    results[i] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 -- a task's error, reported whole
                    errors.append(f"partition {i + 1}/{len(tasks)}: {error_text(e)}")
            line.show(f"{len(tasks) - len(pending)}/{len(tasks)} partitions done on Ray")
    finally:
        line.clear()
        for ref in pending:  # interrupted: no task keeps running on the cluster
            ray.cancel(ref, force=True)
    return _all_results(results, errors, "replay task failed")
