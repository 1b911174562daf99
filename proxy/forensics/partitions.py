"""Time partitions of a replay: where to cut the inputs so that N workers share the work.

A partition reports the exchanges whose request time lies in ``[start, end)``. Before
its start it replays the ``window`` of traffic the engine would still hold there
(``detection.window_seconds``) as warm-up, and after its end the exchanges that arrive
while its own last ones still stream (a prompt that arrives mid-stream is known to the
rest of that stream): both observed, neither reported. What the engine forgets within
the warm-up is then as the serial replay has it. One thing it never forgets: the plain
vocabulary (a word used by enough tenants stays plain). Of the traffic before the
warm-up, every ``learn_every``-th exchange teaches the partition's engine its words and
nothing else (``Replayer.learn_only``): a partition then calls about the same words
plain as the serial replay (docs/forensics.md, "Replay on every core", measures what the
edges change).

Cutting needs each input's times. A file with one record a line (crosstalk's JSON
lines, LiteLLM payloads), not compressed, is sampled: the record after each of
``SAMPLES`` evenly spaced byte offsets gives a time, and a worker seeks to the sample
before its warm-up (``LineSpan``) instead of reading from the start. Any other input
(flows, HAR, gzip, engine logs whose records span lines) is read whole once for its
record times, and each worker reads it from the start. When words are learned before
the warm-up, every worker reads every input from its start. Work is balanced by bytes of
input: a partition's cost is the bytes of its span and its warm-up, plus a share
(``prefix_cost``) of the bytes before them.
"""

from __future__ import annotations

import bisect
import io
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from proxy.forensics.inputs import InputFile, Skipped
from proxy.forensics.readers import read_records
from proxy.forensics.replayer import ExchangeRecord

#: Formats with exactly one record a line: a reader may start at any line.
LINE_FORMATS = ("jsonl", "litellm")
#: Byte offsets sampled per line-format input (each costs one line read and parsed).
SAMPLES = 512
#: Lines tried after a sampled offset before giving up on it (blank or broken lines).
SAMPLE_LINES = 16


@dataclass(frozen=True, slots=True)
class LineSpan:
    """Where a worker starts reading a line-format input: a line's byte offset and its
    1-based number (so record positions and fallback ids are those of a whole read)."""

    offset: int
    number: int


@dataclass(frozen=True, slots=True)
class Partition:
    """One worker's share. ``start``/``end``: the request times it reports (-inf/inf at
    the outer edges); ``warm_from``: where its warm-up begins. ``spans``: per seekable
    input (by name), where to start reading; ``owned``: per seekable input, the byte
    range whose unreadable records this partition reports (so each is reported once).
    Unreadable records of the other inputs are reported by the last partition, the one
    that reads them to their end."""

    index: int
    count: int
    start: float
    end: float
    warm_from: float
    spans: dict[str, LineSpan] = field(default_factory=dict)
    owned: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def reports_skip(self, skipped: Skipped) -> bool:
        """Is ``skipped`` (a record a reader could not read) this partition's to report?"""
        owned = self.owned.get(skipped.path)
        if owned is None or skipped.offset is None:
            return self.last
        return owned[0] <= skipped.offset < owned[1]

    def records(
        self,
        records: Iterable[ExchangeRecord],
        before: Callable[[ExchangeRecord], None] | None = None,
    ) -> Iterator[ExchangeRecord]:
        """Of a time-ordered stream, what this partition replays: from ``warm_from`` on,
        and past ``end`` as long as an exchange it reports may still be streaming. Stops
        reading there (the stream is lazy). Records before ``warm_from`` go to
        ``before`` (when given)."""
        busy_until = -math.inf
        for record in records:
            if record.time < self.warm_from:
                if before is not None:
                    before(record)
                continue
            if record.time >= self.end and record.time > busy_until:
                return
            if record.time >= self.start and record.time < self.end:
                busy_until = max(busy_until, last_moment(record))
            yield record


