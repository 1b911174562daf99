"""Engine request logs for ``crosstalk replay``: SGLang ``--log-requests``, vLLM's request
logging. Both write two lines per request (what came in, what went out), in Python
``repr`` text (``proxy.forensics.pyrepr``), with no tenant field and, depending on the
settings, with cut or missing text. Each reader pairs the lines by request id and says
what the log did not keep, so a replay never calls text it did not see clean.

SGLang (``python/sglang/srt/utils/request_logger.py``), text format::

    [2026-05-04 10:15:02] Receive: obj=GenerateReqInput(rid='...', text='...', ...)[, headers={...}]
    [2026-05-04 10:15:04] Finish: obj=GenerateReqInput(...)[, headers={...}], out={'text': '...', 'meta_info': {'id': ..., 'e2e_latency': ...}}

and the JSON format (``--log-requests-format json``), one object a line:
``{"timestamp", "event": "request.received" | "request.finished", "rid", "obj", "headers", "out"}``.
Levels 0 and 1 log no text; level 2 cuts every string over 2,048 characters to its first
and last 1,024 (``'head' ... 'tail'``; in JSON ``head...tail``); level 3 logs all of it.
``received_time`` is the host's ``time.perf_counter()``: anchored on the line times
(``HostClock``).
The logged ``headers`` (those named in ``SGLANG_LOG_REQUEST_HEADERS``) go through the tenant
rules, so a tenant header the gateway sets names the tenant.

vLLM (``vllm/entrypoints/logger.py``, ``--enable-log-requests``, outputs with
``--enable-log-outputs``)::

    INFO 05-04 10:15:02 [logger.py:40] Received request chatcmpl-...: prompt: '...', params: SamplingParams(...), prompt_token_ids: [...], prompt_embeds shape: None, lora_request: None.
    INFO 05-04 10:15:04 [logger.py:71] Generated response chatcmpl-...: output: '...', output_token_ids: [...], finish_reason: stop

(the v0.10 generation). 0.11 and later (checked on 0.33.0's own code, ``bench/producer_logs.py``)
log the prompt only at DEBUG, as ``Request cmpl-ID-0 details: prompt: '...', prompt_token_ids:
[...]``, the INFO ``Received request`` line holding only the parameters; a completion's
inputs are ``cmpl-ID-<i>`` and its outputs ``cmpl-ID``; at DEBUG each output line follows a
``Generated response ID details: output_token_ids: [...]`` line. At INFO the outputs are
scanned alone. ``--max-log-len N`` cuts prompts and outputs to N characters with no marker:
pass the same ``--max-log-len`` to the replay, or the reader takes the longest length that
two texts share for it. The time has no year and is local time: the year is the file's
(from its modification time) and ``TZ`` sets the zone.
"""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

import orjson

from proxy.forensics import pyrepr
from proxy.forensics.inputs import (
    RECORD_ERRORS,
    InputFile,
    LoggedExchange,
    OnSkip,
    Skipped,
    bad_line,
    epoch,
    field_at,
    numbered_lines,
    reason,
    seconds,
)
from proxy.forensics.replayer import ExchangeRecord

#: Requests whose second line has not come: given up on (replayed without it) once this
#: many are open, or once the log is this many seconds past them.
PENDING_MAX = 10_000
PENDING_SECONDS = 3600.0
SGLANG_CUT_HALF = 1024  # --log-requests-level 2 keeps this much of each end
#: Seconds since 1970 below which a time field is a relative clock, not a date
#: (2001-09-09; a host up for 31 years would pass it).
EPOCH_FLOOR = 1e9

