"""Captured traffic for ``crosstalk replay``: mitmproxy flow files, HAR, JSON lines.

Each reader turns one file into ``ExchangeRecord``s lazily, in file order, so a file
larger than memory is read record by record. A record that cannot be read is reported
(``Skipped``: file, record number, byte offset or line, reason) and skipped; the reader
carries on with the next record it can find and never ends the replay early.

* ``flows``: what ``mitmdump -w`` and ``crosstalk run --capture`` write, read with
  mitmproxy's own ``FlowReader``. After a corrupt record the reader scans forward for
  the next byte offset where a whole flow parses.
* ``har``: HTTP Archive 1.2 (browsers, mitmproxy's ``save.har``). The ``entries`` array
  is cut out of the document incrementally (never loaded whole); each entry becomes a
  flow through mitmproxy's own HAR importer.
* ``jsonl``: crosstalk's exchange format, one JSON object a line (``JSONL_FIELDS``).
* ``litellm``: LiteLLM's ``StandardLoggingPayload``, one JSON object a line (its GCS and
  file loggers' newline-delimited JSON; ``litellm/types/utils.py``): ``messages`` and
  ``response`` replayed as a chat exchange, the tenant from the key's team.

Files may be gzip-compressed. ``sniff`` picks the format from the first bytes and the
name. A new format (the fingerprint journal) is one more entry in ``READERS``.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import orjson
from mitmproxy import exceptions, http
from mitmproxy.io import FlowReader
from mitmproxy.io.har import request_to_flow

from proxy.forensics.replayer import ExchangeRecord, RecordedResponse
from proxy.mitm.capture import CHUNKS_KEY, ENDED_KEY, OBSERVED_KEY, chunk_timing

FORMATS = ("flows", "har", "jsonl", "litellm")

#: The JSON-lines exchange format, one object per request (docs/forensics.md, "Forensic replay").
JSONL_FIELDS = {
    "time": "request time: epoch seconds, or ISO 8601 (required)",
    "response_time": "first byte of the response: epoch seconds or ISO 8601 (default: time)",
    "end_time": "response fully received: epoch seconds or ISO 8601 (default: time)",
    "tenant": "the tenant, used as is (else derived from headers / the body's user)",
    "headers": "request headers, an object (tenant header, Authorization, X-Request-ID)",
    "request_id": "request id (default: the X-Request-ID header, else file:line)",
    "method": "HTTP method (default POST)",
    "path": "request path, e.g. /v1/chat/completions (required)",
    "request": "request body: a JSON object, or the raw body as a string",
    "status": "response status (default 200)",
    "response": "non-streamed response body: a JSON object or a string",
    "sse": "streamed response: the raw SSE text (data: ... lines)",
}


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


@dataclass
class InputFile:
    """One opened input: its format, the (decompressed) stream, and its progress."""

    path: Path
    format: str
    raw: IO[bytes]  # the file as stored: its position is the progress
    stream: IO[bytes]  # what readers read (decompressed when gzip)
    size: int

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


def sniff(head: bytes, name: str) -> str | None:
    """The format of a file starting with ``head`` (decompressed), or None."""
    lower = name.lower().removesuffix(".gz")
    body = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if re.match(rb"[0-9]{1,12}:", body):
        return "flows"  # a tnetstring: mitmproxy's flow file
    if not body.startswith(b"{"):
        return None
    if lower.endswith(".har"):
        return "har"
    first = body.split(b"\n", 1)[0]
    try:
        obj = orjson.loads(first)
    except orjson.JSONDecodeError:
        if lower.endswith((".jsonl", ".ndjson")):
            return "jsonl"
        # A first line that is not a whole object: pretty-printed JSON, i.e. a HAR
        # (unless the line was cut by the sniff buffer: then it is a long JSON line).
        return "jsonl" if b"\n" not in body and len(head) >= SNIFF_BYTES else "har"
    if isinstance(obj, dict) and "log" in obj:
        return "har"
    if isinstance(obj, dict) and is_litellm_payload(obj):
        return "litellm"
    return "jsonl"


SNIFF_BYTES = 65536


def open_input(path: str | Path, fmt: str = "auto") -> InputFile:
    """Open ``path`` for replay and settle its format. Raises InputError."""
    p = Path(path)
    try:
        raw = p.open("rb")
        size = p.stat().st_size
    except OSError as e:
        raise InputError(f"{p}: cannot open: {e.strerror or e}") from e
    try:
        stream: IO[bytes] = raw
        if raw.read(2) == b"\x1f\x8b":
            raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
        else:
            raw.seek(0)
        head = stream.read(SNIFF_BYTES)
        stream.seek(0)
    except (OSError, EOFError) as e:
        raw.close()
        raise InputError(f"{p}: unreadable: {e}") from e
    found = sniff(head, p.name) if fmt == "auto" else fmt
    if found not in READERS:
        raw.close()
        if not head.strip():
            raise InputError(f"{p}: empty file")
        raise InputError(f"{p}: not a flow file, HAR, JSON-lines capture or LiteLLM log")
    return InputFile(p, found, raw, stream, size)


def read_records(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    """The records of ``source``, in file order; unreadable ones go to ``on_skip``."""
    return READERS[source.format](source, on_skip)


# -- mitmproxy flow files ---------------------------------------------------------------


def flow_record(flow: http.HTTPFlow, position: str) -> ExchangeRecord:
    """A recorded exchange from a mitmproxy flow (as saved or imported)."""
    req = flow.request
    observed = flow.metadata.get(OBSERVED_KEY)  # crosstalk captures: the exact moment
    when = observed if isinstance(observed, float) else req.timestamp_end or req.timestamp_start
    ended = flow.metadata.get(ENDED_KEY)  # crosstalk captures: when the hooks ran
    ended = ended if isinstance(ended, float) else None
    failed_at = (ended or flow.error.timestamp) if flow.error is not None else None
    response = None
    resp = flow.response
    if resp is not None and resp.status_code > 0:
        start = resp.timestamp_start or when
        blob = flow.metadata.get(CHUNKS_KEY)
        chunks = chunk_timing(blob, start) if isinstance(blob, bytes) and blob else None
        end = resp.timestamp_end or failed_at or start
        if ended and "text/event-stream" not in (resp.headers.get("content-type") or ""):
            end = ended  # a buffered body is scanned in the response hook, just after
        response = RecordedResponse(
            status=resp.status_code,
            headers=resp.headers,
            body=resp.raw_content or b"",
            start=start,
            end=end,
            complete=flow.error is None and resp.raw_content is not None,
            chunks=chunks,
            recorded=resp.raw_content is not None,
        )
    return ExchangeRecord(
        time=when,
        position=position,
        method=req.method,
        path=req.path,
        headers=req.headers,
        body=req.get_content(strict=False) or b"",
        response=response,
        fallback_id=f"flow-{flow.id}",
        end=failed_at,
        body_recorded=req.raw_content is not None,
    )


def read_flows(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    fo = source.stream
    number, offset = 0, fo.tell()  # offset: where the next record starts
    while True:
        try:
            for flow in FlowReader(fo).stream():
                number += 1
                start, offset = offset, fo.tell()
                if not isinstance(flow, http.HTTPFlow):
                    continue  # TCP, UDP, DNS flows: no LLM exchange
                try:
                    record = flow_record(flow, f"{source.name}#{number}")
                except (ValueError, TypeError, AttributeError) as e:
                    on_skip(Skipped(source.name, number, start, f"unusable flow: {_reason(e)}"))
                    continue
                yield record
            return
        except (exceptions.FlowReadException, ValueError, TypeError, KeyError) as e:
            number += 1
            on_skip(Skipped(source.name, number, offset, f"corrupt flow record: {e}"))
            resumed = _next_flow(fo, offset + 1)
            if resumed is None:
                return
            fo.seek(resumed)
            offset = resumed


_PREFIX = re.compile(rb"(?<![0-9])([0-9]{1,12}):")
_RESYNC_BLOCK = 1 << 20


def _next_flow(fo: IO[bytes], start: int) -> int | None:
    """The first byte offset at or after ``start`` where a whole flow parses: the
    next record after a corrupt one. Scans in blocks (bounded memory)."""
    pos = start
    while True:
        fo.seek(pos)
        data = fo.read(_RESYNC_BLOCK + 16)
        if not data:
            return None
        for m in _PREFIX.finditer(data):
            if m.start() >= _RESYNC_BLOCK:
                break  # the overlap: seen again at the start of the next block
            if _flow_at(fo, pos + m.start(), m.group(1)):
                return pos + m.start()
        if len(data) <= _RESYNC_BLOCK:
            return None
        pos += _RESYNC_BLOCK


def _flow_at(fo: IO[bytes], offset: int, digits: bytes) -> bool:
    """Does a whole flow (a tnetstring dict that mitmproxy loads) start at ``offset``?"""
    fo.seek(offset + len(digits) + 1 + int(digits))
    if fo.read(1) != b"}":
        return False
    fo.seek(offset)
    try:
        return next(iter(FlowReader(fo).stream()), None) is not None
    except Exception:  # noqa: BLE001 -- any parse failure: not a record start
        return False


# -- HAR -----------------------------------------------------------------------------------

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SPECIAL = re.compile(rb'["{}\[\]]')
_HAR_BLOCK = 1 << 20


def har_entries(fo: IO[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """``(number, byte offset, raw JSON)`` of each element of ``log.entries``, cut out
    of the document incrementally: strings are skipped whole, brackets counted, so
    memory holds one entry at a time. A document cut short ends the iteration with
    ValueError (after the entries that were whole)."""
    buf, base, pos = b"", 0, 0
    depth = 0  # 1: the root object, 2: ``log``, 3: inside ``log.entries``
    last_key = b""  # the last string seen in ``log``: the key of the array that opens
    in_entries, entry_start, number = False, -1, 0
    eof = False
    while True:
        m = _SPECIAL.search(buf, pos)
        if m is None or (m.group() == b'"' and not (s := _STRING.match(buf, m.start()))):
            # Need more input: the next token is not in the buffer, or a string is cut.
            if eof:
                if depth or in_entries:
                    raise ValueError(f"truncated at byte {base + len(buf)} (entry {number + 1})")
                return
            resume = m.start() if m else len(buf)
            keep = entry_start if entry_start >= 0 else resume  # drop what is done with
            chunk = fo.read(_HAR_BLOCK)
            eof = not chunk
            buf, base, pos = buf[keep:] + chunk, base + keep, resume - keep
            if entry_start >= 0:
                entry_start = 0
            continue
        char = m.group()
        if char == b'"':
            if depth == 2:
                last_key = s.group()
            pos = s.end()
            continue
        pos = m.end()
        if char in b"{[":
            depth += 1
            if depth == 3 and char == b"[" and last_key == b'"entries"':
                in_entries = True
            elif in_entries and depth == 4 and entry_start < 0:
                entry_start = m.start()
        else:
            depth -= 1
            if in_entries and depth == 3 and entry_start >= 0:
                number += 1
                yield number, base + entry_start, buf[entry_start:pos]
                buf, base, pos, entry_start = buf[pos:], base + pos, 0, -1
            elif in_entries and depth == 2:
                return  # end of the entries array: nothing else is needed


def _ms(timings: dict, *keys: str) -> float:
    """Sum of HAR timings (milliseconds; -1 means not applicable) in seconds."""
    total = 0.0
    for key in keys:
        value = timings.get(key)
        if isinstance(value, int | float) and value > 0:
            total += value
    return total / 1000


def har_record(entry: dict, position: str, fallback_id: str) -> ExchangeRecord:
    """A recorded exchange from one HAR entry, through mitmproxy's HAR importer; the
    times come from the entry's timings (send, wait, receive)."""
    for part in ("request", "response"):
        if isinstance(entry.get(part), dict):
            entry[part].setdefault("httpVersion", "HTTP/1.1")
            entry[part].setdefault("headers", [])
    if isinstance(entry.get("response"), dict):
        entry["response"].setdefault("content", {})
        entry["response"].setdefault("status", 0)
    entry.setdefault("time", 0)
    flow = request_to_flow(entry)
    started = flow.request.timestamp_start
    timings = entry.get("timings") if isinstance(entry.get("timings"), dict) else None
    if timings:
        sent = started + _ms(timings, "blocked", "dns", "connect", "ssl", "send")
        first = sent + _ms(timings, "wait")
        last = first + _ms(timings, "receive")
    else:
        sent = first = started
        last = started + max(0.0, float(entry.get("time") or 0)) / 1000
    flow.request.timestamp_end = sent
    if flow.response is not None:
        flow.response.timestamp_start, flow.response.timestamp_end = first, last
    record = flow_record(flow, position)
    record.fallback_id = fallback_id
    if record.response is None and flow.response is not None:
        record.end = last  # status 0: the request failed (``_error``)
    return record


