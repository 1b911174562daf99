"""OpenTelemetry GenAI traces for ``crosstalk replay``, as the Collector's file exporter
writes them (``exporter/fileexporter``, ``format: json``): one OTLP/JSON
``ExportTraceServiceRequest`` a line, ``resourceSpans -> scopeSpans -> spans``, attribute
values typed (``{"stringValue": ...}``, ``{"intValue": "512"}``: int64 as a string), times
in nanoseconds (strings).

A span is an LLM call when it has GenAI attributes (``gen_ai.operation.name``,
``gen_ai.provider.name``, or ``gen_ai.system`` before semantic conventions 1.37). Its
texts, in the forms instrumentations write (first found wins):

* 1.37+: ``gen_ai.system_instructions``, ``gen_ai.input.messages``,
  ``gen_ai.output.messages`` (JSON strings on spans; structured on the
  ``gen_ai.client.inference.operation.details`` event): ``[{"role", "parts": [{"type":
  "text", "content"}]}]``;
* 1.27: span events ``gen_ai.content.prompt`` / ``gen_ai.content.completion`` with the
  attributes ``gen_ai.prompt`` / ``gen_ai.completion`` (JSON lists of ``{role, content}``);
* OpenLLMetry's indexed attributes ``gen_ai.prompt.0.content``, ``gen_ai.completion.0.content``.

Message content is opt-in in every instrumentation: a GenAI span without it is counted
as not scannable, never clean. An SDK attribute length limit
(``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``) cuts the JSON string with no marker: the text up
to the cut is recovered and the exchange marked partial. The conventions define no
tenant attribute: ``tenant.id``, ``enduser.id`` and ``user.id`` are read, in that order,
and ``--tenant-from`` names another (``resource.NAME`` for a resource attribute).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import orjson

from proxy.forensics.inputs import (
    NO_TENANT_FIELDS,
    RECORD_ERRORS,
    InputFile,
    LoggedExchange,
    OnSkip,
    Skipped,
    TenantFrom,
    bad_line,
    numbered_lines,
    reason,
    seconds,
)
from proxy.forensics.replayer import ExchangeRecord

OTEL_TENANT_FIELDS = ("tenant.id", "enduser.id", "user.id")
GENAI_MARKERS = ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.system")
_INDEXED = re.compile(r"gen_ai\.(prompt|completion)\.(\d+)\.(content|role)")
_CONTENT = re.compile(r'"content"\s*:\s*"((?:[^"\\]|\\.)*)("?)')
OTEL_TENANT = (
    "the span names no tenant (the GenAI conventions define none; tenant.id, enduser.id "
    "and user.id were looked for): give --tenant-from ATTRIBUTE"
)
NO_CONTENT = (
    "the instrumentation captured no message content (opt-in: "
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true for the OpenTelemetry "
    "contrib instrumentations, TRACELOOP_TRACE_CONTENT=true for OpenLLMetry)"
)


def any_value(value: Any) -> Any:
    """An OTLP/JSON ``AnyValue`` as a plain value (int64 strings as ints)."""
    if not isinstance(value, dict):
        return None
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        try:
            return int(value["intValue"])
        except (TypeError, ValueError):
            return None
    for key in ("doubleValue", "boolValue", "bytesValue"):
        if key in value:
            return value[key]
    if "arrayValue" in value:
        return [any_value(v) for v in (value["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in value:
        return attributes((value["kvlistValue"] or {}).get("values"))
    return None


def attributes(items: Any) -> dict[str, Any]:
    """``[{"key", "value"}]`` as a dict."""
    if not isinstance(items, list):
        return {}
    return {
        item["key"]: any_value(item.get("value"))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("key"), str)
    }


def _nanos(value: Any, name: str) -> float | None:
    """Epoch seconds from OTLP's nanoseconds (a decimal string); None when absent."""
    if value is None:
        return None
    try:
        nanos = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be nanoseconds") from None
    return seconds(nanos / 1e9, name)


def _message_text(message: Any) -> str:
    """The text of one message: ``parts`` of type text (1.37+) or ``content``."""
    if not isinstance(message, dict):
        return message if isinstance(message, str) else ""
    parts = message.get("parts")
    if isinstance(parts, list):
        return "\n".join(
            p["content"]
            for p in parts
            if isinstance(p, dict)
            and p.get("type", "text") == "text"
            and isinstance(p.get("content"), str)
        )
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_message_text(c) for c in content)
    return ""


