"""The fingerprint journal: forensic history without anyone's text.

``crosstalk run --journal DIR`` appends the engine's keyed records (``proxy.engine.
records``) of every exchange to gzip-compressed JSON-lines segments in ``DIR``; ``crosstalk
replay DIR`` replays them through an engine with the same key and reaches the findings
that replaying the raw traffic would (the records are what the engine learns, in the
order it learned it).

A segment starts with a header line naming the format version, the hashing key's id and
the shingle size: a journal made under another key is refused, never silently
mismatched. Segments rotate by size and age; segments older than the retention are
deleted when a new one starts. Each record is one line, flushed as a gzip sync point, so
a crash loses at most the line being written and a reader skips a corrupt line with its
position.
"""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import orjson

from proxy.engine import Engine
from proxy.engine.ordered_replay import RecordReplayer
from proxy.engine.records import CanaryRecord, Record
from proxy.store.codec import DECODE_ERRORS, from_journal_line, journal_line

FORMAT = "crosstalk-journal"
VERSION = 1
SUFFIX = ".ctj.gz"


class JournalError(ValueError):
    """A journal that cannot be used (another key, another format)."""


@dataclass(frozen=True, slots=True)
class JournalSettings:
    directory: str
    max_segment_bytes: int = 64 << 20
    max_segment_seconds: float = 3600.0
    retention_days: float = 30.0


# -- encoding -------------------------------------------------------------------------


# One schema, two encodings: proxy.store.codec. A journal holds lines.
encode = journal_line
decode = from_journal_line


def header(key_id: str, k: int) -> bytes:
    return orjson.dumps({"format": FORMAT, "version": VERSION, "key_id": key_id, "k": k}) + b"\n"


# -- writing --------------------------------------------------------------------------


