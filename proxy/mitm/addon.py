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
import time
from collections.abc import Generator
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
from proxy.mitm.detector_process import DetectorProcess, FlowMirror
from proxy.mitm.flowstate import CLAIMS_TRUSTED_KEY, METADATA_KEY
from proxy.mitm.idle import IdleQueue
from proxy.pipeline.exchange import (
    BLOCK_MESSAGE,
    FAILED_CLOSED_MESSAGE,
    Enforcement,
    ExchangeMonitor,
)
from proxy.protocols import ParsedRequest, ProtocolError, Route, route_for
from proxy.redaction import error_text, path_only, unquoted
from proxy.store.journal import JournalError, JournalWriter
from proxy.store.journal import load_window as journal_load_window
from proxy.store.redis_index import SharedIndex, open_index
from proxy.tenants import TenantRules, identify, request_id_of

UNSCANNED_KEY = "crosstalk.unscanned"  # why a flow's copy never reached the detector
READY_TIMEOUT = 120.0  # seconds a detector process may take to load its state
RESTART_DELAY = 1.0  # seconds before a dead detector process is replaced
MAX_RESTARTS = 5  # replacements per run; a detector that keeps dying is left off
OPTIONS: dict[str, tuple[type, Any, str]] = {
    "crosstalk_config": (str, "", "Path of the crosstalk TOML configuration."),
    "crosstalk_mode": (str, "", "shadow or enforce; overrides the config file."),
    "crosstalk_log_file": (str, "", "JSON-lines event log; empty: the config's, else stderr."),
    "crosstalk_log_level": (str, "", "debug, info or warning; overrides the config file."),
    "crosstalk_log_format": (str, "", "auto, json or console; overrides the config file."),
    "crosstalk_journal": (
        str,
        "",
        "Directory of the fingerprint journal (keyed records, no text); overrides the config.",
    ),
    "crosstalk_index": (
        str,
        "",
        "redis://HOST:PORT/DB shared by the replicas (keyed records, no text); overrides the config.",
    ),
    "crosstalk_json_errors": (
        bool,
        True,
        "Answer proxy-level errors (upstream unreachable, ...) with OpenAI-format JSON "
        "instead of mitmproxy's HTML page.",
    ),
    "crosstalk_upstream_retry": (
        bool,
        True,
        "Send a request once more on a fresh connection when the kept-alive upstream "
        "connection it went out on was closed before any answer (else a 502).",
    ),
}