def _messages(value: Any, role: str, name: str, partial: list[str]) -> list[dict] | None:
    """A messages attribute (a JSON string or structured) as chat messages; a JSON
    string cut by an attribute length limit yields what precedes the cut."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            texts = [_unescape(m.group(1)) for m in _CONTENT.finditer(value)]
            partial.append(
                f"{name} cut (an attribute length limit): the text before the cut was scanned"
            )
            return [{"role": role, "content": t} for t in texts if t]
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        text = _message_text(item)
        if text:
            who = item.get("role") if isinstance(item, dict) else None
            out.append({"role": who if isinstance(who, str) else role, "content": text})
    return out


def _unescape(body: str) -> str:
    try:
        return orjson.loads(f'"{body}"')
    except orjson.JSONDecodeError:
        return orjson.loads(f'"{body.rstrip(chr(92))}"') if body.endswith("\\") else body


def _indexed(attrs: dict[str, Any], kind: str) -> list[dict] | None:
    found: dict[int, dict] = {}
    for key, value in attrs.items():
        m = _INDEXED.fullmatch(key)
        if m and m.group(1) == kind and isinstance(value, str):
            found.setdefault(int(m.group(2)), {})[m.group(3)] = value
    if not found:
        return None
    default = "user" if kind == "prompt" else "assistant"
    return [
        {"role": found[i].get("role", default), "content": found[i].get("content", "")}
        for i in sorted(found)
        if found[i].get("content")
    ]


def span_exchange(
    span: dict, resource: dict[str, Any], tenant_from: TenantFrom = NO_TENANT_FIELDS
) -> LoggedExchange | None:
    """One GenAI span as a chat exchange; None for a span that is not an LLM call."""
    attrs = attributes(span.get("attributes"))
    if not any(marker in attrs for marker in GENAI_MARKERS):
        return None
    for event in span.get("events") or []:
        if isinstance(event, dict):
            for key, value in attributes(event.get("attributes")).items():
                attrs.setdefault(key, value)
    partial: list[str] = []
    system = _messages(
        attrs.get("gen_ai.system_instructions"), "system", "gen_ai.system_instructions", partial
    )
    inputs = _messages(attrs.get("gen_ai.input.messages"), "user", "gen_ai.input.messages", partial)
    if inputs is None:
        inputs = _messages(attrs.get("gen_ai.prompt"), "user", "gen_ai.prompt", partial)
    if inputs is None:
        inputs = _indexed(attrs, "prompt")
    outputs = _messages(
        attrs.get("gen_ai.output.messages"), "assistant", "gen_ai.output.messages", partial
    )
    if outputs is None:
        outputs = _messages(
            attrs.get("gen_ai.completion"), "assistant", "gen_ai.completion", partial
        )
    if outputs is None:
        outputs = _indexed(attrs, "completion")
    begin = _nanos(span.get("startTimeUnixNano"), "startTimeUnixNano")
    if begin is None:
        raise ValueError("a span without startTimeUnixNano")
    end = _nanos(span.get("endTimeUnixNano"), "endTimeUnixNano") or begin
    failed = (span.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR") and not outputs
    request: dict[str, Any] | None = None
    if inputs is not None or system is not None:
        request = {"messages": (system or []) + (inputs or [])}
    response: dict[str, Any] | None = None
    if outputs is not None:
        response = {"choices": [
            {"index": i, "message": {"role": "assistant", "content": m["content"]}}
            for i, m in enumerate(outputs)
        ]}  # fmt: skip
    path = "/v1/chat/completions"
    if attrs.get("gen_ai.operation.name") == "text_completion" and not system and inputs:
        # A completions call (OpenLLMetry logs its prompt as one user message): replayed
        # as one, so that a rendered chat template in the prompt is read as the proxy
        # reads it live.
        path = "/v1/completions"
        request = {"prompt": "\n".join(m["content"] for m in inputs)}
        if response is not None:
            response = {"choices": [
                {"index": c["index"], "text": c["message"]["content"]} for c in response["choices"]
            ]}  # fmt: skip
    view = {**attrs, **{f"resource.{k}": v for k, v in resource.items()},
            "trace_id": span.get("traceId"), "span_id": span.get("spanId")}  # fmt: skip
    request_id = attrs.get("gen_ai.response.id") or span.get("spanId")
    return LoggedExchange(
        time=begin,
        end=max(begin, end),
        path=path,
        request=request,
        response=response,
        request_id=str(request_id) if request_id else None,
        tenant=tenant_from.pick(view.get, OTEL_TENANT_FIELDS),
        tenant_missing=OTEL_TENANT,
        failed=failed,
        partial=partial,
        missing_note=NO_CONTENT if request is None or (response is None and not failed) else None,
    )


def is_otlp_traces(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("resourceSpans"), list)


def _spans(obj: dict) -> Iterator[tuple[dict, dict[str, Any]]]:
    """Every span of an export with its resource's attributes."""
    for rs in obj["resourceSpans"]:
        if not isinstance(rs, dict):
            continue
        resource = attributes((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans") or []:
            for span in (ss.get("spans") or []) if isinstance(ss, dict) else []:
                if isinstance(span, dict):
                    yield span, resource


def read_otel(source: InputFile, on_skip: OnSkip) -> Iterator[ExchangeRecord]:
    for number, start, line in numbered_lines(source):
        try:
            obj = orjson.loads(line)
            if not is_otlp_traces(obj):
                raise ValueError("not an OTLP/JSON ExportTraceServiceRequest (no resourceSpans)")
            spans = list(_spans(obj))
        except (*RECORD_ERRORS, AttributeError) as e:
            on_skip(Skipped(source.name, number, start, bad_line(line, e)))
            continue
        for n, (span, resource) in enumerate(spans, 1):  # one bad span costs only itself
            where = f"{number}.{n}" if len(spans) > 1 else str(number)
            try:
                exchange = span_exchange(span, resource, source.tenant_from)
                if exchange is None:
                    continue  # not an LLM call
                record = exchange.record(
                    f"{source.name}:{where}", source.name, f"{source.path.name}:{where}"
                )
            except (*RECORD_ERRORS, AttributeError) as e:
                on_skip(Skipped(source.name, number, start, f"bad span {where}: {reason(e)}"))
                continue
            yield record