class JournalWriter:
    """Appends records to the current segment of a journal directory."""

    def __init__(
        self,
        settings: JournalSettings,
        key_id: str,
        k: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.directory = Path(settings.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._header = header(key_id, k)
        self._clock = clock
        self._file: gzip.GzipFile | None = None
        self._raw_bytes = 0
        self._opened = 0.0
        self._sequence = 0
        self.records = 0
        self.bytes_in = 0  # uncompressed bytes of the records written

    def write(self, record: Record) -> None:
        line = encode(record)
        now = self._clock()
        if self._file is None or self._must_rotate(now):
            self._rotate(now)
        assert self._file is not None  # _rotate opened a segment
        self._file.write(line)
        # A sync point per record: everything written so far can be read back even if
        # the process dies before closing the segment.
        self._file.flush()
        self.records += 1
        self.bytes_in += len(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def segment_path(self) -> Path | None:
        return Path(self._file.name) if self._file is not None else None

    def _must_rotate(self, now: float) -> bool:
        assert self._file is not None
        # gzip.open of a path: the segment's own file object, which has a descriptor.
        size = os.fstat(cast(BinaryIO, self._file.fileobj).fileno()).st_size
        return (
            size >= self.settings.max_segment_bytes
            or now - self._opened >= self.settings.max_segment_seconds
        )

    def _rotate(self, now: float) -> None:
        self.close()
        self._prune(now)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
        self._sequence += 1
        path = self.directory / f"journal-{stamp}-{os.getpid()}-{self._sequence:04d}{SUFFIX}"
        self._file = gzip.open(path, "ab")  # noqa: SIM115 -- open across writes
        self._file.write(self._header)
        self._opened = now

    def _prune(self, now: float) -> None:
        horizon = now - self.settings.retention_days * 86400
        for path in self.directory.glob(f"journal-*{SUFFIX}"):
            try:
                if path.stat().st_mtime < horizon:
                    path.unlink()
            except OSError:
                pass  # another writer's segment, or gone already


# -- reading --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Corrupt:
    """A line that could not be read, and where it is."""

    path: str
    line: int
    reason: str

    @property
    def position(self) -> str:
        return f"{self.path}:{self.line}"


def segments(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Journal segments of ``paths`` (files, or directories of segments), in name order
    (which is time order within a directory)."""
    found: list[Path] = []
    for p in map(Path, paths):
        found += sorted(p.glob(f"journal-*{SUFFIX}")) if p.is_dir() else [p]
    return found


def is_journal(path: str | os.PathLike) -> bool:
    p = Path(path)
    if p.is_dir():
        return any(p.glob(f"journal-*{SUFFIX}"))
    return p.name.endswith(SUFFIX)


def check(paths: Iterable[str | os.PathLike], key_id: str, k: int) -> list[Path]:
    """The segments of ``paths``, each header checked (format, version, key, k) before
    anything is replayed. Raises JournalError."""
    found = segments(paths)
    if not found:
        raise JournalError("no journal segments (journal-*.ctj.gz) found")
    for path in found:
        try:
            with gzip.open(path, "rb") as f:
                _check_header(path, f.readline(), key_id, k)
        except (OSError, EOFError) as e:
            raise JournalError(f"{path}: unreadable: {e}") from e
    return found


def _check_header(path: Path, line: bytes, key_id: str, k: int) -> None:
    try:
        head = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise JournalError(f"{path}: not a crosstalk journal ({e})") from e
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise JournalError(f"{path}: not a crosstalk journal")
    if head.get("version") != VERSION:
        raise JournalError(f"{path}: journal version {head.get('version')}, not {VERSION}")
    if head.get("key_id") != key_id or head.get("k") != k:
        raise JournalError(
            f"{path}: written with key {head.get('key_id')} k={head.get('k')}, this "
            f"engine has key {key_id} k={k}: set detection.key to the journal's key"
        )


def read(
    paths: Iterable[str | os.PathLike],
    key_id: str,
    k: int,
    on_corrupt: Callable[[Corrupt], None] = lambda c: None,
) -> Iterator[Record]:
    """Every record of the segments in ``paths``, in order. Raises JournalError when a
    segment was written under another key or shingle size; a corrupt line (or a
    segment cut short) is reported to ``on_corrupt`` and skipped."""
    for path in segments(paths):
        yield from _read_segment(path, key_id, k, on_corrupt)


def _read_segment(path: Path, key_id: str, k: int, on_corrupt) -> Iterator[Record]:
    with gzip.open(path, "rb") as f:
        lines = _lines(f, path, on_corrupt)
        first = next(lines, None)
        if first is None:
            return
        _check_header(path, first[1], key_id, k)
        for number, line in lines:
            try:
                yield decode(line)
            except DECODE_ERRORS as e:
                on_corrupt(Corrupt(str(path), number, f"{type(e).__name__}: {e}"))


def _lines(f: gzip.GzipFile, path: Path, on_corrupt) -> Iterator[tuple[int, bytes]]:
    number = 0
    try:
        for number, line in enumerate(f, 1):
            yield number, line
    except (EOFError, OSError, gzip.BadGzipFile) as e:
        on_corrupt(Corrupt(str(path), number + 1, f"segment cut short: {e}"))


def load_window(
    engine: Engine, paths: Iterable[str | os.PathLike], now: float | None = None
) -> tuple[int, int]:
    """Teach ``engine`` the journal's records of the last window (``window_seconds``
    before ``now``): a restarted proxy still knows the prompts and outputs it saw before
    the restart. Findings among them were reported at the time and are not repeated.
    Returns (records loaded, corrupt lines skipped). Raises JournalError for another
    key."""
    now = time.time() if now is None else now
    horizon = now - engine.config.window_seconds
    recent = [p for p in segments(paths) if p.stat().st_mtime >= horizon]
    if not recent:
        return 0, 0
    corrupt: list[Corrupt] = []
    replayer = RecordReplayer(engine)
    loaded = 0
    for record in read(recent, engine.hasher.key_id, engine.config.k, corrupt.append):
        if record.time >= horizon or isinstance(record, CanaryRecord):
            replayer.push(record)
            loaded += 1
    replayer.close()
    return loaded, len(corrupt)
