"""Prometheus metrics (docs/operations.md, "Metrics"): a mitmproxy addon serving ``/metrics``.

``crosstalk run --metrics-port 9464`` (or ``[metrics] port``, or the mitmproxy option
``crosstalk_metrics_port``) starts prometheus-client's HTTP server on
``[metrics] host`` (127.0.0.1 by default) in a daemon thread. Added after the
``CrossTalk`` addon (and the prevention and degenerate addons), it counts each finished
exchange from its ``ExchangeMonitor`` and reads the other addons' counters at scrape
time. Ids and counts only: no prompt or output text, no keyed hash, in any label.

Label cardinality is bounded: the first ``[metrics] max_tenant_labels`` (100) tenants
seen get their own ``tenant`` label value, later ones are counted as ``other`` (the
``crosstalk_tenant_labels`` gauge says how many are in use); upstreams are capped at 64.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from mitmproxy import ctx, exceptions, http
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proxy.mitm.admin import start_admin_server
from proxy.mitm.flowstate import METADATA_KEY, addon_named
from proxy.pipeline.exchange import GC_PAUSES

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric

    from proxy.pipeline.exchange import ExchangeMonitor

OTHER = "other"
COUNTED_KEY = "crosstalk.metrics_counted"
# Engine scan call times: a few microseconds per delta to tens of ms for a whole body.
SCAN_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
# CrossTalk's own counters that the labelled metrics already count.
_LABELLED = frozenset({"exchanges", "findings"})
_NAME = re.compile(r"[^a-zA-Z0-9_]")

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk


class TenantLabels:
    """The ``tenant`` label value of a tenant: its name for the first ``limit`` tenants
    seen, ``other`` after that (first come, first served, so a label never changes
    meaning while the process runs)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        with self._lock:
            if len(self._known) < self.limit:
                self._known.add(tenant)
                return tenant
        return OTHER

    def __len__(self) -> int:
        return len(self._known)


class _Collector:
    """What is read at scrape time: the addons' counter dicts, the engine's state, the
    degenerate rate per upstream."""

    def __init__(self, owner: CrossTalkMetrics) -> None:
        self.owner = owner

    def describe(self) -> list:
        return []  # dynamic families: no duplicate check at registration

    def collect(self) -> Iterator[Metric]:
        crosstalk = self.owner.crosstalk
        counters: dict[str, int] = dict(crosstalk.counters)
        prevention = addon_named("crosstalkprevention")
        if prevention is not None:
            counters.update(prevention.counters)
        for key, value in sorted(counters.items()):
            if key in _LABELLED:
                continue
            name = "crosstalk_" + _NAME.sub("_", key)
            yield CounterMetricFamily(name, f"CrossTalk counter {key!r}.", value=value)
        idle = crosstalk.idle
        yield GaugeMetricFamily(
            "crosstalk_shadow_queue_items",
            "Shadow-mode engine work waiting for an idle event loop.",
            value=len(idle),
        )
        yield CounterMetricFamily(
            "crosstalk_shadow_queue_overdue",
            "Queued items run before the loop was idle (waited 50 ms or behind 10,000): "
            "the proxy is short of CPU.",
            value=idle.overdue,
        )
        yield CounterMetricFamily(
            "crosstalk_shadow_queue_errors",
            "Queued items that raised (each logged as shadow_queue.error).",
            value=idle.errors,
        )
        engine = crosstalk.engine
        if engine is not None:
            yield GaugeMetricFamily(
                "crosstalk_fingerprints",
                "Fingerprints held in the index.",
                value=engine.fingerprints,
            )
            yield CounterMetricFamily(
                "crosstalk_fingerprints_evicted",
                "Fingerprints evicted (window or cap), since the engine was built.",
                value=engine.index.evicted,
            )
            yield GaugeMetricFamily(
                "crosstalk_engine_observed_requests",
                "Requests the engine has learned from (a loaded state file counts).",
                value=engine.observed_requests,
            )
        # Every stream of the process waits while the collector runs (issue 16's target:
        # the longest pause in the detector <= 5 ms).
        yield CounterMetricFamily(
            "crosstalk_gc_pause_seconds",
            "Seconds this process stood still in the cyclic garbage collector.",
            value=GC_PAUSES.seconds,
        )
        collections = CounterMetricFamily(
            "crosstalk_gc_collections", "Collections run, by generation.", labels=["generation"]
        )
        longest = GaugeMetricFamily(
            "crosstalk_gc_pause_longest_seconds",
            "The longest single collection since start-up (a detector process: since it "
            "was ready), by generation (2: a full collection).",
            labels=["generation"],
        )
        longest_cpu = GaugeMetricFamily(
            "crosstalk_gc_pause_longest_cpu_seconds",
            "The longest collection in this process's CPU time, by generation (may be "
            "another collection than the wall-clock longest, which also holds the time a "
            "busy machine did not run the process).",
            labels=["generation"],
        )
        for generation in range(3):
            collections.add_metric([str(generation)], GC_PAUSES.collections[generation])
            longest.add_metric([str(generation)], GC_PAUSES.longest[generation])
            longest_cpu.add_metric([str(generation)], GC_PAUSES.longest_cpu[generation])
        yield collections
        yield longest
        yield longest_cpu
        yield GaugeMetricFamily(
            "crosstalk_tenant_labels",
            "Distinct tenant label values in use (capped by metrics.max_tenant_labels).",
            value=len(self.owner.tenants),
        )
        degenerate = addon_named("crosstalkdegenerate")
        if degenerate is not None:
            family = CounterMetricFamily(
                "crosstalk_degenerate_outputs",
                "Exchanges whose output looked degenerate (output.degenerate), by upstream and reason.",
                labels=("upstream", "reason"),
            )
            for (upstream, reason), n in sorted(dict(degenerate.counts).items()):
                family.add_metric((upstream, reason), n)
            yield family
            rate = GaugeMetricFamily(
                "crosstalk_degenerate_rate",
                "Share of exchanges with degenerate output over the last "
                "degenerate.rate_window_seconds, by upstream.",
                labels=("upstream",),
            )
            total = GaugeMetricFamily(
                "crosstalk_degenerate_window_exchanges",
                "Exchanges in the degenerate rate's window, by upstream.",
                labels=("upstream",),
            )
            for upstream, (bad, n) in sorted(degenerate.rates.counts().items()):
                rate.add_metric((upstream,), bad / n if n else 0.0)
                total.add_metric((upstream,), n)
            yield rate
            yield total


