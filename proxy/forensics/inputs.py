"""What every reader of ``crosstalk replay`` shares: the opened input, skipped records,
times, the tenant a log record names, and the exchange built from a logged text.

The readers themselves are in ``proxy.forensics.readers`` (HTTP captures, crosstalk's
JSON lines, and the registry), ``gateway_logs`` (LiteLLM), ``engine_logs`` (SGLang,
vLLM) and ``otel`` (OpenTelemetry GenAI traces).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson

from proxy.forensics.replayer import ExchangeRecord, RecordedResponse
from proxy.redaction import unquoted


class InputError(Exception):
    """An input that cannot be replayed at all (missing, unreadable, unknown format)."""


@dataclass(frozen=True, slots=True)
class Skipped:
    """A record that could not be read, and where it was."""

    path: str
    record: int  # 1-based record number in the file (a line number for JSON lines)
    offset: int | None  # byte offset where the record starts, when known
    reason: str

    @property
    def position(self) -> str:
        where = f"{self.path}: record {self.record}"
        return where + (f" (byte {self.offset})" if self.offset is not None else "")


OnSkip = Callable[[Skipped], None]


class RecordedHeaders:
    """Headers a log or capture recorded, as the replay reads them (``HeaderView``): a
    case-insensitive ``get`` that joins a repeated field's values with ", ", as
    mitmproxy's ``Headers`` does. Its own small class: importing mitmproxy's HTTP
    model for this took ~17 MB of a replay's RSS; only flow files need it."""

    __slots__ = ("_values",)

    def __init__(self, **fields: str) -> None:
        """``fields``: names with ``_`` for ``-`` (``content_type="text/plain"``)."""
        self._values: dict[str, list[str]] = {}
        for name, value in fields.items():
            self.add(name.replace("_", "-"), value)

    def add(self, name: str, value: str) -> None:
        """One more value of ``name``, after those it has."""
        self._values.setdefault(name.lower(), []).append(value)

    def __setitem__(self, name: str, value: str) -> None:
        self._values[name.lower()] = [value]

    def get(self, name: str, default: str | None = None, /) -> str | None:
        values = self._values.get(name.lower())
        return ", ".join(values) if values else default

    def __repr__(self) -> str:
        return f"RecordedHeaders({self._values!r})"


@dataclass(frozen=True)
class TenantFrom:
    """Where a log record names its tenant, beyond what its format names by default
    (``replay --tenant-from FIELD``, ``--tenant-pattern REGEX``).

    A field is a dotted path in the record as its reader exposes it (docs/forensics.md
    lists them per format). The pattern, when given, is searched in the field's value:
    its first group (else the whole match) is the tenant; no match, no tenant."""

    fields: tuple[str, ...] = ()
    pattern: re.Pattern[str] | None = None

    def pick(self, lookup: Callable[[str], Any], defaults: Sequence[str] = ()) -> str | None:
        """The first tenant found: the given fields (through the pattern), then the
        format's ``defaults`` (as they are)."""
        for name, pattern in [(f, self.pattern) for f in self.fields] + [
            (f, None) for f in defaults
        ]:
            value = lookup(name)
            if isinstance(value, bool) or not isinstance(value, str | int):
                continue
            text = str(value).strip()
            if pattern is not None:
                m = pattern.search(text)
                text = (m.group(1) if m.groups() else m.group()).strip() if m else ""
            if text:
                return text
        return None


#: No fields beyond the format's own.
NO_TENANT_FIELDS = TenantFrom()


@dataclass
class InputFile:
    """One opened input: its format, the (decompressed) stream, and its progress."""

    path: Path
    format: str
    raw: IO[bytes]  # the file as stored: its position is the progress
    stream: IO[bytes]  # what readers read (decompressed when gzip)
    size: int
    tenant_from: TenantFrom = field(default_factory=TenantFrom)
    #: The engine's log cut text at this many characters without a marker (vLLM's
    #: ``--max-log-len``): text of exactly that length counts as cut.
    max_log_len: int | None = None
    #: Where a reader of one record a line starts (a partition's worker, seeked there):
    #: the byte offset of a line and its number.
    first_offset: int = 0
    first_line: int = 1

    @property
    def name(self) -> str:
        return str(self.path)

    def progress(self) -> int:
        """Bytes of the stored file consumed so far."""
        try:
            return self.raw.tell()
        except (OSError, ValueError):
            return self.size

    def close(self) -> None:
        self.stream.close()
        self.raw.close()


#: Epoch seconds a record may name: 1970 to the year 5138 (``datetime`` and the report's
#: times cannot go further; a log that says otherwise is broken).
MAX_EPOCH = 1e11


