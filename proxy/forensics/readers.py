"""The inputs of ``crosstalk replay``: captured traffic and the logs operators keep.

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
* ``litellm``: LiteLLM's ``StandardLoggingPayload`` lines (``gateway_logs``).
* ``sglang``, ``vllm``: the engines' own request logs (``engine_logs``).
* ``otel``: OpenTelemetry GenAI spans from the Collector's file exporter (``otel``).

Files may be gzip-compressed. ``sniff`` picks the format from the first bytes and the
name. A new format is one more entry in ``READERS`` (and a rule in ``sniff``).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, cast

import orjson

from proxy.forensics.engine_logs import SNIFF_SGLANG, SNIFF_VLLM, read_sglang, read_vllm
from proxy.forensics.gateway_logs import is_litellm_payload, read_litellm
from proxy.forensics.inputs import (
    NO_TENANT_FIELDS,
    InputError,
    InputFile,
    OnSkip,
    RecordedHeaders,
    Skipped,
    TenantFrom,
    body_bytes,
    epoch,
    field_at,
    read_json_lines,
    reason,
)
from proxy.forensics.otel import is_otlp_traces, read_otel
from proxy.forensics.replayer import ExchangeRecord, RecordedResponse

if TYPE_CHECKING:
    from mitmproxy import http

__all__ = ["FORMATS", "InputError", "InputFile", "Skipped", "TenantFrom", "open_input"]

FORMATS = ("flows", "har", "jsonl", "litellm", "sglang", "vllm", "otel")
#: The formats whose records name their tenant from their own fields (``--tenant-from``);
#: the HTTP captures' tenant comes from the configuration's tenant rules.
LOG_FORMATS = ("jsonl", "litellm", "sglang", "vllm", "otel")

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


def sniff(head: bytes, name: str) -> str | None:
    """The format of a file starting with ``head`` (decompressed), or None. A JSON
    document is told by its keys first: log markers only count in text files, at the
    start of a line, so text inside a prompt cannot choose the reader."""
    lower = name.lower().removesuffix(".gz")
    body = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if re.match(rb"[0-9]{1,12}:", body):
        return "flows"  # a tnetstring: mitmproxy's flow file
    if not body.startswith(b"{"):
        if SNIFF_SGLANG.search(body):
            return "sglang"  # text lines, or JSON events behind a time prefix
        return "vllm" if SNIFF_VLLM.search(body) else None
    if body.startswith(b'{"resourceSpans"'):
        return "otel"  # the Collector writes this key first; lines may be MBs long
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
    if not isinstance(obj, dict):
        return "jsonl"
    if "log" in obj:
        return "har"
    if is_litellm_payload(obj):
        return "litellm"
    if is_otlp_traces(obj):
        return "otel"
    if obj.get("event") in ("request.received", "request.finished") and "rid" in obj:
        return "sglang"  # its JSON format without a time prefix
    return "jsonl"


SNIFF_BYTES = 65536


def open_input(
    path: str | Path,
    fmt: str = "auto",
    tenant_from: TenantFrom | None = None,
    max_log_len: int | None = None,
) -> InputFile:
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
        raise InputError(
            f"{p}: not a flow file, HAR, JSON-lines capture, LiteLLM log, SGLang or vLLM "
            "request log, or OpenTelemetry trace export (--format names one)"
        )
    return InputFile(p, found, raw, stream, size, tenant_from or TenantFrom(), max_log_len)


def read_records(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    """The records of ``source``, in file order; unreadable ones go to ``on_skip``."""
    return READERS[source.format](source, on_skip)


# -- mitmproxy flow files ---------------------------------------------------------------
# mitmproxy's HTTP model and readers are imported by the functions that read flows and
# HAR: a replay of logs never needs them (~20 MB of RSS).


def flow_record(flow: http.HTTPFlow, position: str) -> ExchangeRecord:
    """A recorded exchange from a mitmproxy flow (as saved or imported)."""
    from proxy.mitm.capture import CHUNKS_KEY, ENDED_KEY, OBSERVED_KEY, chunk_timing

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
        arrived=req.timestamp_end or req.timestamp_start,
        end=failed_at,
        body_recorded=req.raw_content is not None,
    )


def read_flows(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    from mitmproxy import exceptions, http
    from mitmproxy.io import FlowReader

    fo = source.stream
    number, offset = 0, fo.tell()  # offset: where the next record starts
    while True:
        try:
            for flow in FlowReader(cast(BinaryIO, fo)).stream():
                number += 1
                start, offset = offset, fo.tell()
                if not isinstance(flow, http.HTTPFlow):
                    continue  # TCP, UDP, DNS flows: no LLM exchange
                try:
                    record = flow_record(flow, f"{source.name}#{number}")
                except (ValueError, TypeError, AttributeError) as e:
                    on_skip(Skipped(source.name, number, start, f"unusable flow: {reason(e)}"))
                    continue
                record.origin = source.name
                yield record
            return
        # mitmproxy checks a flow's fields with ``assert``: a damaged field name fails
        # one (AssertionError, no message), as a damaged value fails a type or a key.
        except (exceptions.FlowReadException, ValueError, TypeError, KeyError, AssertionError) as e:
            number += 1
            what = "fields mitmproxy refused" if isinstance(e, AssertionError) else reason(e)
            on_skip(Skipped(source.name, number, offset, f"corrupt flow record: {what}"))
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
    from mitmproxy.io import FlowReader

    fo.seek(offset + len(digits) + 1 + int(digits))
    if fo.read(1) != b"}":
        return False
    fo.seek(offset)
    try:
        return next(iter(FlowReader(cast(BinaryIO, fo)).stream()), None) is not None
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
            assert s is not None  # the whole string matched above
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
    from mitmproxy.io.har import request_to_flow

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
                on_skip(Skipped(source.name, number, offset, f"bad HAR entry: {reason(e)}"))
                continue
            record.origin = source.name
            yield record
    except ValueError as e:
        on_skip(Skipped(source.name, number + 1, None, f"HAR cut short: {e}"))


# -- JSON lines ----------------------------------------------------------------------------


def jsonl_record(
    obj: Any, position: str, fallback_id: str, tenant_from: TenantFrom = NO_TENANT_FIELDS
) -> ExchangeRecord:
    """A recorded exchange from one object of the JSON-lines format."""
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    when = epoch(obj.get("time"), "time")
    end = epoch(obj["end_time"], "end_time") if obj.get("end_time") is not None else when
    first = when
    if obj.get("response_time") is not None:
        first = epoch(obj["response_time"], "response_time")
    path = obj.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError("path must be a string starting with /")
    raw_headers = obj.get("headers") or {}
    if not isinstance(raw_headers, dict):
        raise ValueError("headers must be an object")
    headers = RecordedHeaders()
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
        response_headers = RecordedHeaders(content_type="text/event-stream")
        response = RecordedResponse(status, response_headers, obj["sse"].encode(), first, end)
    elif "response" in obj:
        response_headers = RecordedHeaders(content_type="application/json")
        response = RecordedResponse(
            status, response_headers, body_bytes(obj["response"], "response"), end, end
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
        body=body_bytes(obj.get("request"), "request"),
        response=response,
        fallback_id=fallback_id,
        tenant=tenant_from.pick(lambda f: field_at(obj, f), ("tenant",)),
        end=end,
    )


def read_jsonl(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    return read_json_lines(
        source, on_skip, lambda obj, pos, fid: jsonl_record(obj, pos, fid, source.tenant_from)
    )


READERS: dict[str, Callable[[InputFile, OnSkip], Iterator[ExchangeRecord]]] = {
    "flows": read_flows,
    "har": read_har,
    "jsonl": read_jsonl,
    "litellm": read_litellm,
    "sglang": read_sglang,
    "vllm": read_vllm,
    "otel": read_otel,
}