class CrossTalkMetrics:
    """Counts exchanges, findings and scan times; serves them with prometheus-client."""

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "crosstalk_requests",
            "LLM requests finished, by tenant and verdict (clean, leak, blocked).",
            ("tenant", "verdict"),
            registry=self.registry,
        )
        self.findings = Counter(
            "crosstalk_findings",
            "Findings (leak.detected), by kind (fragment, entity, canary) and action.",
            ("kind", "action"),
            registry=self.registry,
        )
        self.scan_seconds = Histogram(
            "crosstalk_scan_seconds",
            "Time of one engine scan call (an SSE delta in enforce mode, a batch of "
            "policy.shadow_batch_chars in shadow mode, or a whole body).",
            buckets=SCAN_BUCKETS,
            registry=self.registry,
        )
        self.tenants = TenantLabels(100)
        self.registry.register(_Collector(self))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.bound: tuple[str, int] | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "crosstalk_metrics_port",
            int,
            0,
            "Serve Prometheus metrics on this port (0: the config's [metrics] port; off).",
        )
        loader.add_option(
            "crosstalk_metrics_host", str, "", "Metrics address (default: the config's, 127.0.0.1)."
        )

    def configure(self, updated: set[str]) -> None:
        crosstalk = self.crosstalk
        section = crosstalk.config.metrics
        port = ctx.options.crosstalk_metrics_port or section.port
        host = ctx.options.crosstalk_metrics_host or section.host
        limit = section.max_tenant_labels
        if limit != self.tenants.limit:
            self.tenants = TenantLabels(limit)
        if crosstalk.placement.elsewhere:
            port = 0  # the detector process serves them: its engine, its counts
        if not port:
            self._stop()
            return
        if self.bound == (host, port):
            return
        self._stop()
        try:
            self._server, self._thread = start_admin_server(
                host, port, self.registry, self.readiness
            )
        except OSError as e:
            raise exceptions.OptionsError(f"crosstalk: metrics on {host}:{port}: {e}") from e
        self.bound = (host, port)
        if crosstalk.log is not None:
            crosstalk.log.info("metrics.listening", host=host, port=port)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``/readyz``: this process's engine is up; the shared index connected or
        degraded (still detecting locally), or not configured."""
        crosstalk = self.crosstalk
        engine = getattr(crosstalk, "engine", None)
        index = getattr(crosstalk, "index", None)
        if index is None:
            index_state = "off"
        else:
            index_state = "degraded" if index.health.degraded else "connected"
        details = {
            "detector": "ready" if engine is not None else "not started",
            "index": index_state,
        }
        return engine is not None, details

    def request(self, flow: http.HTTPFlow) -> None:
        monitor = flow.metadata.get(METADATA_KEY)
        if monitor is not None and not self.crosstalk.placement.elsewhere:
            monitor.on_scan = self.scan_seconds.observe

    def response(self, flow: http.HTTPFlow) -> None:
        self._count(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._count(flow)

    def done(self) -> None:
        self._stop()

    def _count(self, flow: http.HTTPFlow) -> None:
        monitor = flow.metadata.get(METADATA_KEY)
        if monitor is None or flow.metadata.get(COUNTED_KEY) or self.crosstalk.placement.elsewhere:
            return
        flow.metadata[COUNTED_KEY] = True
        monitor.when_settled(lambda: self._count_outcome(monitor))

    def _count_outcome(self, monitor: ExchangeMonitor) -> None:
        self.requests.labels(self.tenants(monitor.tenant), monitor.verdict).inc()
        for finding in monitor.findings:
            self.findings.labels(finding.kind, monitor.action_for(finding)).inc()

    def _stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._server = self._thread = self.bound = None