def seconds(value: Any, name: str) -> float:
    """A finite number of seconds in 0..MAX_EPOCH from a logged number. Raises ValueError."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a number of seconds") from None
    if isinstance(value, bool) or not 0 <= number <= MAX_EPOCH:  # also NaN
        raise ValueError(f"{name} is out of range: {value!r}")
    return number


def epoch(value: Any, name: str) -> float:
    """Epoch seconds from a number or an ISO 8601 string. Raises ValueError."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return seconds(value, name)
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except (ValueError, OverflowError):
            pass
        else:
            return seconds(when, name)
    raise ValueError(f"{name} must be epoch seconds or an ISO 8601 time")


def body_bytes(value: Any, name: str) -> bytes:
    """A logged body as bytes: an object as JSON, a string as UTF-8, None as empty."""
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict | list):
        return orjson.dumps(value)
    raise ValueError(f"{name} must be a JSON object or a string")


def field_at(obj: Any, dotted: str) -> Any:
    """``obj``'s value at a dotted path (``metadata.user_api_key_alias``), else None."""
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def reason(error: Exception) -> str:
    """An exception as one short line, for a skipped record's message: what a reader's
    or a library's message quotes of the record is left out (``redaction.unquoted``)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return unquoted(text)


#: What reading one record may raise on bad input (the record is then skipped).
RECORD_ERRORS = (ValueError, KeyError, TypeError, ArithmeticError, RecursionError)


def read_json_lines(
    source: InputFile, on_skip: OnSkip, make: Callable[[Any, str, str], ExchangeRecord]
) -> Iterator[ExchangeRecord]:
    """One record per JSON line, by ``make(object, position, fallback id)``."""
    for number, start, line in numbered_lines(source):
        position = f"{source.name}:{number}"
        try:
            record = make(orjson.loads(line), position, f"{source.path.name}:{number}")
        except RECORD_ERRORS as e:
            on_skip(Skipped(source.name, number, start, bad_line(line, e)))
            continue
        record.origin = source.name
        yield record


def numbered_lines(source: InputFile) -> Iterator[tuple[int, int, bytes]]:
    """``(line number, byte offset, line)`` of every line that is not blank, from
    ``source.first_offset`` on."""
    offset = source.first_offset
    if offset:
        source.stream.seek(offset)
    for number, line in enumerate(source.stream, source.first_line):
        start, offset = offset, offset + len(line)
        if line and not line.isspace():  # strip()'s test, without a copy of the line
            yield number, start, line


def bad_line(line: bytes, error: Exception) -> str:
    cut = "" if line.endswith(b"\n") else " (last line, cut short?)"
    return f"bad line{cut}: {reason(error)}"


@dataclass
class LoggedExchange:
    """An exchange as a log tells it: the texts it kept and what it could not keep.

    ``request`` / ``response`` are the API bodies rebuilt from the logged text (None:
    the log kept none of it); ``failed``: the log says the call failed (no response
    expected); ``partial``: what of the kept text the log cut; ``tenant_missing``:
    why no tenant could be read (the format has no such field); ``headers``: request
    headers the log kept (the tenant rules read them)."""

    time: float
    end: float
    path: str
    request: dict | None
    response: dict | list | None  # a list: the answer to a batch (SGLang /generate)
    request_id: str | None = None
    tenant: str | None = None
    tenant_missing: str | None = None
    failed: bool = False
    partial: list[str] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    missing_note: str | None = None  # why a text is not in the log (its settings)
    # False: the log kept no prompt, and ``request`` is an empty one that lets the
    # logged output still be scanned (against the other tenants' texts); the exchange
    # counts as not scannable whole.
    prompt_logged: bool = True

    def record(self, position: str, origin: str, fallback_id: str) -> ExchangeRecord:
        headers = RecordedHeaders()
        for key, value in self.headers.items():
            headers.add(key, value)
        if self.request_id:
            headers["x-request-id"] = self.request_id
        response = None
        if not self.failed:
            body = orjson.dumps(self.response) if self.response is not None else b""
            response = RecordedResponse(
                200,
                RecordedHeaders(content_type="application/json"),
                body,
                self.end,
                self.end,
                recorded=self.response is not None,
            )
        return ExchangeRecord(
            time=self.time,
            position=position,
            method="POST",
            path=self.path,
            headers=headers,
            body=orjson.dumps(self.request) if self.request is not None else b"",
            response=response,
            fallback_id=fallback_id,
            tenant=self.tenant,
            end=self.end,
            body_recorded=self.request is not None and self.prompt_logged,
            origin=origin,
            partial="; ".join(self.partial) or None,
            tenant_missing=self.tenant_missing if self.tenant is None else None,
            missing_note=self.missing_note,
        )