def read_har(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    number = 0
    try:
        for number, offset, raw in har_entries(source.stream):
            position = f"{source.name}#{number}"
            try:
                entry = orjson.loads(raw)
                if not isinstance(entry, dict):
                    raise ValueError("an entry must be an object")
                record = har_record(entry, position, f"{source.path.name}:{number}")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                on_skip(Skipped(source.name, number, offset, f"bad HAR entry: {_reason(e)}"))
                continue
            yield record
    except ValueError as e:
        on_skip(Skipped(source.name, number + 1, None, f"HAR cut short: {e}"))


# -- JSON lines ----------------------------------------------------------------------------


def _time(value: Any, name: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    raise ValueError(f"{name} must be epoch seconds or an ISO 8601 time")


def _body(value: Any, name: str) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict | list):
        return orjson.dumps(value)
    raise ValueError(f"{name} must be a JSON object or a string")


def jsonl_record(obj: Any, position: str, fallback_id: str) -> ExchangeRecord:
    """A recorded exchange from one object of the JSON-lines format."""
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    when = _time(obj.get("time"), "time")
    end = _time(obj["end_time"], "end_time") if obj.get("end_time") is not None else when
    first = when
    if obj.get("response_time") is not None:
        first = _time(obj["response_time"], "response_time")
    path = obj.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError("path must be a string starting with /")
    raw_headers = obj.get("headers") or {}
    if not isinstance(raw_headers, dict):
        raise ValueError("headers must be an object")
    headers = http.Headers()
    for key, value in raw_headers.items():
        headers.add(str(key), str(value))
    if isinstance(obj.get("request_id"), str) and obj["request_id"].strip():
        headers["x-request-id"] = obj["request_id"]
    tenant = obj.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant.strip()):
        raise ValueError("tenant must be a non-empty string")
    status = obj.get("status", 200)
    if not isinstance(status, int) or isinstance(status, bool):
        raise ValueError("status must be an integer")
    response = None
    if obj.get("sse") is not None:
        if not isinstance(obj["sse"], str):
            raise ValueError("sse must be a string (the raw event stream)")
        response_headers = http.Headers(content_type="text/event-stream")
        response = RecordedResponse(status, response_headers, obj["sse"].encode(), first, end)
    elif "response" in obj:
        response_headers = http.Headers(content_type="application/json")
        response = RecordedResponse(
            status, response_headers, _body(obj["response"], "response"), end, end
        )
    method = obj.get("method", "POST")
    if not isinstance(method, str):
        raise ValueError("method must be a string")
    return ExchangeRecord(
        time=when,
        position=position,
        method=method.upper(),
        path=path,
        headers=headers,
        body=_body(obj.get("request"), "request"),
        response=response,
        fallback_id=fallback_id,
        tenant=tenant.strip() if tenant else None,
        end=end,
    )