def last_moment(record: ExchangeRecord) -> float:
    """When an exchange is over: its response's last byte, or its failure."""
    if record.response is not None:
        return max(record.response.end, record.time)
    return record.end if record.end is not None else record.time


@dataclass(frozen=True, slots=True)
class Timeline:
    """An input's cumulative bytes against time: ``times`` ascending (running maximum
    of the record times, so a file a little out of order is still monotone), ``bytes``
    the input's bytes before each. ``lines``: the line numbers at those offsets, for a
    seekable input (None: read whole)."""

    name: str
    size: int
    times: list[float]
    offsets: list[int]
    lines: list[int] | None

    def bytes_before(self, when: float) -> float:
        """Bytes of the input before time ``when`` (interpolated between samples)."""
        i = bisect.bisect_left(self.times, when)
        if i == 0:
            return 0.0
        if i == len(self.times):
            return float(self.size)
        t0, t1 = self.times[i - 1], self.times[i]
        o0, o1 = self.offsets[i - 1], self.offsets[i]
        share = 0.0 if t1 <= t0 else (when - t0) / (t1 - t0)
        return o0 + share * (o1 - o0)

    def span_before(self, when: float, back_lines: int) -> LineSpan:
        """The sampled line to start reading at to see every record from ``when`` on: the
        last sample before ``when``, then back ``back_lines`` more lines, as far out of
        time order as the serial replay's sort buffer lets a record be (the file's start
        when that goes past the first sample)."""
        assert self.lines is not None
        i = bisect.bisect_left(self.times, when) - 1
        if i >= 0:
            i = bisect.bisect_right(self.lines, self.lines[i] - back_lines) - 1
        return LineSpan(self.offsets[i], self.lines[i]) if i > 0 else LineSpan(0, 1)

    def offset_at(self, when: float) -> int:
        """The sampled offset where the records from ``when`` on begin."""
        i = bisect.bisect_left(self.times, when)
        return self.size if i == len(self.times) else self.offsets[i]


def _monotone(times: list[float]) -> list[float]:
    out, top = [], -math.inf
    for t in times:
        top = max(top, t)
        out.append(top)
    return out


def first_record_time(source: InputFile, line: bytes) -> float | None:
    """The time of the record ``line`` holds in ``source``'s format, or None."""
    one = InputFile(
        source.path, source.format, io.BytesIO(), io.BytesIO(line), len(line), source.tenant_from
    )
    record = next(read_records(one, lambda _skipped: None), None)
    return None if record is None else record.time


def sampled_timeline(source: InputFile, samples: int = SAMPLES, *, seek: bool = True) -> Timeline:
    """The timeline of a seekable input from the line after each of ``samples`` evenly
    spaced byte offsets (its own file handle: ``source`` is left where it was). With
    ``seek``, the line numbers at the samples too (a read of the whole file's bytes), for
    workers that start reading there; without, a timeline of an input read whole."""
    times: list[float] = []
    offsets: list[int] = []
    lines: list[int] = []
    size = source.size
    with source.path.open("rb") as f:
        number, counted_to = 1, 0
        for k in range(samples):
            target = size * k // samples
            f.seek(max(0, target - 1))
            if target > 0:
                f.readline()  # the rest of the line holding target - 1
            for _ in range(SAMPLE_LINES):
                offset = f.tell()
                line = f.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                when = first_record_time(source, line)
                if when is None:
                    continue
                if offsets and offset <= offsets[-1]:
                    break  # a line longer than the step: sampled already
                if seek:
                    f.seek(counted_to)
                    number += _count_newlines(f, offset - counted_to)
                    counted_to = offset
                    f.seek(offset + len(line))
                times.append(when)
                offsets.append(offset)
                lines.append(number)
                break
    return Timeline(source.name, size, _monotone(times), offsets, lines if seek else None)


def _count_newlines(f: IO[bytes], nbytes: int) -> int:
    count = 0
    while nbytes > 0:
        block = f.read(min(nbytes, 1 << 22))
        if not block:
            break
        count += block.count(b"\n")
        nbytes -= len(block)
    return count


