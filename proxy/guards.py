"""mitmproxy addons that run beside ``CrossTalk``: prevention and the degenerate signal.

Added after the ``CrossTalk`` addon (``crosstalk run`` and ``addons/crosstalk.py`` do),
they read its configuration, engine and per-flow ``ExchangeMonitor`` and log through
its event log:

* :class:`CrossTalkPrevention` (README "Prevention: cache_salt and canaries"): sets the
  tenant's ``cache_salt`` in the request body, adds the tenant's canary to the chat
  system prompt (registered with the engine, its record journaled and shared like a
  prompt's) and removes that canary from what the tenant receives. CrossTalk has
  already read the request as the client sent it, so the engine's view of the prompt
  is the client's; the stream transform runs after CrossTalk's (after the scan and
  enforce mode's gate), so the detector sees what the engine sent.
* :class:`CrossTalkDegenerate` (README "Degenerate output"): feeds every output delta to
  a :class:`~proxy.degenerate.DegenerateDetector`, logs ``output.degenerate`` once per
  exchange (never blocks) and keeps the rate per upstream over a sliding window.
"""

from __future__ import annotations

from typing import Any

from mitmproxy import ctx, http

from .degenerate import DegenerateDetector, RateWindow
from .prevention import CanaryStripper, cache_salt, canary_for, rewrite_request, strip_body

CROSSTALK = "crosstalk"  # the CrossTalk addon's name in mitmproxy's addon manager
METADATA_KEY = "crosstalk"  # CrossTalk's ExchangeMonitor in flow.metadata
CANARY_KEY = "crosstalk.canary"  # the canary injected into this flow's request
STRIPPER_KEY = "crosstalk.canary_stripper"
DEGENERATE_KEY = "crosstalk.degenerate"
MAX_UPSTREAM_LABELS = 64


def _crosstalk() -> Any:
    return ctx.master.addons.get(CROSSTALK)


def _route_parts(route: Any) -> tuple[str, str]:
    """(api, kind) of a monitor's route (a protocols.Route, or a plain kind string)."""
    return getattr(route, "api", "openai"), getattr(route, "kind", route)


def _copied(crosstalk: Any) -> bool:
    """Whether a detector process runs the addons on a copy of each exchange: it then
    reports their events and counts, and this process must not do so a second time."""
    return crosstalk is not None and crosstalk.detector_wanted


def upstream_of(flow: http.HTTPFlow) -> str:
    return f"{flow.request.host}:{flow.request.port}"