class CrossTalk:
    """Detects cross-tenant leaks in LLM responses passing through mitmproxy.

    Where the detection runs follows ``policy.shadow_detector``: on this event loop, or
    in a detector process (proxy/mitm/detector_process.py) to which this addon copies each
    exchange while it forwards it. ``inline=True`` is that process's own instance: it
    detects here, synchronously, and takes the proxy's fingerprint ``key`` (hex).
    """

    def __init__(self, *, inline: bool = False, key: str = "") -> None:
        self.config = configuration.Config()
        self.engine: Engine | None = None
        self.inline = inline
        self._key = key
        self.detector: DetectorProcess | None = None
        self.mirror: FlowMirror | None = None
        self.detector_wanted = False  # detection in a process (policy.shadow_detector)
        self._starting: asyncio.Task | None = None  # a (re)start while running
        self._restarts = 0
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
        for name, (typ, default, help_text) in OPTIONS.items():
            loader.add_option(name, typ, default, help_text)

    def configure(self, updated: set[str]) -> None:
        if ctx.options.connection_strategy == "eager":
            # Eager connects upstream before reading the request: with the upstream down,
            # clients would see a closed connection instead of a 502 they can act on.
            # (The update re-enters configure, which does the rest.)
            ctx.options.update(connection_strategy="lazy")
            return
        (mitm_errors.install if ctx.options.crosstalk_json_errors else mitm_errors.uninstall)()
        (
            upstream_retry.install
            if ctx.options.crosstalk_upstream_retry
            else upstream_retry.uninstall
        )()
        if self.log is not None and not updated & set(OPTIONS):
            return
        try:
            cfg = configuration.load(
                ctx.options.crosstalk_config or None,
                proxy__mode=ctx.options.crosstalk_mode or None,
                proxy__log_file=ctx.options.crosstalk_log_file or None,
                proxy__log_level=ctx.options.crosstalk_log_level or None,
                proxy__log_format=ctx.options.crosstalk_log_format or None,
                journal__directory=ctx.options.crosstalk_journal or None,
                index__url=ctx.options.crosstalk_index or None,
            )
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
        self._stop_detector()
        self.detector_wanted = cfg.detector_process() and not self.inline
        if self.detector_wanted:
            self._close_state()
            if self._running:  # else once every option is set (``running``)
                self._starting = asyncio.get_running_loop().create_task(self._start_detector())
            return
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
            fresh = configuration.load(
                ctx.options.crosstalk_config or None,
                proxy__mode=ctx.options.crosstalk_mode or None,
            )
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
        if self.detector is not None:
            self.detector.send("reload", 0, None, time.monotonic())
        self.log.info(
            "config.reloaded",
            baselines_added=len(added),
            needs_restart=restart,
            process="detector" if self.inline else "proxy",
        )

    async def _start_detector(self, *, restart: bool = False) -> None:
        """Detection in a child process: this one only copies exchanges to it. Waits
        for the child to be configured (its state, journal window or shared index
        loaded); if it cannot be at start, says why and stops the proxy, as inline mode
        would (a replacement that fails leaves detection off, logged)."""
        options = {n: o.current() for n, o in ctx.options.items() if n.startswith("crosstalk_")}
        hello = {"key": self.config.detection.key, "options": options}
        self.detector = DetectorProcess(
            hello, nice=self.config.policy.shadow_detector_nice, on_event=self._detector_event
        )
        self.detector.start()
        assert self.detector.proc is not None  # start() made the child
        self.mirror = FlowMirror(self.detector)
        self.log.info(
            "crosstalk.configured",
            mode=self.config.proxy.mode,
            detector="process",
            pid=self.detector.proc.pid,
            nice=self.detector.nice,
        )
        started = time.monotonic()
        failure = await self.detector.ready(READY_TIMEOUT)
        if failure is None:
            seconds = round(time.monotonic() - started, 2)
            self.log.info("detector.ready", pid=self.detector.proc.pid, seconds=seconds)
            return
        self.log.error("detector.failed", reason=failure)
        if not restart:
            self.failed = f"the detector process failed: {failure}"
            print(f"crosstalk: {self.failed}", file=sys.stderr)
            ctx.master.shutdown()

    async def detector_started(self) -> None:
        """Once the detector process's start has ended (ready or failed); at once when
        none is starting."""
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)

    def _detector_event(self, event: str, detail: Any) -> None:
        if event == "logged":
            if self.mirror is not None:
                self.mirror.logged(detail)
            return
        if event == "exited":
            if self.mirror is not None:
                for flow in self.mirror.orphans():
                    self._log_unscanned(flow, f"the detector process {detail} before logging it")
            restart = self._running and self._restarts < MAX_RESTARTS
            then = f"replaced in {RESTART_DELAY:g} s" if restart else "detection stays off"
            self.log.error(
                "detector.error",
                reason=f"detector process {detail}: exchanges pass unscanned; {then}",
                action="failed_open",
            )
            if restart:
                self._restarts += 1
                asyncio.get_running_loop().call_later(RESTART_DELAY, self._replace_detector)
        elif event == "lagging":
            self.log.warning(
                "detector.lagging",
                backlog_bytes=detail,
                detail="new exchanges pass unscanned until the detector catches up",
            )
        elif event == "caught_up":
            assert self.mirror is not None  # set while its detector runs (_start_detector)
            self.log.info("detector.caught_up", backlog_bytes=detail, skipped=self.mirror.skipped)

    def _replace_detector(self) -> None:
        """A fresh child (its engine starts from the state file or journal, if any)."""
        if not self._running or not self.detector_wanted:
            return
        self._stop_detector()
        self._starting = asyncio.get_running_loop().create_task(self._start_detector(restart=True))

    def _stop_detector(self) -> None:
        if self.detector is not None:
            self.detector.close()
        self.detector = self.mirror = None

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
        if self.detector_wanted and self.detector is None:
            # Started in the background: mitmproxy listens before ``running``, and the
            # addons after this one (tlsconfig's certificate store) initialise only once
            # this hook returns. Awaited here, the child's seconds of start-up met
            # early requests with those addons unready, and mitmdump exits on any error
            # logged before ``running`` returns. Until it is ready, exchanges are copied
            # to it and wait in the pipe.
            self._starting = asyncio.get_running_loop().create_task(self._start_detector())
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
        self._stop_detector()
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
        self.index = open_index(self.config, self.engine, self.log, self.counters)
        if self.index is not None and not self._running:
            self.index.load_window()
        elif self.index is not None:
            self.index.start()

    def _sink(self, record: Record) -> None:
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
        if self.detector_wanted and self.mirror is None:
            return  # the moment between listening and the detector's start: unscanned
        request_id = request_id_of(flow.request.headers)
        flow.request.headers["x-request-id"] = request_id
        # With a detector process, this one reads the body only for a tenant named
        # nowhere else (its ``user`` field): the detector parses its copy anyway.
        parsed = None if self.mirror is not None else self._parse(flow, route, request_id)
        headers = flow.request.headers
        identity = identify(self.rules, headers, parsed.user if parsed else None, trusted=trusted)
        if identity.tenant is None and self.mirror is not None:
            with contextlib.suppress(ProtocolError):  # the detector logs request.unparsed
                parsed = route.parse_request(flow.request.get_content(strict=False) or b"")
            # A ParsedRequest is never falsy: this is its user or None.
            user = cast("str | None", parsed and parsed.user)
            identity = identify(self.rules, headers, user, trusted=trusted)
        tenant = identity.tenant
        if identity.ignored:
            self.counters["tenant_claims_untrusted"] += 1
        if identity.ignored and self.mirror is None:  # else the detector process logs it
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
        monitor = ExchangeMonitor(
            route=route,
            tenant=tenant,
            request_id=request_id,
            scan=None,
            on_findings=self._on_findings,
            enforcement=enforcement,
            on_block=lambda _: self._abort_upstream(flow),
            model=parsed.model if parsed else None,
            prompt_chars=len(parsed.prompt) if parsed else 0,
            scan_batch_chars=self.config.policy.shadow_batch_chars,
            learning=learning,
            max_scan_chars=self.config.limits.max_scanned_output_chars,
        )
        flow.metadata[METADATA_KEY] = monitor
        if self.mirror is not None:
            if not self.mirror.request(flow):
                flow.metadata[UNSCANNED_KEY] = "the detector process was lagging or gone"
            return
        if parsed is not None:
            # The engine's clock for this prompt is when the proxy had the request, not
            # when the idle queue (or the detector process, its copy) got to it: the
            # capture records the same moment, so a replay expires what live expired.
            arrived = flow.request.timestamp_end or flow.request.timestamp_start

            def observe() -> Generator[None, None, None]:
                try:
                    # The inline engine. Not narrowed: a reconfiguration to a detector
                    # process before this runs leaves None (an error, failing open).
                    monitor.scan = yield from cast(Engine, self.engine).observe_prompt_steps(
                        tenant,
                        request_id,
                        parsed.prompt,
                        arrived,
                        model_text=parsed.model_text,
                        turns_known=parsed.turns_known,
                    )
                except Exception as e:  # noqa: BLE001 -- fail open
                    monitor.detector_error = error_text(e)
                else:
                    self._sink(monitor.scan.prompt)

            # Observed once the loop is idle, after the request went upstream: its ~1 ms
            # is not added to anyone's time to first token. It still comes before any
            # response chunk that arrives later (the engine cannot leak a prompt it has
            # not received yet): the idle queue runs in order, and synchronous scans
            # drain it first.
            monitor.pending_observe = observe
            self.idle.push(monitor.observe_steps)

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
        if monitor is not None:
            response.headers["x-request-id"] = monitor.request_id
            if self.mirror is not None:
                self.mirror.responseheaders(flow, is_sse)
                return
        if not is_sse:
            return  # buffered: scanned whole in ``response``
        if monitor is None:
            response.stream = True  # SSE we do not scan: still never buffered
            return
        monitor.start_stream(response.headers.get("content-encoding"))

        if self.config.proxy.log_evidence_text:
            monitor.keep_text = True
        if monitor.enforcement is None and not self.inline:
            monitor.defer = self.idle.push
            monitor.deferred_count = lambda: self.idle.pushed
            response.stream = monitor.on_chunk
        else:
            response.stream = self._synchronous(monitor.on_chunk)

    async def response(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is None:
            return
        assert flow.response is not None  # the response hook: mitmproxy has the response
        if self.mirror is not None:
            if (reason := flow.metadata.pop(UNSCANNED_KEY, None)) is not None:
                self._log_unscanned(flow, reason)
            elif (verdict := await self.mirror.response(flow)) is not None:
                flow.response.headers["x-crosstalk-verdict"] = verdict
            return
        monitor.ended = monitor.ended or time.monotonic()
        status = flow.response.status_code
        if monitor.stream:
            monitor.when_settled(lambda: self._log_exchange(flow, monitor, status))
            return
        self.idle.drain()  # the prompt's observation included
        if self.config.proxy.log_evidence_text:
            monitor.keep_text = True
        body = self._decoded_body(flow.response, monitor)
        if body is not None and 200 <= flow.response.status_code < 300:
            monitor.on_body(body)
        else:
            monitor.close()
        if monitor.enforcement is not None and monitor.detector_error is not None:
            monitor.failed_closed = monitor.enforcement.fail_closed
        if monitor.verdict == "blocked":
            self._replace_with_block(flow, monitor)
        flow.response.headers["x-crosstalk-verdict"] = monitor.verdict
        self._log_exchange(flow, monitor, flow.response.status_code)

    def error(self, flow: http.HTTPFlow) -> None:
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is None:
            return
        if self.mirror is not None:
            if (reason := flow.metadata.pop(UNSCANNED_KEY, None)) is not None:
                self._log_unscanned(flow, reason)
            else:
                self.mirror.error(flow)
            return
        monitor.ended = monitor.ended or time.monotonic()
        status = flow.response.status_code if flow.response else 502
        error = flow.error.msg if flow.error else None

        def settle() -> None:  # after the queue: the prompt's observation included
            monitor.close()
            self._log_exchange(flow, monitor, status, error=error)

        if monitor.defer is None:
            self.idle.drain()  # what was queued before this exchange ended goes first
        monitor.when_settled(settle)

    def _idle_failed(self, error: Exception) -> None:
        """A deferred item raised outside the monitor's own failure handling (e.g. while
        logging an exchange): said in the log, never to the event loop."""
        self.log.error("shadow_queue.error", reason=error_text(error))

    def _synchronous(self, on_chunk):
        """A stream callable that brings the engine up to date (the idle queue) before
        each chunk: an enforced stream is scanned at once, so everything received
        before it must already be in the engine."""

        def stream(chunk: bytes) -> list[bytes]:
            self.idle.drain()
            return on_chunk(chunk)

        return stream

    # -- helpers ---------------------------------------------------------------------

    def _decoded_body(self, response: http.Response, monitor: ExchangeMonitor) -> bytes | None:
        try:
            return response.get_content(strict=True)
        except ValueError as e:
            monitor.undecodable(response.headers.get("content-encoding"), e)
            return None

    def _replace_with_block(self, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        """A non-streamed response that leaked (or could not be checked, failing
        closed) is replaced: 451 for a leak, 503 for a failed detector."""
        leak = monitor.blocked_by is not None
        flow.response = http.Response.make(
            451 if leak else 503,
            monitor.route.error_body(
                BLOCK_MESSAGE if leak else FAILED_CLOSED_MESSAGE,
                type="leak_blocked",
                code="cross_tenant_leak" if leak else "detector_failed",
            ),
            {"content-type": "application/json", "x-request-id": monitor.request_id},
        )

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

    def _log_unscanned(self, flow: http.HTTPFlow, reason: str) -> None:
        """The ``exchange`` line of an exchange that the detector process took and died
        with, or could not take: the proxy passed it on unscanned, and says so."""
        monitor: ExchangeMonitor | None = flow.metadata.get(METADATA_KEY)
        if monitor is not None:
            status = flow.response.status_code if flow.response else 0
            self._exchange_line(flow, monitor, status, "unscanned", error=reason)

    def _log_exchange(
        self, flow: http.HTTPFlow, monitor: ExchangeMonitor, status: int, error: str | None = None
    ) -> None:
        self.counters["exchanges"] += 1
        if monitor.scan is not None and monitor.scan.finished:
            self._sink(monitor.scan.record())
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
