"""The crosstalk mitmproxy addon: wires proxy hooks to the detection engine.

Load it in ``crosstalk run`` (embedded) or in your own mitmproxy::

    mitmdump -s addons/crosstalk.py --mode reverse:http://127.0.0.1:8000 \\
        --set crosstalk_config=config/crosstalk.example.toml

Every LLM request (the APIs of proxy.protocols) gets a tenant and a request id, and its
prompt is observed before it goes upstream. Every response is scanned as it streams
(SSE passes through as it arrives, never buffered) or whole when not streamed. One
``exchange`` event is logged per finished request. Anything else passes untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import signal
import sys
from typing import Any, cast

from mitmproxy import ctx, exceptions, http

from proxy import config as configuration
from proxy import factory
from proxy.engine import Engine, Finding
from proxy.engine.baseline import Baseline, BaselineError
from proxy.engine.records import Record
from proxy.eventlog import make_logger
from proxy.mitm import addon_errors, upstream_retry
from proxy.mitm import error_pages as mitm_errors
from proxy.mitm.flowstate import CLAIMS_TRUSTED_KEY, METADATA_KEY
from proxy.mitm.idle import IdleQueue
from proxy.mitm.placement import InProcess, OnLoop, reverse_upstreams
from proxy.pipeline.exchange import Enforcement, ExchangeMonitor
from proxy.protocols import ParsedRequest, ProtocolError, Route, route_for
from proxy.redaction import error_text, path_only, unquoted
from proxy.store.journal import JournalError, JournalWriter
from proxy.store.journal import load_window as journal_load_window
from proxy.store.redis_index import SharedIndex, open_index
from proxy.tenants import TenantRules, identify, request_id_of

PLACEMENT_KEY = "crosstalk.placement"  # where the exchange began: it ends there too
#: Options that override a key of the configuration file (``config.load``'s overrides).
OVERRIDES = {
    "crosstalk_mode": "proxy__mode",
    "crosstalk_log_file": "proxy__log_file",
    "crosstalk_log_level": "proxy__log_level",
    "crosstalk_log_format": "proxy__log_format",
    "crosstalk_journal": "journal__directory",
    "crosstalk_index": "index__url",
}


class CrossTalk:
    """Detects cross-tenant leaks in LLM responses passing through mitmproxy.

    Where the detection runs follows ``policy.shadow_detector``: on this event loop, or
    in a detector process to which this addon copies each exchange while it forwards it
    (``placement``, an ``OnLoop`` or an ``InProcess``: proxy/mitm/placement.py).
    ``inline=True`` is that process's own instance: it detects here, synchronously, and
    takes the proxy's fingerprint ``key`` (hex).
    """

    def __init__(
        self, *, inline: bool = False, key: str = "", upstreams: list[str] | None = None
    ) -> None:
        self.config = configuration.Config()
        self.engine: Engine | None = None
        self.inline = inline
        self._key = key
        # The proxy's upstreams, when this runs in a detector process (no proxy mode
        # here): they name the cache domain of the shared index. None: read the modes.
        self._upstreams = upstreams
        self.placement: OnLoop | InProcess = OnLoop(self)
        self.failed: str | None = None  # why it stops the proxy at start, if it does
        self.log: Any = None
        self.rules = TenantRules()
        self.counters: dict[str, int] = {
            "detector_errors": 0,
            "exchanges": 0,
            "findings": 0,
            "failed_open": 0,
            "failed_closed": 0,
            "journal_errors": 0,
            "scans_capped": 0,  # output past limits.max_scanned_output_chars, unscanned
            "tenant_claims_untrusted": 0,  # tenant claims ignored (tenant.untrusted)
            "addon_errors": 0,  # hooks that raised: mitmproxy passed the flow on (addon.failed)
        }
        self._unknown_logged: set[str] = set()
        self.journal: JournalWriter | None = None
        self._journal_failing = False
        self.index: SharedIndex | None = None  # scale-out: proxy/store/redis_index.py
        # The detector's work in shadow mode, run when the event loop is idle, in order
        # (prompts, chunks, ends of exchanges): forwarding never waits for it.
        self.idle = IdleQueue(on_error=self._idle_failed)
        self._running = False

    def load(self, loader) -> None:
        loader.add_option("crosstalk_config", str, "", "Path of the crosstalk TOML configuration.")
        loader.add_option("crosstalk_mode", str, "", "shadow or enforce; overrides the config.")
        loader.add_option(
            "crosstalk_log_file", str, "", "JSON-lines event log; empty: the config's, else stderr."
        )
        loader.add_option(
            "crosstalk_log_level", str, "", "debug, info or warning; overrides the config."
        )
        loader.add_option(
            "crosstalk_log_format", str, "", "auto, json or console; overrides the config."
        )
        loader.add_option(
            "crosstalk_journal",
            str,
            "",
            "Directory of the fingerprint journal (keyed records, no text); overrides the config.",
        )
        loader.add_option(
            "crosstalk_index",
            str,
            "",
            "redis://HOST:PORT/DB shared by the replicas (keyed records, no text); overrides "
            "the config.",
        )
        loader.add_option(
            "crosstalk_json_errors",
            bool,
            True,
            "Answer proxy-level errors (upstream unreachable, ...) with OpenAI-format JSON "
            "instead of mitmproxy's HTML page.",
        )
        loader.add_option(
            "crosstalk_upstream_retry",
            bool,
            True,
            "Send a request once more on a fresh connection when the kept-alive upstream "
            "connection it went out on was closed before any answer (else a 502).",
        )

    @staticmethod
    def _read_config() -> configuration.Config:
        """The configuration file with the options that override its keys."""
        overrides = {key: getattr(ctx.options, name) or None for name, key in OVERRIDES.items()}
        return configuration.load(ctx.options.crosstalk_config or None, **overrides)

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy == "eager":
            # Eager connects upstream before reading the request: with the upstream down,
            # clients would see a closed connection instead of a 502 they can act on.
            # (The update re-enters configure, which does the rest.)
            ctx.options.update(connection_strategy="lazy")
            return
        (mitm_errors.install if ctx.options.crosstalk_json_errors else mitm_errors.uninstall)()
        if ctx.options.crosstalk_upstream_retry:
            upstream_retry.install(lambda: self.log)
        else:
            upstream_retry.uninstall()
        if self.log is not None and not updated & {"crosstalk_config", *OVERRIDES}:
            return
        try:
            cfg = self._read_config()
            # One key for this process and a detector process: both name tenants alike.
            key = self._key or cfg.detection.key or secrets.token_hex(32)
            cfg = dataclasses.replace(cfg, detection=dataclasses.replace(cfg.detection, key=key))
            rules = factory.tenant_rules(cfg, bytes.fromhex(key))
        except configuration.ConfigError as e:
            raise exceptions.OptionsError(f"crosstalk: {e}") from e
        self.config = cfg
        self.log = make_logger(
            cfg.proxy.log_file or None, cfg.proxy.log_level, cfg.proxy.log_format
        )
        addon_errors.install(addon_errors.AddonFailures(lambda: self.log, self._count_addon_error))
        self.rules = rules
        self.placement.stop()
        if cfg.detector_process() and not self.inline:
            self._close_state()
            self.placement = InProcess(self)
            if self._running:  # else once every option is set (``running``)
                self.placement.start()
            return
        self.placement = OnLoop(self)
        engine_config = cfg.engine_config()
        self.engine = factory.build_engine(cfg)
        self._load_state()
        self._open_journal()
        self._open_index()
        self.log.info(
            "crosstalk.configured",
            mode=cfg.proxy.mode,
            detector="inline",
            key_id=self.engine.hasher.key_id,
            k=engine_config.k,
            window_seconds=engine_config.window_seconds,
        )

    def reload(self) -> None:
        """SIGHUP: read the config file again and apply what can change under load:
        policy, tenants, limits and new baseline files. Exchanges in flight keep the
        policy they started with; nothing is dropped. An invalid file changes nothing
        (``config.reload_failed`` says why); settings that need a restart (listen
        address, key, detection parameters, journal, index, TLS) are named in
        ``config.reloaded`` and left as they are."""
        if self.config is None or self.log is None:
            return
        try:
            fresh = self._read_config()
            rules = factory.tenant_rules(fresh, bytes.fromhex(self.config.detection.key))
        except configuration.ConfigError as e:
            self.log.error("config.reload_failed", reason=str(e), action="kept the old one")
            return
        old = self.config
        detection = dataclasses.replace(old.detection, baselines=fresh.detection.baselines)
        restart = [
            name
            for name in ("detection", "journal", "index", "tls", "metrics")
            if getattr(fresh, name) != getattr(old, name)
            and not (name == "detection" and _only_baselines(fresh.detection, old.detection))
        ]
        if fresh.proxy.mode != old.proxy.mode:
            restart.append("proxy.mode")
        limits = fresh.limits
        if limits.idle_timeout_seconds != old.limits.idle_timeout_seconds:
            restart.append("limits.idle_timeout_seconds")  # mitmproxy reads it per connection
            limits = dataclasses.replace(
                limits, idle_timeout_seconds=old.limits.idle_timeout_seconds
            )
        added = [p for p in fresh.detection.baselines if p not in old.detection.baselines]
        if self.engine is not None:
            for path in added:
                try:
                    self.engine.add_baseline_file(Baseline.load(path))
                except (BaselineError, OSError) as e:
                    self.log.error("config.reload_failed", reason=f"{path}: {e}", action="kept")
                    return
        self.config = dataclasses.replace(
            old, policy=fresh.policy, tenants=fresh.tenants, limits=limits,
            detection=detection, degenerate=fresh.degenerate, prevention=fresh.prevention,
        )  # fmt: skip
        self.rules = rules
        self.placement.reload()
        self.log.info(
            "config.reloaded",
            baselines_added=len(added),
            needs_restart=restart,
            process="detector" if self.inline else "proxy",
        )

    async def detector_started(self) -> None:
        """Once a detector process's start has ended (ready or failed); at once when
        there is none, or none is starting."""
        await self.placement.started()

    @property
    def running_now(self) -> bool:
        """Between mitmproxy's ``running`` and ``done`` hooks."""
        return self._running

    def stop_at_start(self, reason: str) -> None:
        """Detection cannot run, found at start: say why and stop the proxy, as a
        configuration error would."""
        self.failed = reason
        print(f"crosstalk: {reason}", file=sys.stderr)
        ctx.master.shutdown()

    def _close_state(self) -> None:
        """No engine here (a detector process has it): nothing to keep open."""
        self._save_state()
        for resource in (self.index, self.journal):
            if resource is not None:
                resource.close()
        self.engine = self.index = self.journal = None

    async def running(self) -> None:
        self._running = True
        if not self.inline:  # the detector process reloads on the proxy's "reload" frame
            # SIGHUP reloads under mitmdump as under ``crosstalk run`` (the same addon).
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        self.placement.start()  # a detector process, in the background
        if self.index is not None:
            self.index.start()

    def _count_addon_error(self) -> None:
        self.counters["addon_errors"] += 1

    def done(self) -> None:
        self._running = False
        addon_errors.uninstall()
        if not self.inline:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        self.placement.stop()
        self.idle.drain()
        self._save_state()
        if self.index is not None:
            self.index.close()
        if self.journal is not None:
            self.journal.close()

    def _open_journal(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        settings = configuration.journal_settings(self.config)
        if settings is None:
            return
        assert self.engine is not None  # configure built it just before
        try:
            self.journal = JournalWriter(settings, self.engine.hasher.key_id, self.engine.config.k)
        except OSError as e:
            raise exceptions.OptionsError(f"crosstalk: journal {settings.directory}: {e}") from e
        self.log.info("journal.opened", directory=settings.directory)
        if self.config.index.url:
            return  # a replica loads the window from the shared index instead
        try:
            loaded, corrupt = journal_load_window(self.engine, [settings.directory])
        except (OSError, JournalError) as e:
            self.log.warning("journal.unusable", directory=settings.directory, reason=str(e))
            return
        self.log.info("journal.loaded", records=loaded, corrupt=corrupt)

    def _open_index(self) -> None:
        """Scale-out (proxy/store/redis_index.py). At start the window is loaded here, before
        mitmproxy listens; on a later reconfiguration the consumer catches up instead."""
        if self.index is not None:
            self.index.close()
        assert self.engine is not None  # configure built it just before
        try:
            upstreams = self._upstreams if self._upstreams is not None else reverse_upstreams()
            self.index = open_index(self.config, self.engine, self.log, self.counters, upstreams)
        except ValueError as e:
            raise exceptions.OptionsError(f"crosstalk: {e}") from e
        if self.index is not None and not self._running:
            self.index.load_window()
        elif self.index is not None:
            self.index.start()

    def sink(self, record: Record) -> None:
        """Where each keyed record goes: the journal and the replicas' shared stream."""
        self._journal(record)
        if self.index is not None:
            self.index.publish(record)

    def _journal(self, record: Record) -> None:
        """Append to the journal; a failing disk is logged once per episode and never
        touches traffic."""
        if self.journal is None:
            return
        try:
            self.journal.write(record)
        except (OSError, ValueError) as e:
            self.counters["journal_errors"] += 1
            if not self._journal_failing:
                self._journal_failing = True
                self.log.error("journal.error", reason=f"{type(e).__name__}: {e}")
            return
        if self._journal_failing:
            self._journal_failing = False
            self.log.info("journal.recovered", errors=self.counters["journal_errors"])

    def _load_state(self) -> None:
        path = self.config.detection.state_file
        if not path:
            return
        assert self.engine is not None  # configure built it just before
        try:
            self.engine.load_commonness(path)
            self.log.info("state.loaded", path=path)
        except FileNotFoundError:
            self.log.info("state.absent", path=path, detail="starting cold; saved at exit")
        except (OSError, ValueError, KeyError) as e:
            self.log.warning("state.unusable", path=path, reason=str(e))

    def _save_state(self) -> None:
        path = self.config.detection.state_file
        if path and self.engine is not None:
            try:
                self.engine.save_commonness(path)
                self.log.info("state.saved", path=path)
            except OSError as e:
                self.log.error("state.save_failed", path=path, reason=str(e))

    # -- hooks -----------------------------------------------------------------------

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        peer = flow.client_conn.peername[0] if flow.client_conn.peername else None
        trusted = flow.metadata.get(CLAIMS_TRUSTED_KEY)
        if trusted is None:
            trusted = flow.metadata[CLAIMS_TRUSTED_KEY] = self.rules.trusts(
                peer, flow.request.headers
            )
        # The gateway's secret is for crosstalk alone: never upstream, on any path.
        flow.request.headers.pop(self.rules.gateway_header, None)
        route = route_for(flow.request.method, flow.request.path)
        if route is None:
            self._note_unknown(flow)
            return
        placement = self.placement
        if not placement.accepting:
            return  # the moment between listening and the detector's start: unscanned
        request_id = request_id_of(flow.request.headers)
        flow.request.headers["x-request-id"] = request_id
        parsed = self._parse(flow, route, request_id) if placement.reads_bodies else None
        headers = flow.request.headers
        identity = identify(self.rules, headers, parsed.user if parsed else None, trusted=trusted)
        if identity.tenant is None and not placement.reads_bodies:
            with contextlib.suppress(ProtocolError):  # the detector logs request.unparsed
                parsed = route.parse_request(flow.request.get_content(strict=False) or b"")
            # A ParsedRequest is never falsy: this is its user or None.
            user = cast("str | None", parsed and parsed.user)
            identity = identify(self.rules, headers, user, trusted=trusted)
        tenant = identity.tenant
        if identity.ignored:
            self.counters["tenant_claims_untrusted"] += 1
        if identity.ignored and not placement.elsewhere:  # else the detector process logs it
            self.log.warning(
                "tenant.untrusted",
                request_id=request_id,
                peer=peer,
                sources=[source for source, _ in identity.ignored],
                claimed=[name for _, name in identity.ignored],
                tenant=tenant or "anonymous",
            )
        if tenant is None:
            if self.config.tenants.unknown == "reject":
                self._reject_unknown_tenant(flow, request_id, route)
                return
            tenant = "anonymous"
        policy = self.config.policy_for(tenant, flow.request.path)
        learning = self.engine is not None and self.engine.observed_requests < policy.learn_requests
        enforcement = None
        if policy.mode == "enforce":
            enforcement = Enforcement(
                holdback_words=policy.holdback_words,
                min_foreign_words=policy.min_foreign_words,
                fail_closed=policy.fail_closed,
                budget_ms=policy.budget_ms,
            )
            # The gate cuts the stream into whole events: it needs plaintext bytes.
            flow.request.headers["accept-encoding"] = "identity"
        monitor = ExchangeMonitor.begin(
            route,
            tenant,
            request_id,
            parsed,
            self._on_findings,
            scan_batch_chars=self.config.policy.shadow_batch_chars,
            max_scan_chars=self.config.limits.max_scanned_output_chars,
            enforcement=enforcement,
            on_block=lambda _: self._abort_upstream(flow),
            learning=learning,
        )
        flow.metadata[METADATA_KEY] = monitor
        flow.metadata[PLACEMENT_KEY] = placement
        placement.begin(flow, monitor, parsed)

    def _parse(self, flow: http.HTTPFlow, route: Route, request_id: str) -> ParsedRequest | None:
        try:
            return route.parse_request(flow.request.get_content(strict=False) or b"")
        except ProtocolError as e:
            self.log.warning(
                "request.unparsed",
                request_id=request_id,
                path=path_only(flow.request.path),
                reason=str(e),
            )
            return None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        response = flow.response
        assert response is not None  # responseheaders: mitmproxy has the response
        is_sse = "text/event-stream" in response.headers.get("content-type", "")
        if monitor is None:
            if is_sse:
                response.stream = True  # SSE we do not scan: still never buffered
            return
        response.headers["x-request-id"] = monitor.request_id
        flow.metadata[PLACEMENT_KEY].responseheaders(flow, monitor, is_sse)

    async def response(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is not None:
            await flow.metadata[PLACEMENT_KEY].response(flow, monitor)

    def error(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is not None:
            flow.metadata[PLACEMENT_KEY].error(flow, monitor)

    def _idle_failed(self, error: Exception) -> None:
        """A deferred item raised outside the monitor's own failure handling (e.g. while
        logging an exchange): said in the log, never to the event loop."""
        self.log.error("shadow_queue.error", reason=error_text(error))

    # -- helpers ---------------------------------------------------------------------

    def _abort_upstream(self, flow: http.HTTPFlow) -> None:
        """Close the upstream connection so the engine stops generating. Deferred, so
        that the error event already returned reaches the client first. Uses the
        proxyserver addon's connection handlers (internal API, pinned by a test)."""
        proxyserver = ctx.master.addons.get("proxyserver")
        handler = proxyserver.connections.get(flow.client_conn.id) if proxyserver else None
        if handler is None or not flow.server_conn.connected:
            return
        asyncio.get_running_loop().call_soon(handler.close_connection, flow.server_conn)

    def _on_findings(self, monitor: ExchangeMonitor, findings: list[Finding]) -> None:
        evidence_text = self.config.proxy.log_evidence_text
        for finding in findings:
            self.counters["findings"] += 1
            self.log.warning(
                "leak.detected", **monitor.leak_fields(finding, evidence_text=evidence_text)
            )

    def log_unscanned(self, flow: http.HTTPFlow, reason: str) -> None:
        """The ``exchange`` line of an exchange that the detector process took and died
        with, or could not take: the proxy passed it on unscanned, and says so."""
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is not None:
            status = flow.response.status_code if flow.response else 0
            self._exchange_line(flow, monitor, status, "unscanned", error=reason)

    def log_exchange(
        self, flow: http.HTTPFlow, monitor: ExchangeMonitor, status: int, error: str | None = None
    ) -> None:
        self.counters["exchanges"] += 1
        if monitor.scan is not None and monitor.scan.finished:
            self.sink(monitor.scan.record())
        if monitor.detector_error is not None:
            self.counters["detector_errors"] += 1
            failed_closed = monitor.failed_closed and monitor.blocked_by is None
            self.counters["failed_closed" if failed_closed else "failed_open"] += 1
            self.log.error(
                "detector.error",
                request_id=monitor.request_id,
                tenant=monitor.tenant,
                reason=monitor.detector_error,
                action="failed_closed" if failed_closed else "failed_open",
            )
        fields: dict[str, Any] = {}
        if error:
            fields["error"] = unquoted(error)
        if monitor.truncated:
            fields["truncated"] = True
        if monitor.scan_capped:
            self.counters["scans_capped"] += 1
            fields["scan_capped"] = True  # the output past max_scanned_output_chars
        if monitor.upstream_error:
            fields["upstream_error"] = unquoted(str(monitor.upstream_error.get("message", "")))
        self._exchange_line(flow, monitor, status, monitor.verdict, **fields)

    def _exchange_line(
        self, flow: http.HTTPFlow, monitor: ExchangeMonitor, status: int, verdict: str, **fields
    ) -> None:
        self.log.info(
            "exchange",
            request_id=monitor.request_id,
            tenant=monitor.tenant,
            method=flow.request.method,
            path=path_only(flow.request.path),
            status=status,
            stream=monitor.stream,
            model=monitor.model,
            duration_ms=monitor.duration_ms,
            ttft_ms=monitor.ttft_ms,
            prompt_chars=monitor.prompt_chars,
            output_chars=monitor.output_chars,
            verdict=verdict,
            **fields,
        )

    def _reject_unknown_tenant(self, flow: http.HTTPFlow, request_id: str, route: Route) -> None:
        flow.response = http.Response.make(
            400,
            route.error_body(
                "crosstalk: no tenant could be identified for this request",
                type="invalid_request_error",
                code="tenant_required",
            ),
            {"content-type": "application/json", "x-request-id": request_id},
        )
        self.log.warning("request.rejected", request_id=request_id, reason="no tenant")

    def _note_unknown(self, flow: http.HTTPFlow) -> None:
        key = f"{flow.request.method} {path_only(flow.request.path)}"
        if key not in self._unknown_logged and len(self._unknown_logged) < 1000:
            self._unknown_logged.add(key)
            self.log.debug(
                "passthrough.unrecognised",
                method=flow.request.method,
                path=path_only(flow.request.path),
            )


def _only_baselines(
    fresh: configuration.DetectionSection, old: configuration.DetectionSection
) -> bool:
    """Whether two detection sections differ in their baseline files alone."""
    return dataclasses.replace(fresh, baselines=old.baselines, key=old.key) == old