class CrossTalkPrevention:
    """Tenant-keyed cache_salt and canaries, per the policy of each request."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {
            "cache_salt_injected": 0,
            "cache_salt_replaced": 0,
            "canary_injected": 0,
            "canary_echoes_removed": 0,
        }
        self._engine: Any = None
        self._registered: set[str] = set()

    def request(self, flow: http.HTTPFlow) -> None:
        crosstalk = _crosstalk()
        monitor = flow.metadata.get(METADATA_KEY)
        if flow.response or monitor is None or crosstalk is None or crosstalk.log is None:
            return
        config = crosstalk.config
        policy = config.policy_for(monitor.tenant, flow.request.path)
        if not (policy.inject_cache_salt or policy.inject_canary):
            return
        api, kind = _route_parts(monitor.route)
        if api != "openai":
            return  # cache_salt is a field of vLLM's and SGLang's OpenAI-compatible API
        secret = config.prevention.secret()
        salt = None
        if policy.inject_cache_salt:
            salt = cache_salt(secret, monitor.tenant, config.prevention.group_of())
        canary = canary_for(secret, monitor.tenant) if policy.inject_canary else None
        if kind != "chat":
            canary = None  # no system prompt to carry it (README)
        if salt is None and canary is None:
            return
        try:
            rewrite = rewrite_request(
                flow.request.get_content(strict=False) or b"", salt=salt, canary=canary
            )
        except ValueError as e:
            if not _copied(crosstalk):
                crosstalk.log.warning(
                    "prevention.skipped", request_id=monitor.request_id, reason=str(e)[:200]
                )
            return
        flow.request.content = rewrite.body  # re-encoded if compressed; Content-Length set
        if rewrite.canary_added:
            self._register(crosstalk, monitor.tenant, canary)
            flow.metadata[CANARY_KEY] = canary
            # The canary is removed from the plaintext stream: no compressed answer.
            flow.request.headers["accept-encoding"] = "identity"
        if _copied(crosstalk):
            return
        if salt is not None:
            self.counters["cache_salt_injected"] += 1
        if rewrite.salt_replaced:
            self.counters["cache_salt_replaced"] += 1
            # The client's value is not logged: it may be a secret of the client's.
            crosstalk.log.warning(
                "cache_salt.replaced", request_id=monitor.request_id, tenant=monitor.tenant
            )
        if rewrite.canary_added:
            self.counters["canary_injected"] += 1

    def _register(self, crosstalk: Any, tenant: str, canary: str) -> None:
        """Once per tenant and engine: the engine knows the canary from then on (the
        detector process's engine, when there is one: it sees the request too)."""
        if crosstalk.engine is None:
            return
        if crosstalk.engine is not self._engine:
            self._engine, self._registered = crosstalk.engine, set()
        if tenant in self._registered:
            return
        self._registered.add(tenant)
        record = crosstalk.engine.register_canary(tenant, canary)
        crosstalk._sink(record)  # journal and replicas, like a prompt's record

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        canary = flow.metadata.get(CANARY_KEY)
        response = flow.response
        if canary is None or "text/event-stream" not in response.headers.get("content-type", ""):
            return
        if response.headers.get("content-encoding", "identity") not in ("", "identity"):
            if _copied(_crosstalk()):
                return
            monitor = flow.metadata.get(METADATA_KEY)
            _crosstalk().log.warning(
                "canary.unstripped",
                request_id=monitor.request_id if monitor else None,
                reason="compressed stream",
            )
            return
        inner = response.stream
        stripper = flow.metadata[STRIPPER_KEY] = CanaryStripper(canary)

        def stream(chunk: bytes) -> list[bytes]:
            out = inner(chunk) if callable(inner) else [chunk]
            return stripper.feed([out] if isinstance(out, bytes) else out, end=not chunk)

        response.stream = stream

    def response(self, flow: http.HTTPFlow) -> None:
        canary = flow.metadata.get(CANARY_KEY)
        if canary is None:
            return
        stripper = flow.metadata.get(STRIPPER_KEY)
        removed = stripper.removed if stripper is not None else 0
        if not flow.response.stream and 200 <= flow.response.status_code < 300:
            stripped = strip_body(flow.response.get_content(strict=False) or b"", canary)
            if stripped is not None:
                flow.response.content, removed = stripped
        self._removed(flow, removed)

    def error(self, flow: http.HTTPFlow) -> None:
        stripper = flow.metadata.get(STRIPPER_KEY)
        if stripper is not None:
            self._removed(flow, stripper.removed)

    def _removed(self, flow: http.HTTPFlow, removed: int) -> None:
        if not removed or _copied(_crosstalk()):
            return
        self.counters["canary_echoes_removed"] += removed
        monitor = flow.metadata.get(METADATA_KEY)
        _crosstalk().log.info(
            "canary.echo_removed",
            request_id=monitor.request_id if monitor else None,
            tenant=monitor.tenant if monitor else None,
            count=removed,
        )


class _Watch:
    """The degenerate tests of one exchange, one per choice."""

    __slots__ = ("detectors", "reason", "on_trip")

    def __init__(self, on_trip) -> None:
        self.detectors: dict[int, DegenerateDetector] = {}
        self.reason: str | None = None
        self.on_trip = on_trip

    def feed(self, choice: int, text: str) -> None:
        if self.reason is not None:
            return
        detector = self.detectors.get(choice)
        if detector is None:
            detector = self.detectors[choice] = DegenerateDetector()
        reason = detector.feed(text)
        if reason is not None:
            self._trip(reason, choice)

    def finish(self) -> None:
        if self.reason is not None:
            return
        for choice, detector in self.detectors.items():
            reason = detector.finish()
            if reason is not None:
                self._trip(reason, choice)
                return

    def _trip(self, reason: str, choice: int) -> None:
        self.reason = reason
        self.on_trip(reason, choice)


class CrossTalkDegenerate:
    """Degenerate-output signal: ``output.degenerate`` events and a rate per upstream."""

    def __init__(self) -> None:
        self.rates = RateWindow()
        self.counts: dict[tuple[str, str], int] = {}  # (upstream, reason) -> exchanges

    def request(self, flow: http.HTTPFlow) -> None:
        crosstalk = _crosstalk()
        monitor = flow.metadata.get(METADATA_KEY)
        if flow.response or monitor is None or crosstalk is None or _copied(crosstalk):
            return
        config = crosstalk.config.degenerate
        if not config.enabled:
            return
        if self.rates.window_seconds != config.rate_window_seconds:
            self.rates = RateWindow(config.rate_window_seconds, max_keys=MAX_UPSTREAM_LABELS)
        upstream = upstream_of(flow)

        def on_trip(reason: str, choice: int) -> None:
            if len({u for u, _ in self.counts}) >= MAX_UPSTREAM_LABELS:
                key = ("other", reason)
            else:
                key = (upstream, reason)
            self.counts[key] = self.counts.get(key, 0) + 1
            crosstalk.log.warning(
                "output.degenerate",
                request_id=monitor.request_id,
                tenant=monitor.tenant,
                reason=reason,
                upstream=upstream,
                choice=choice,
                output_chars=monitor.output_chars,
            )

        watch = flow.metadata[DEGENERATE_KEY] = _Watch(on_trip)
        monitor.on_delta = _guarded(watch.feed, monitor)

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        watch = flow.metadata.pop(DEGENERATE_KEY, None)
        monitor = flow.metadata.get(METADATA_KEY)
        if watch is not None and monitor is not None:
            monitor.when_settled(lambda: self._finish(flow, watch))

    def _finish(self, flow: http.HTTPFlow, watch: _Watch) -> None:
        try:
            watch.finish()
        except Exception:  # noqa: BLE001 -- a signal, never a reason to break an exchange
            return
        self.rates.add(upstream_of(flow), watch.reason is not None)


def _guarded(feed, monitor):
    """``feed``, switched off for the exchange at its first exception: the signal must
    never turn into a detector failure of the exchange."""

    def on_delta(choice: int, text: str) -> None:
        try:
            feed(choice, text)
        except Exception:  # noqa: BLE001
            monitor.on_delta = None

    return on_delta
