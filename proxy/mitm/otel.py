"""OpenTelemetry export (docs/operations.md, "OpenTelemetry"): a mitmproxy addon that
sends a span per LLM exchange, and the request and finding counters, over OTLP/HTTP.

Off unless ``[otel] endpoint`` names a receiver (an OpenTelemetry Collector, or any
OTLP/HTTP backend). Each finished exchange becomes one ``SERVER`` span, ``crosstalk
<path>``: tenant, method, path, model, stream, status, verdict, time to first token and
the engine's scan time as attributes, and a ``crosstalk.leak`` event per finding (kind,
source tenant, action, where in the output). When the client sent a W3C ``traceparent``,
the span is its child: crosstalk sits inside the caller's trace, beside the gateway's
and the engine's spans. Ids, counts and times only: no prompt or output text, no keyed
hash, in any attribute (the event log's rule).

The span is made when the exchange has settled (``ExchangeMonitor.when_settled``), in
the process that scanned it: the detector process when there is one, as for the
metrics. An exporter that cannot reach its receiver drops what it cannot send (the
SDK's batch processor, in its own thread): telemetry never holds up or breaks traffic.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from mitmproxy import ctx, exceptions, http

from proxy.mitm.flowstate import METADATA_KEY
from proxy.mitm.metrics import TenantLabels
from proxy.redaction import path_only

if TYPE_CHECKING:
    from proxy.config import OtelSection
    from proxy.pipeline.exchange import ExchangeMonitor

EXPORTED_KEY = "crosstalk.otel_exported"
SCOPE = "crosstalk"
# Seconds one export may take, retries included: a receiver that is down then costs a
# batch, and the proxy's shutdown a few seconds, not the SDK's default of ten a try.
EXPORT_TIMEOUT = 3.0

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk


def wall_ns(monotonic: float) -> int:
    """Wall-clock nanoseconds of a ``time.monotonic()`` reading (the monitor's clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class OtelExport:
    """The tracer and meter of one ``[otel]`` section, with their OTLP/HTTP exporters."""

    def __init__(self, section: OtelSection) -> None:
        # Imported here: the exporter is an optional extra (pip install 'crosstalk[otel]').
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.section = section
        base = section.endpoint.rstrip("/")
        headers = dict(section.headers)
        resource = Resource.create({"service.name": section.service_name})
        self.traces = TracerProvider(resource=resource)
        self.traces.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(
                    endpoint=f"{base}/v1/traces", headers=headers, timeout=EXPORT_TIMEOUT
                )
            )
        )
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(
                endpoint=f"{base}/v1/metrics", headers=headers, timeout=EXPORT_TIMEOUT
            ),
            export_interval_millis=section.metrics_interval_seconds * 1000,
        )
        self.meters = MeterProvider(resource=resource, metric_readers=[reader])
        self.tracer = self.traces.get_tracer(SCOPE)
        meter = self.meters.get_meter(SCOPE)
        self.requests = meter.create_counter(
            "crosstalk.requests", description="LLM requests finished, by tenant and verdict."
        )
        self.findings = meter.create_counter(
            "crosstalk.findings", description="Findings, by kind and action."
        )
        self.scan_time = meter.create_histogram(
            "crosstalk.scan.duration", unit="s", description="Engine scan time per exchange."
        )
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Send what is buffered, then stop the exporters."""
        self.traces.shutdown()
        self.meters.shutdown()


class CrossTalkOtel:
    """Exports each settled exchange as a span, and counts it, when ``[otel]`` is on."""

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.export: OtelExport | None = None
        self.tenants = TenantLabels(100)
        self.failures = 0

    def load(self, loader) -> None:
        loader.add_option(
            "crosstalk_otel_endpoint",
            str,
            "",
            "Export spans and counters over OTLP/HTTP to this base URL "
            "(default: the config's [otel] endpoint; off).",
        )

    def configure(self, updated: set[str]) -> None:
        crosstalk = self.crosstalk
        section: OtelSection | None = crosstalk.config.otel
        if ctx.options.crosstalk_otel_endpoint:
            endpoint = ctx.options.crosstalk_otel_endpoint
            section = dataclasses.replace(crosstalk.config.otel, endpoint=endpoint)
        if crosstalk.placement.elsewhere:
            section = None  # the detector process exports: its scans, its spans
        if self.export is not None and (section is None or section != self.export.section):
            self.export.shutdown()
            self.export = None
        if section is not None and section.endpoint and self.export is None:
            if not section.endpoint.startswith(("http://", "https://")):
                raise exceptions.OptionsError("crosstalk_otel_endpoint: an http(s):// URL")
            try:
                self.export = OtelExport(section)
            except ImportError as e:
                raise exceptions.OptionsError(
                    f"crosstalk: [otel] endpoint needs the otel extra ({e.name} is missing): "
                    "pip install 'crosstalk[otel]'"
                ) from e
            if crosstalk.log is not None:
                crosstalk.log.info("otel.exporting", endpoint=section.endpoint)
        self.tenants = TenantLabels(crosstalk.config.metrics.max_tenant_labels)

    def response(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def done(self) -> None:
        if self.export is not None:
            self.export.shutdown()
            self.export = None

    def _settle(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if self.export is None or monitor is None or flow.metadata.get(EXPORTED_KEY):
            return
        flow.metadata[EXPORTED_KEY] = True
        export = self.export
        monitor.when_settled(lambda: self._export_safely(export, flow, monitor))

    def _export_safely(self, export: OtelExport, flow: http.HTTPFlow, monitor: Any) -> None:
        try:
            self._export(export, flow, monitor)
        except Exception as e:  # noqa: BLE001 -- telemetry must never fail an exchange
            self.failures += 1
            crosstalk = self.crosstalk
            if self.failures == 1 and crosstalk.log is not None:
                crosstalk.log.error("otel.error", error=type(e).__name__)

    def _export(self, export: OtelExport, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        parent = export.propagator.extract(
            {k.lower(): v for k, v in flow.request.headers.items() if k.lower() == "traceparent"}
        )
        start = wall_ns(monitor.started)
        end = start + int(monitor.duration_ms * 1e6)
        path = path_only(flow.request.path)
        status = flow.response.status_code if flow.response is not None else 0
        attributes: dict[str, Any] = {
            "crosstalk.request_id": monitor.request_id,
            "crosstalk.tenant": monitor.tenant,
            "crosstalk.verdict": monitor.verdict,
            "crosstalk.stream": monitor.stream,
            "crosstalk.findings": len(monitor.findings),
            "crosstalk.scan_ms": round(monitor.scan_seconds * 1000, 3),
            "http.request.method": flow.request.method,
            "url.path": path,
            "http.response.status_code": status,
        }
        if monitor.model:
            attributes["gen_ai.request.model"] = monitor.model
        if monitor.ttft_ms is not None:
            attributes["crosstalk.ttft_ms"] = monitor.ttft_ms
        span = export.tracer.start_span(
            f"crosstalk {path}", parent, SpanKind.SERVER, attributes, start_time=start
        )
        actions = [monitor.action_for(finding) for finding in monitor.findings]
        for finding, action in zip(monitor.findings, actions, strict=True):
            span.add_event(
                "crosstalk.leak",
                {
                    "crosstalk.leak.kind": finding.kind,
                    "crosstalk.leak.source_tenant": finding.source_tenant,
                    "crosstalk.leak.action": action,
                    "crosstalk.leak.output_start": finding.start,
                    "crosstalk.leak.output_end": finding.end,
                },
                timestamp=end,
            )
        if status >= 500 or flow.error is not None:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end)
        tenant = self.tenants(monitor.tenant)
        export.requests.add(1, {"tenant": tenant, "verdict": monitor.verdict})
        for finding, action in zip(monitor.findings, actions, strict=True):
            export.findings.add(1, {"kind": finding.kind, "action": action})
        export.scan_time.record(monitor.scan_seconds)