def read_jsonl(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    return _read_lines(source, on_skip, jsonl_record)


def _read_lines(
    source: InputFile, on_skip: OnSkip, make: Callable[[Any, str, str], ExchangeRecord]
) -> Iterator[ExchangeRecord]:
    """One record per JSON line, by ``make(object, position, fallback id)``."""
    offset = 0
    for number, line in enumerate(source.stream, 1):
        start, offset = offset, offset + len(line)
        if not line.strip():
            continue
        position = f"{source.name}:{number}"
        try:
            record = make(orjson.loads(line), position, f"{source.path.name}:{number}")
        except (ValueError, KeyError, TypeError) as e:
            cut = "" if line.endswith(b"\n") else " (last line, cut short?)"
            on_skip(Skipped(source.name, number, start, f"bad line{cut}: {_reason(e)}"))
            continue
        yield record


def _reason(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:200]


# -- LiteLLM's StandardLoggingPayload ------------------------------------------------------

#: Where a LiteLLM payload names the tenant, first found wins: the key's team (LiteLLM's
#: unit of isolation), the key's alias, the key's hash. ``replay --tenant-from`` adds one.
LITELLM_TENANT_FIELDS = (
    "metadata.user_api_key_team_alias",
    "metadata.user_api_key_team_id",
    "metadata.user_api_key_alias",
    "metadata.user_api_key_hash",
)
LITELLM_REDACTED = "redacted-by-litellm"  # turn_off_message_logging
_TEXT_CALLS = ("text_completion", "atext_completion")


def is_litellm_payload(obj: dict) -> bool:
    return "call_type" in obj and "messages" in obj and isinstance(obj.get("metadata"), dict)


def field_at(obj: Any, dotted: str) -> Any:
    """``obj``'s value at a dotted path (``metadata.user_api_key_alias``), else None."""
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def litellm_record(
    obj: Any,
    position: str,
    fallback_id: str,
    tenant_fields: tuple[str, ...] = LITELLM_TENANT_FIELDS,
) -> ExchangeRecord:
    """One LiteLLM payload as a chat (or text) completion exchange. A payload whose
    message logging was turned off holds no text: its bodies count as not recorded."""
    if not isinstance(obj, dict) or not is_litellm_payload(obj):
        raise ValueError("not a LiteLLM StandardLoggingPayload")
    when = _time(obj.get("startTime"), "startTime")
    end = _time(obj["endTime"], "endTime") if obj.get("endTime") is not None else when
    text_call = obj.get("call_type") in _TEXT_CALLS
    messages = obj["messages"]
    if isinstance(messages, str):
        request: dict = {"prompt": messages} if text_call else {"messages": [
            {"role": "user", "content": messages}]}  # fmt: skip
    elif isinstance(messages, list):
        request = {"messages": messages}
    else:
        raise ValueError("messages must be a list or a string")
    headers = http.Headers()
    request_id = obj.get("litellm_call_id") or obj.get("id")
    if isinstance(request_id, str) and request_id:
        headers["x-request-id"] = request_id
    tenant = next(
        (str(v) for f in tenant_fields if isinstance(v := field_at(obj, f), str | int) and str(v)),
        None,
    )
    redacted = LITELLM_REDACTED in orjson.dumps(messages).decode()
    payload = obj.get("response")
    response = None
    if isinstance(payload, dict) and obj.get("status", "success") == "success":
        body = orjson.dumps(payload)
        response = RecordedResponse(
            200, http.Headers(content_type="application/json"), body, end, end,
            recorded=LITELLM_REDACTED not in body.decode(),
        )  # fmt: skip
    return ExchangeRecord(
        time=when,
        position=position,
        method="POST",
        path="/v1/completions" if text_call else "/v1/chat/completions",
        headers=headers,
        body=orjson.dumps(request),
        response=response,
        fallback_id=fallback_id,
        tenant=tenant,
        end=end,
        body_recorded=not redacted,
    )


def read_litellm(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    return _read_lines(source, on_skip, litellm_record)


READERS: dict[str, Callable[[InputFile, OnSkip], Iterator[ExchangeRecord]]] = {
    "flows": read_flows,
    "har": read_har,
    "jsonl": read_jsonl,
    "litellm": read_litellm,
}