_SGLANG_LINE = re.compile(r"\b(Receive|Finish): obj=")
_SGLANG_JSON = re.compile(rb'"event"\s*:\s*"request\.(received|finished)"')
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?)")
_VLLM_TIME = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[.,](\d+))?\b")
_VLLM_LINE = re.compile(
    r"\b(?:(?P<received>Received request)|(?P<details>Request)|(?P<generated>Generated response))"
    r" (?P<id>\S+?)(?: \(streaming (?P<stream>delta|complete)\))?(?P<sep>:| details:) "
)
#: A file is one of these logs when a line starts (after the logger's prefix) with the
#: marker: anchored, so a prompt quoting a marker in another format cannot steer it.
SNIFF_SGLANG = re.compile(
    rb"(?m)^(?:\[[^\]\n]{1,80}\] ?)?(?:(?:Receive|Finish): obj=[A-Za-z]+\("
    rb'|\{"timestamp"[^\n]{0,200}?"event": ?"request\.(?:received|finished)")'
)
SNIFF_VLLM = re.compile(
    rb"(?m)^(?:\(\w+ pid=\d+\) )?(?:INFO|DEBUG|WARNING) \d\d-\d\d \d\d:\d\d:\d\d[^\n]{0,80}?\] "
    rb"(?:Received request \S+: (?:prompt|params):|Generated response \S+: output:"
    rb"|Request \S+ details:)"
)

SGLANG_TENANT = (
    "SGLang's request log has no tenant field: log the tenant header "
    "(SGLANG_LOG_REQUEST_HEADERS) or give --tenant-from FIELD"
)
VLLM_TENANT = (
    "vLLM's request log has no tenant field: give --tenant-from FIELD (e.g. request_id "
    "with --tenant-pattern, when the gateway puts the tenant in X-Request-Id)"
)


@dataclass
class _Open:
    """The first line of a request, waiting for its second."""

    time: float
    position: str
    fields: dict[str, Any]
    deltas: list[str] = field(default_factory=list)


class _Pairing:
    """Open requests by id, in arrival order, given up on when too many or too old."""

    def __init__(self) -> None:
        self.open: OrderedDict[str, _Open] = OrderedDict()

    def add(self, key: str, entry: _Open) -> None:
        self.open[key] = entry

    def take(self, key: str) -> _Open | None:
        return self.open.pop(key, None)

    def expired(self, now: float) -> Iterator[tuple[str, _Open]]:
        while self.open:
            key, entry = next(iter(self.open.items()))
            if len(self.open) <= PENDING_MAX and now - entry.time <= PENDING_SECONDS:
                return
            yield self.open.popitem(last=False)

    def rest(self) -> Iterator[tuple[str, _Open]]:
        while self.open:
            yield self.open.popitem(last=False)


def local_time(text: str) -> float:
    """``2026-05-04 10:15:02[,123]`` in the machine's local time zone (``TZ``)."""
    return datetime.fromisoformat(text.replace(",", ".").replace("T", " ")).timestamp()


# -- SGLang ----------------------------------------------------------------------------------


def _marker(pattern: re.Pattern[str], line: str) -> re.Match[str] | None:
    """The log marker of ``line``, where the logger put it: before any quoted text (a
    marker inside a prompt is the prompt's)."""
    m = pattern.search(line)
    if m is None or "'" in line[: m.start()] or '"' in line[: m.start()]:
        return None
    return m


def sglang_fields(line: str) -> tuple[str, float | None, dict[str, Any]] | None:
    """``(event, line time, {"obj", "headers", "out", "rid"})`` of one SGLang request-log
    line, or None when the line is not one. Raises ValueError on a broken one."""
    if (m := _marker(_SGLANG_LINE, line)) is not None:
        stamp = _LOG_TIME.search(line, 0, m.start())
        fields, _ = pyrepr.parse_fields(line.rstrip(), m.end() - len("obj="), "=")
        obj = fields.get("obj")
        if not isinstance(obj, dict):
            raise ValueError("obj is not a GenerateReqInput")
        if "out" in fields and not isinstance(fields["out"], dict | list):
            raise ValueError("out is not a dict: the line is cut short?")
        fields["rid"] = obj.get("rid")
        event = "received" if m.group(1) == "Receive" else "finished"
        return event, local_time(stamp.group(1)) if stamp else None, fields
    raw = line.encode()
    if (j := _SGLANG_JSON.search(raw)) is None:
        return None
    obj = orjson.loads(raw[raw.index(b"{") :])
    if not isinstance(obj, dict):
        raise ValueError("a request event must be a JSON object")
    when = epoch(obj["timestamp"], "timestamp") if obj.get("timestamp") is not None else None
    return j.group(1).decode(), when, obj