def scanned_timeline(source: InputFile, records: Iterable[ExchangeRecord]) -> Timeline:
    """The timeline of an input read whole: every record's time, its body bytes as the
    work it stands for."""
    pairs = sorted((r.time, r.nbytes) for r in records)
    times, offsets, total = [], [], 0
    for when, nbytes in pairs:
        times.append(when)
        offsets.append(total)
        total += nbytes
    return Timeline(source.name, total, times, offsets, None)


def seekable(source: InputFile) -> bool:
    """Can a worker start reading ``source`` at a line (one record a line, stored plain)?"""
    return source.format in LINE_FORMATS and source.stream is source.raw


def plan(
    timelines: Sequence[Timeline],
    jobs: int,
    window: float,
    prefix_cost: float = 0.0,
    back_lines: int = 1024,
) -> list[Partition]:
    """At most ``jobs`` partitions of the inputs' time span whose costs (bytes of the span
    plus its warm-up, plus ``prefix_cost`` times the bytes before the warm-up) are as
    even as a binary search on the largest cost makes them. A worker seeking in an input
    starts ``back_lines`` lines before its warm-up's first sample (the sort buffer)."""
    known = [t for t in timelines if t.times]
    if jobs <= 1 or not known:
        return [_partition(0, 1, -math.inf, math.inf, window, timelines, back_lines)]
    lo_t = min(t.times[0] for t in known)
    hi_t = max(t.times[-1] for t in known)

    def mass(when: float) -> float:
        return sum(t.bytes_before(when) for t in known)

    total = mass(math.inf)

    def cuts_for(budget: float) -> list[float] | None:
        """Greedy: each partition as long as its cost stays within ``budget``."""
        cuts: list[float] = []
        start = -math.inf
        for _ in range(jobs - 1):
            base = mass(start - window) if start > -math.inf else 0.0
            base -= prefix_cost * base  # the prefix costs its share, the rest nothing
            if total - base <= budget:
                return cuts
            a, b = (lo_t if start == -math.inf else start), hi_t
            for _ in range(60):
                mid = (a + b) / 2
                if mass(mid) - base <= budget:
                    a = mid
                else:
                    b = mid
            if a <= (lo_t if start == -math.inf else start):
                return None  # no progress: the budget is below one sample's bytes
            cuts.append(a)
            start = a
        base = mass(start - window) * (1 - prefix_cost)
        return cuts if total - base <= budget else None

    lo_b, hi_b = total / jobs, total
    best = cuts_for(hi_b) or []
    for _ in range(40):
        mid = (lo_b + hi_b) / 2
        cuts = cuts_for(mid)
        if cuts is None:
            lo_b = mid
        else:
            hi_b, best = mid, cuts
    edges = [-math.inf, *best, math.inf]
    count = len(edges) - 1
    return [
        _partition(i, count, edges[i], edges[i + 1], window, timelines, back_lines)
        for i in range(count)
    ]


def _partition(
    index: int,
    count: int,
    start: float,
    end: float,
    window: float,
    timelines: Sequence[Timeline],
    back_lines: int,
) -> Partition:
    """Partition ``index``: its span, warm-up, and per seekable input where it starts
    reading and which bytes' unreadable records it reports: from its own start line to
    the next partition's (whose start lies before this one's end, so this one reads
    that far)."""
    warm_from = start - window
    spans: dict[str, LineSpan] = {}
    owned: dict[str, tuple[int, int]] = {}
    for t in timelines:
        if t.lines is None or not t.times:
            continue
        span = t.span_before(warm_from, back_lines) if start > -math.inf else LineSpan(0, 1)
        following = t.span_before(end - window, back_lines) if end < math.inf else None
        spans[t.name] = span
        owned[t.name] = (span.offset, t.size + 1 if following is None else following.offset)
    return Partition(index, count, start, end, warm_from, spans, owned)
