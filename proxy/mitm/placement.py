"""Where detection runs, chosen once at configure time.

``OnLoop``: on this event loop. The engine observes each prompt when the loop is idle and
scans each stream's chunks (deferred to the idle queue in shadow mode, at once under
enforcement). ``InProcess``: in a detector process (proxy/mitm/detector_process.py)
that gets a copy of each exchange while this process forwards it; the child logs the
exchange, its findings and the side addons' events.

``CrossTalk``'s hooks do what both share (tenant, request id, the exchange's monitor)
and hand the rest to the placement, so that no hook branches on where detection runs.
The side addons ask ``elsewhere``: when True, the detector process reports their
events and counts, and this process must not do so a second time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, cast

from mitmproxy import ctx, http

from proxy.engine import Engine
from proxy.mitm.detector_process import MIRROR_KEY, DetectorProcess, FlowMirror
from proxy.pipeline.exchange import BLOCK_MESSAGE, FAILED_CLOSED_MESSAGE, ExchangeMonitor
from proxy.protocols import ParsedRequest
from proxy.redaction import error_text

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk

UNSCANNED_KEY = "crosstalk.unscanned"  # why a flow's copy never reached the detector
ENDED_KEY = "crosstalk.ended"  # the flow's end went to the detector process
READY_TIMEOUT = 120.0  # seconds a detector process may take to load its state
RESTART_DELAY = 1.0  # seconds before a dead detector process is replaced
MAX_RESTARTS = 5  # replacements per placement; a detector that keeps dying is left off


def reverse_upstreams() -> list[str]:
    """The upstream URLs of mitmproxy's reverse-proxy modes (``--mode reverse:URL``): what
    names this replica's cache domain (``index.domains``)."""
    from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

    found = []
    for spec in ctx.options.mode:
        try:
            mode = ProxyMode.parse(spec)
        except ValueError:
            continue
        if isinstance(mode, ReverseMode):
            found.append(mode.data)
    return found


class _Live:
    """Kept in ``flow.metadata`` (``PLACEMENT_KEY``), which mitmproxy copies into a
    saved flow (``-w``, its save addon; crosstalk's capture): live state is never part
    of a copy, as for the exchange's monitor."""

    def __deepcopy__(self, memo: dict) -> None:
        return None