def _json_cut(value: Any) -> Any:
    """SGLang's JSON format cuts a long string to ``head + "..." + tail`` (1,024 each)."""
    n = SGLANG_CUT_HALF
    if isinstance(value, str) and len(value) == 2 * n + 3 and value[n : n + 3] == "...":
        return pyrepr.Cut(value[:n], value[n + 3 :])
    return value


def _sglang_texts(value: Any, what: str, partial: list[str]) -> Any:
    """A logged ``text`` (one string or a batch of them) with SGLang's cuts joined and
    noted; None when the log kept no text."""
    items = value if isinstance(value, list) else [value]
    texts = []
    for item in items:
        text, cut = pyrepr.text_of(_json_cut(item))
        if text is None:
            return None
        if cut and not any(p.startswith(what) for p in partial):
            partial.append(
                f"{what} cut by the log (SGLang level 2 keeps the first and last 1,024 characters)"
            )
        texts.append(text)
    return texts if isinstance(value, list) else texts[0]


def sglang_exchange(
    finished: dict[str, Any] | None,
    received: _Open | None,
    end: float,
    source: InputFile,
    time_guessed: bool = False,
) -> LoggedExchange:
    """One SGLang request from its Finish line (``finished``) and, when seen, its Receive;
    ``time_guessed``: its lines had no wall-clock time (``HostClock.guess``)."""
    fields = finished if finished is not None else received.fields  # type: ignore[union-attr]
    obj = cast(dict, fields.get("obj") if isinstance(fields.get("obj"), dict) else {})
    first = cast(
        dict,
        received.fields.get("obj")
        if received and isinstance(received.fields.get("obj"), dict)
        else {},
    )
    partial: list[str] = []
    if time_guessed:
        partial.append(
            "time approximate: the log lines hold no wall-clock time; received_time "
            "(the host's perf_counter) orders this file's requests, and the file's "
            "modification time places them among other inputs"
        )
    prompt = _sglang_texts(obj.get("text") if obj.get("text") is not None else first.get("text"),
                           "prompt", partial)  # fmt: skip
    out = fields.get("out")
    outs = out if isinstance(out, list) else [out] if isinstance(out, dict) else []
    answers = [_sglang_texts(o.get("text"), "output", partial) for o in outs if isinstance(o, dict)]
    response = None
    if outs and answers and all(isinstance(a, str) for a in answers):
        body = [{"text": a} for a in answers]
        response = body if isinstance(out, list) else body[0]
    latency = field_at(outs[0] if outs else None, "meta_info.e2e_latency")
    took = seconds(latency, "e2e_latency") if isinstance(latency, int | float) else None
    # The Receive line's own time: SGLang's received_time is a perf_counter reading.
    begin = received.time if received is not None else end - took if took is not None else end
    headers = cast(dict, fields.get("headers") if isinstance(fields.get("headers"), dict) else {})
    rid = fields.get("rid")
    view = {**fields, "obj": obj or first}
    note = None
    if prompt is None or (finished is not None and response is None):
        note = ("SGLang --log-requests-level 0 and 1 log no text, and the chat API's prompt is "
                "logged as token ids until the Finish line: use level 3")  # fmt: skip
    if finished is None:
        note = (
            "no Finish line: the request was aborted, or SGLANG_LOG_REQUEST_EXCEEDED_MS left it out"
        )
    return LoggedExchange(
        time=begin,
        end=max(end, begin),
        path="/generate",
        request={"text": prompt, "rid": rid} if prompt is not None else None,
        response=response,
        request_id=str(rid) if isinstance(rid, str | int) and rid else None,
        tenant=source.tenant_from.pick(lambda f: field_at(view, f)),
        tenant_missing=SGLANG_TENANT,
        partial=partial,
        headers={str(k): str(v) for k, v in headers.items()},
        missing_note=note,
    )


