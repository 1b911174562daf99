"""The degenerate-output signal as a mitmproxy addon (docs/detection.md, "Degenerate
output"): every output delta goes to a :class:`~proxy.engine.degenerate.DegenerateDetector`;
``output.degenerate`` is logged once per exchange (never blocks) and the rate is kept per
upstream over a sliding window.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import http

from proxy.engine.degenerate import ExchangeWatch, RateWindow
from proxy.mitm.flowstate import METADATA_KEY, upstream_of

DEGENERATE_KEY = "crosstalk.degenerate"
MAX_UPSTREAM_LABELS = 64

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk


class CrossTalkDegenerate:
    """Degenerate-output signal: ``output.degenerate`` events and a rate per upstream."""

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.rates = RateWindow()
        self.counts: dict[tuple[str, str], int] = {}  # (upstream, reason) -> exchanges

    def request(self, flow: http.HTTPFlow) -> None:
        crosstalk = self.crosstalk
        monitor = flow.metadata.get(METADATA_KEY)
        if flow.response or monitor is None or crosstalk.placement.elsewhere:
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

        watch = flow.metadata[DEGENERATE_KEY] = ExchangeWatch(on_trip)
        monitor.on_delta = watch.feed  # switched off by the monitor if it ever raises

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        watch = flow.metadata.pop(DEGENERATE_KEY, None)
        monitor = flow.metadata.get(METADATA_KEY)
        if watch is not None and monitor is not None:
            monitor.when_settled(lambda: self._finish(flow, watch))

    def _finish(self, flow: http.HTTPFlow, watch: ExchangeWatch) -> None:
        try:
            watch.finish()
        except Exception:  # noqa: BLE001 -- a signal, never a reason to break an exchange
            return
        self.rates.add(upstream_of(flow), watch.reason is not None)