class OnLoop(_Live):
    """Detection on this event loop, with ``CrossTalk``'s engine."""

    elsewhere = False
    accepting = True  # every exchange is scanned here
    reads_bodies = True  # the engine needs each prompt

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk

    def begin(
        self, flow: http.HTTPFlow, monitor: ExchangeMonitor, parsed: ParsedRequest | None
    ) -> None:
        """Queue the prompt's observation. It runs once the loop is idle, after the
        request went upstream: its ~1 ms is not added to anyone's time to first token.
        It still comes before any response chunk that arrives later (the engine cannot
        leak a prompt it has not received yet): the idle queue runs in order, and
        synchronous scans drain it first."""
        if parsed is None:
            return
        crosstalk = self.crosstalk
        # The engine's clock for this prompt is when the proxy had the request, not when
        # the idle queue got to it: the capture records the same moment, so a replay
        # expires what live expired.
        arrived = flow.request.timestamp_end or flow.request.timestamp_start

        def observe() -> Generator[None, None, None]:
            try:
                # Not narrowed: a reconfiguration to a detector process before this runs
                # leaves None (an error, failing open).
                monitor.scan = yield from cast(Engine, crosstalk.engine).observe_prompt_steps(
                    monitor.tenant,
                    monitor.request_id,
                    parsed.prompt,
                    arrived,
                    model_text=parsed.model_text,
                    turns_known=parsed.turns_known,
                )
            except Exception as e:  # noqa: BLE001 -- fail open
                monitor.detector_error = error_text(e)
            else:
                crosstalk.sink(monitor.scan.prompt)

        monitor.pending_observe = observe
        crosstalk.idle.push(monitor.observe_steps)

    def responseheaders(self, flow: http.HTTPFlow, monitor: ExchangeMonitor, is_sse: bool) -> None:
        """A stream is scanned chunk by chunk; a buffered body whole, in ``response``."""
        if not is_sse:
            return
        response = flow.response
        assert response is not None  # responseheaders: mitmproxy has the response
        crosstalk = self.crosstalk
        monitor.start_stream(response.headers.get("content-encoding"))
        if crosstalk.config.proxy.log_evidence_text:
            monitor.keep_text = True
        if monitor.enforcement is None and not crosstalk.inline:
            monitor.defer = crosstalk.idle.push
            monitor.deferred_count = lambda: crosstalk.idle.pushed
            response.stream = monitor.on_chunk
        else:
            response.stream = self._synchronous(monitor.on_chunk)

    async def response(self, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        response = flow.response
        assert response is not None  # the response hook: mitmproxy has the response
        crosstalk = self.crosstalk
        monitor.ended = monitor.ended or time.monotonic()
        if monitor.stream:
            status = response.status_code
            monitor.when_settled(lambda: crosstalk.log_exchange(flow, monitor, status))
            return
        crosstalk.idle.drain()  # the prompt's observation included
        if crosstalk.config.proxy.log_evidence_text:
            monitor.keep_text = True
        body = _decoded_body(response, monitor)
        if body is not None and 200 <= response.status_code < 300:
            monitor.on_body(body)
        else:
            monitor.close()
        if monitor.enforcement is not None and monitor.detector_error is not None:
            monitor.failed_closed = monitor.enforcement.fail_closed
        if monitor.verdict == "blocked":
            response = flow.response = _block_response(monitor)
        response.headers["x-crosstalk-verdict"] = monitor.verdict
        crosstalk.log_exchange(flow, monitor, response.status_code)

    def error(self, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        crosstalk = self.crosstalk
        monitor.ended = monitor.ended or time.monotonic()
        status = flow.response.status_code if flow.response else 502
        error = flow.error.msg if flow.error else None

        def settle() -> None:  # after the queue: the prompt's observation included
            monitor.close()
            crosstalk.log_exchange(flow, monitor, status, error=error)

        if monitor.defer is None:
            crosstalk.idle.drain()  # what was queued before this exchange ended goes first
        monitor.when_settled(settle)

    def _synchronous(self, on_chunk: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """A stream callable that brings the engine up to date (the idle queue) before
        each chunk: an enforced stream is scanned at once, so everything received
        before it must already be in the engine."""
        idle = self.crosstalk.idle

        def stream(chunk: bytes) -> Any:
            idle.drain()
            return on_chunk(chunk)

        return stream

    async def started(self) -> None:
        """Nothing starts: the engine was built in ``configure``."""

    def start(self) -> None:
        """Nothing to start."""

    def reload(self) -> None:
        """The engine is this process's: ``CrossTalk.reload`` updates it."""

    def stop(self) -> None:
        """Nothing runs apart from the event loop."""


class InProcess(_Live):
    """Detection in a detector process: this one copies each exchange to it (its
    ``FlowMirror``) and passes the exchange on whatever the child does. The child is
    started in the background once mitmproxy runs, replaced when it dies (at most
    ``MAX_RESTARTS`` times), and until it is ready exchanges wait in the pipe."""

    elsewhere = True
    reads_bodies = False  # the detector parses its copy; this process reads a body only
    # for a tenant named nowhere else (its ``user`` field)

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.detector: DetectorProcess | None = None
        self.mirror: FlowMirror | None = None
        self._starting: asyncio.Task | None = None  # a (re)start while running
        self._restarts = 0

    @property
    def accepting(self) -> bool:
        """False in the moment between listening and the detector's start: unscanned."""
        return self.mirror is not None

    def begin(
        self, flow: http.HTTPFlow, monitor: ExchangeMonitor, parsed: ParsedRequest | None
    ) -> None:
        assert self.mirror is not None  # accepting
        if not self.mirror.request(flow):
            flow.metadata[UNSCANNED_KEY] = "the detector process was lagging or gone"

    def responseheaders(self, flow: http.HTTPFlow, monitor: ExchangeMonitor, is_sse: bool) -> None:
        if is_sse:
            # Never buffered, copied or not: the mirror puts its copying step in place.
            cast(http.Response, flow.response).stream = True
        if self.mirror is not None:
            self.mirror.responseheaders(flow, is_sse)

    # An exchange whose child died or was stopped before logging it: marked unscanned
    # then, and logged so at its end, or at once if it had ended (``_let_go``).

    async def response(self, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        assert flow.response is not None  # the response hook: mitmproxy has the response
        flow.metadata[ENDED_KEY] = True
        if (reason := flow.metadata.pop(UNSCANNED_KEY, None)) is not None:
            self.crosstalk.log_unscanned(flow, reason)
        elif self.mirror is not None and (verdict := await self.mirror.response(flow)) is not None:
            flow.response.headers["x-crosstalk-verdict"] = verdict

    def error(self, flow: http.HTTPFlow, monitor: ExchangeMonitor) -> None:
        flow.metadata[ENDED_KEY] = True
        if (reason := flow.metadata.pop(UNSCANNED_KEY, None)) is not None:
            self.crosstalk.log_unscanned(flow, reason)
        elif self.mirror is not None:
            self.mirror.error(flow)

    def start(self) -> None:
        """Start the child in the background: mitmproxy listens before ``running``, and
        the addons after this one (tlsconfig's certificate store) initialise only once
        that hook returns. Awaited there, the child's seconds of start-up met early
        requests with those addons unready, and mitmdump exits on any error logged
        before ``running`` returns."""
        if self.detector is None:
            self._starting = asyncio.get_running_loop().create_task(self._start())

    async def started(self) -> None:
        """Once the detector process's start has ended (ready or failed); at once when
        none is starting."""
        if self._starting is not None and not self._starting.done():
            await asyncio.shield(self._starting)

    def reload(self) -> None:
        """The child reads its configuration again on the proxy's "reload" frame."""
        if self.detector is not None:
            self.detector.send("reload", 0, None, time.monotonic())

    def stop(self) -> None:
        """Close the child (a reconfiguration, a replacement, the proxy's end). The
        exchanges it has not logged pass on unscanned, and say so at their end."""
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()  # its ``ready`` wait would stop the proxy later
        self._let_go("the detector process was stopped before logging it")
        if self.detector is not None:
            self.detector.close()
        self.detector = self.mirror = None

    async def _start(self, *, restart: bool = False) -> None:
        """Detection in a child process: this one only copies exchanges to it. Waits
        for the child to be configured (its state, journal window or shared index
        loaded); if it cannot be at start, says why and stops the proxy, as inline mode
        would (a replacement that fails leaves detection off, logged)."""
        crosstalk = self.crosstalk
        options = {n: o.current() for n, o in ctx.options.items() if n.startswith("crosstalk_")}
        hello = {
            "key": crosstalk.config.detection.key,
            "options": options,
            "upstreams": reverse_upstreams(),
        }
        self.detector = DetectorProcess(
            hello, nice=crosstalk.config.policy.shadow_detector_nice, on_event=self._on_event
        )
        self.detector.start()
        assert self.detector.proc is not None  # start() made the child
        self.mirror = FlowMirror(self.detector)
        log = crosstalk.log
        log.info(
            "crosstalk.configured",
            mode=crosstalk.config.proxy.mode,
            detector="process",
            pid=self.detector.proc.pid,
            nice=self.detector.nice,
        )
        started = time.monotonic()
        failure = await self.detector.ready(READY_TIMEOUT)
        if failure is None:
            seconds = round(time.monotonic() - started, 2)
            log.info("detector.ready", pid=self.detector.proc.pid, seconds=seconds)
            return
        log.error("detector.failed", reason=failure)
        if not restart:
            crosstalk.stop_at_start(f"the detector process failed: {failure}")

    def _on_event(self, event: str, detail: Any) -> None:
        log = self.crosstalk.log
        if event == "logged":
            if self.mirror is not None:
                self.mirror.logged(detail)
            return
        if event == "exited":
            self._let_go(f"the detector process {detail} before logging it")
            restart = self.crosstalk.running_now and self._restarts < MAX_RESTARTS
            then = f"replaced in {RESTART_DELAY:g} s" if restart else "detection stays off"
            log.error(
                "detector.error",
                reason=f"detector process {detail}: exchanges pass unscanned; {then}",
                action="failed_open",
            )
            if restart:
                self._restarts += 1
                asyncio.get_running_loop().call_later(RESTART_DELAY, self._replace)
        elif event == "lagging":
            log.warning(
                "detector.lagging",
                backlog_bytes=detail,
                detail="new exchanges pass unscanned until the detector catches up",
            )
        elif event == "caught_up":
            assert self.mirror is not None  # set while its detector runs (_start)
            log.info("detector.caught_up", backlog_bytes=detail, skipped=self.mirror.skipped)

    def _let_go(self, reason: str) -> None:
        """The exchanges the child will never log: those that ended are logged now as
        unscanned; the others pass on, and are logged so at their end."""
        if self.mirror is None:
            return
        for flow in self.mirror.orphans():
            flow.metadata.pop(MIRROR_KEY, None)  # a replacement would take it for another
            if flow.metadata.get(ENDED_KEY):
                self.crosstalk.log_unscanned(flow, reason)
            else:
                flow.metadata[UNSCANNED_KEY] = reason

    def _replace(self) -> None:
        """A fresh child (its engine starts from the state file or journal, if any)."""
        if not self.crosstalk.running_now or self.crosstalk.placement is not self:
            return
        self.stop()
        self._starting = asyncio.get_running_loop().create_task(self._start(restart=True))


def _decoded_body(response: http.Response, monitor: ExchangeMonitor) -> bytes | None:
    try:
        return response.get_content(strict=True)
    except ValueError as e:
        monitor.undecodable(response.headers.get("content-encoding"), e)
        return None


def _block_response(monitor: ExchangeMonitor) -> http.Response:
    """What replaces a non-streamed response that leaked (451) or could not be checked,
    failing closed (503)."""
    leak = monitor.blocked_by is not None
    return http.Response.make(
        451 if leak else 503,
        monitor.route.error_body(
            BLOCK_MESSAGE if leak else FAILED_CLOSED_MESSAGE,
            type="leak_blocked",
            code="cross_tenant_leak" if leak else "detector_failed",
        ),
        {"content-type": "application/json", "x-request-id": monitor.request_id},
    )