def _epoch_received_time(fields: dict[str, Any]) -> float | None:
    """``obj.received_time`` when it is a wall-clock time. SGLang 0.5 sets it from
    ``time.perf_counter()`` (seconds since the host booted): no date, and another
    host's count is unrelated, so the log line's own time orders requests instead."""
    obj = fields.get("obj")
    value = obj.get("received_time") if isinstance(obj, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= EPOCH_FLOOR:
        return seconds(value, "received_time")
    return None


class HostClock:
    """SGLang's ``received_time`` (``time.perf_counter()``: seconds since the host
    booted, to the microsecond) on the log's wall clock (to the second). Each line with
    both says the boot lies in ``[stamp - relative, stamp + grain - relative)``; the
    lines of one host narrow that interval, and its middle turns a relative time into a
    wall-clock one, finer than the stamps: requests of two hosts within one second are
    ordered as they came. A host that restarted (the interval goes empty) starts over."""

    def __init__(self) -> None:
        self.low = -math.inf
        self.high = math.inf
        self.last = -math.inf  # the latest relative reading

    def learn(self, stamp: float, relative: float) -> None:
        grain = 1.0 if stamp == math.floor(stamp) else 0.001
        low, high = max(self.low, stamp - relative), min(self.high, stamp + grain - relative)
        if relative < self.last:  # a restart: perf_counter began again
            low, high = stamp - relative, stamp + grain - relative
        elif low > high:
            # A line written a moment after its reading, across a second's edge (a busy
            # host): it bounds nothing new; keep what the other lines say.
            low, high = self.low, self.high
        self.low, self.high, self.last = low, high, relative

    @property
    def anchored(self) -> bool:
        return self.low > -math.inf

    def guess(self, anchor: float, relative: float) -> None:
        """No line time to learn from: take ``anchor`` (the file's modification time)
        for the time of the first relative reading, which keeps the file's own order."""
        self.low = self.high = anchor - relative
        self.last = relative

    def at(self, relative: float) -> float:
        return relative + (self.low + self.high) / 2


def _file_time(source: InputFile) -> float:
    try:
        return source.path.stat().st_mtime
    except OSError:
        return time.time()


def _relative_received_time(fields: dict[str, Any]) -> float | None:
    obj = fields.get("obj")
    value = obj.get("received_time") if isinstance(obj, dict) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < EPOCH_FLOOR:
        return float(value)
    return None


def read_sglang(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    clock = HostClock()
    guessed = False  # the clock was never given a line time

    def step(
        line: str, position: str, pairing: _Pairing, src: InputFile
    ) -> tuple[float | None, list[LoggedExchange]]:
        parsed = sglang_fields(line)
        if parsed is None:
            return None, []
        event, when, fields = parsed
        rid = str(fields.get("rid"))
        nonlocal guessed
        relative = _relative_received_time(fields)
        if when is None:
            when = _epoch_received_time(fields)
        elif relative is not None and event == "received":
            clock.learn(when, relative)
            guessed = False
            when = clock.at(relative)
        if when is None and relative is not None:
            if not clock.anchored:
                clock.guess(_file_time(src), relative)
                guessed = True
            when = clock.at(relative)
        if event == "received":
            if when is None:
                raise ValueError("a Receive line with no time")
            pairing.add(rid, _Open(when, position, fields))
            return when, []
        received = pairing.take(rid)
        if when is None and received is None:
            raise ValueError("a Finish line with no time and no Receive line")
        end = when if when is not None else received.time  # type: ignore[union-attr]
        out = fields.get("out")
        latency = field_at(
            out[0] if isinstance(out, list) and out else out, "meta_info.e2e_latency"
        )
        if relative is not None and clock.anchored and isinstance(latency, int | float):
            end = clock.at(relative) + seconds(latency, "e2e_latency")  # finer than the stamp
        return end, [sglang_exchange(fields, received, end, src, guessed)]

    def unanswered(_rid: str, opened: _Open) -> LoggedExchange:
        return sglang_exchange(None, opened, opened.time, source, guessed)

    return _read_paired(source, on_skip, step, unanswered)


# -- vLLM ------------------------------------------------------------------------------------


class _VllmClock:
    """vLLM's ``MM-DD HH:MM:SS`` times as epoch seconds: the year is the file's (its
    modification time), the year before for dates after it."""

    def __init__(self, source: InputFile) -> None:
        try:
            self.mtime = source.path.stat().st_mtime
        except OSError:
            self.mtime = time.time()
        self.year = time.localtime(self.mtime).tm_year

    def at(self, line: str, before: int) -> float:
        """The time of ``line`` (its prefix, before ``before``). Raises ValueError."""
        m = _VLLM_TIME.search(line, 0, before)
        if m is None:
            raise ValueError("no MM-DD HH:MM:SS time before the message")
        month, day, hh, mm, ss = (int(g) for g in m.groups()[:5])
        fraction = float("0." + m.group(6)) if m.group(6) else 0.0
        for year in (self.year, self.year - 1, self.year - 2, self.year - 3):
            try:  # datetime refuses Feb 30, and Feb 29 of a year that has none
                stamp = datetime(year, month, day, hh, mm, ss).timestamp() + fraction
            except ValueError:
                continue
            if stamp <= self.mtime + 86400:
                return stamp
        raise ValueError(f"no year puts {m.group(0)} before the file's time")


def vllm_fields(rest: str) -> dict[str, Any]:
    """``prompt: '...', params: SamplingParams(...), lora_request: None.`` -> by label."""
    text = rest.rstrip()
    fields, _ = pyrepr.parse_fields(text[:-1] if text.endswith(".") else text, 0, ":")
    return fields


def _vllm_cut(text: str, ids: Any, limit: int | None) -> bool:
    """Did vLLM's ``--max-log-len`` cut ``text``? At least the limit (given, or inferred
    from the file: ``infer_vllm_limit``), or cut to the same length as its token ids,
    which real text never is."""
    if limit is not None:
        return len(text) >= limit
    return isinstance(ids, list) and len(ids) == len(text) >= 32


def _choices_wanted(fields: dict[str, Any]) -> int:
    """``n`` of the logged ``SamplingParams`` (how many outputs the request logs), 1 when
    the line does not say."""
    params = fields.get("params")
    n = params.get("n") if isinstance(params, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 128 else 1


@dataclass
class _VllmOpen(_Open):
    """A vLLM request: its input lines' fields, then its outputs as they come."""

    outputs: list[str] = field(default_factory=list)
    output_ids: list[Any] = field(default_factory=list)
    next_ids: Any = None  # a DEBUG "details: output_token_ids" line's, for the next output


def vllm_exchange(
    request_id: str, opened: _VllmOpen | None, end: float, source: InputFile, limit: int | None
) -> LoggedExchange:
    fields = opened.fields if opened else {}
    prompt = fields.get("prompt")
    prompt = prompt if isinstance(prompt, str) else None
    outputs = list(opened.outputs) if opened else []
    if opened and not outputs and opened.deltas:
        outputs = ["".join(opened.deltas)]  # no complete line came: the deltas seen
    partial = []
    if prompt is not None and _vllm_cut(prompt, fields.get("prompt_token_ids"), limit):
        partial.append(f"prompt cut by the log (vLLM --max-log-len, {len(prompt)} characters kept)")
    ids = opened.output_ids if opened else []
    if any(
        _vllm_cut(t, i, limit) for t, i in zip(outputs, ids + [None] * len(outputs), strict=False)
    ):
        partial.append("output cut by the log (vLLM --max-log-len)")
    view = {**fields, "request_id": request_id}
    note = None
    if prompt is None:
        note = ("no prompt for this id: vLLM logs prompts only at DEBUG level (--log-level "
                "DEBUG with --enable-log-requests); its output was scanned alone")  # fmt: skip
    elif not outputs:
        note = "vLLM logs outputs only with --enable-log-outputs"
    begin = opened.time if opened else end
    return LoggedExchange(
        time=begin,
        end=max(end, begin),
        path="/v1/completions",
        request={"prompt": prompt or ""} if prompt is not None or outputs else None,
        response=(
            {"choices": [{"index": i, "text": t} for i, t in enumerate(outputs)]}
            if outputs
            else None
        ),
        request_id=request_id,
        tenant=source.tenant_from.pick(lambda f: field_at(view, f)),
        tenant_missing=VLLM_TENANT,
        partial=partial,
        missing_note=note,
        prompt_logged=prompt is not None,
    )


class _VllmRequests:
    """Open vLLM requests by id. vLLM logs a completion's inputs as ``cmpl-ID-0``,
    ``cmpl-ID-1`` (one per prompt of the call) and all its outputs as ``cmpl-ID``, in
    prompt order (``entrypoints/openai/completion/serving.py``): an output whose id is
    not open goes to the first open ``ID-<i>``."""

    def __init__(self, pairing: _Pairing) -> None:
        self.pairing = pairing
        self.subs: dict[str, list[str]] = {}

    def open(
        self, request_id: str, when: float, position: str, fields: dict[str, Any]
    ) -> _VllmOpen:
        opened = self.pairing.open.get(request_id)
        if isinstance(opened, _VllmOpen):
            opened.fields.update(fields)  # the other input line of the same request
            return opened
        opened = _VllmOpen(when, position, fields)
        self.pairing.add(request_id, opened)
        base, dash, index = request_id.rpartition("-")
        if dash and index.isdigit():
            self.subs.setdefault(base, []).append(request_id)
        return opened

    def find(self, output_id: str) -> tuple[str, _VllmOpen] | None:
        for request_id in (output_id, *self.subs.get(output_id, ())):
            opened = self.pairing.open.get(request_id)
            if isinstance(opened, _VllmOpen):
                return request_id, opened
        return None

    def close(self, request_id: str) -> _VllmOpen | None:
        opened = self.pairing.take(request_id)
        base, dash, _ = request_id.rpartition("-")
        subs = self.subs.get(base) if dash else None
        if subs is not None and request_id in subs:
            subs.remove(request_id)
            if not subs:
                del self.subs[base]
        return opened if isinstance(opened, _VllmOpen) else None


def read_vllm(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    clock = _VllmClock(source)
    limit = source.max_log_len if source.max_log_len is not None else infer_vllm_limit(source)
    requests = _VllmRequests(_Pairing())

    def step(
        line: str, position: str, _pairing: _Pairing, src: InputFile
    ) -> tuple[float | None, list[LoggedExchange]]:
        m = _marker(_VLLM_LINE, line)
        if m is None or (m.group("details") and m.group("sep") != " details:"):
            return None, []  # "Request timeout: ..." and the like: not a request line
        when = clock.at(line, m.start())
        request_id = m.group("id")
        fields = vllm_fields(line[m.end() :])
        for name in ("prompt", "output"):
            if isinstance(fields.get(name), pyrepr.Opaque):
                raise ValueError(f"{name} is not a string: the line is cut short?")
        if not m.group("generated"):
            requests.open(request_id, when, position, fields)
            return when, []
        # An output whose input lines are not in the log opens its own request.
        key, opened = requests.find(request_id) or (
            request_id,
            requests.open(request_id, when, position, {}),
        )
        if m.group("sep") == " details:":  # DEBUG: the next output line's token ids
            opened.next_ids = fields.get("output_token_ids")
            return when, []
        output = fields.get("output")
        if m.group("stream") == "delta":
            if isinstance(output, str):
                opened.deltas.append(output)
            return when, []
        opened.outputs.append(output if isinstance(output, str) else "")
        opened.output_ids.append(opened.next_ids)
        opened.next_ids = None
        if len(opened.outputs) < _choices_wanted(opened.fields):
            return when, []
        requests.close(key)
        return when, [vllm_exchange(key, opened, when, src, limit)]

    def unanswered(request_id: str, opened: _Open) -> LoggedExchange:
        requests.close(request_id)
        vllm_open = opened if isinstance(opened, _VllmOpen) else None
        return vllm_exchange(request_id, vllm_open, opened.time, source, limit)

    return _read_paired(source, on_skip, step, unanswered, requests.pairing)


def infer_vllm_limit(source: InputFile) -> int | None:
    """vLLM's ``--max-log-len N`` cuts every logged prompt and output to N characters
    with no marker. Not given, it is read off the file: the greatest text length, when
    at least two texts have exactly it (real texts' lengths rarely tie at the top; cut
    ones all do). None when the file shows no such cut, or cannot be read twice."""
    try:
        if not source.stream.seekable():
            return None
        begin = source.stream.tell()
    except (OSError, ValueError):
        return None
    try:
        lengths = _text_lengths(source)
    finally:
        source.stream.seek(begin)
    if not lengths:
        return None
    longest = max(lengths)
    return longest if lengths[longest] >= 2 else None


def _text_lengths(source: InputFile) -> dict[int, int]:
    """How many distinct logged prompts and outputs (32 characters or more) have each
    length (a retried request's prompt, logged twice, ties with nothing)."""
    texts: dict[int, set[int]] = {}
    for _number, _start, raw in numbered_lines(source):
        line = raw.decode("utf-8", "replace")
        m = _marker(_VLLM_LINE, line)
        if (
            m is None
            or m.group("stream") == "delta"
            or m.group("sep") != ":"
            and not m.group("details")
        ):
            continue
        try:
            fields = vllm_fields(line[m.end() :])
        except RECORD_ERRORS:
            continue
        for name in ("prompt", "output"):
            if isinstance(text := fields.get(name), str) and len(text) >= 32:
                texts.setdefault(len(text), set()).add(hash(text))
    return {length: len(distinct) for length, distinct in texts.items()}


# -- both --------------------------------------------------------------------------------


Step = Callable[[str, str, _Pairing, InputFile], tuple[float | None, list[LoggedExchange]]]


def _read_paired(
    source: InputFile,
    on_skip: OnSkip,
    step: Step,
    unanswered: Callable[[str, _Open], LoggedExchange],
    pairing: _Pairing | None = None,
) -> Iterator[ExchangeRecord]:
    """Lines -> ``step`` -> exchanges; requests whose second line never comes are
    replayed without it (``unanswered``) once too many or too old, and at the end.
    ``pairing``: the open requests, when the reader keeps its own view of them."""
    pairing = _Pairing() if pairing is None else pairing

    def emit(exchange: LoggedExchange, position: str, fallback: str) -> ExchangeRecord:
        return exchange.record(position, source.name, fallback)

    def given_up(entries: Iterator[tuple[str, _Open]]) -> Iterator[ExchangeRecord]:
        """Requests replayed without their second line (it never came)."""
        for rid, opened in entries:
            line = opened.position[len(source.name) + 1 :]
            try:
                yield emit(unanswered(rid, opened), opened.position, f"{source.path.name}:{line}")
            except RECORD_ERRORS as e:
                on_skip(Skipped(source.name, int(line), None, f"bad request: {reason(e)}"))

    latest = float("-inf")
    for number, start, raw in numbered_lines(source):
        position = f"{source.name}:{number}"
        try:
            when, done = step(raw.decode("utf-8", "replace"), position, pairing, source)
            records = [emit(x, position, f"{source.path.name}:{number}") for x in done]
        except RECORD_ERRORS as e:
            on_skip(Skipped(source.name, number, start, bad_line(raw, e)))
            continue
        yield from records
        if when is not None:
            latest = max(latest, when)
            yield from given_up(pairing.expired(latest))
    yield from given_up(pairing.rest())
