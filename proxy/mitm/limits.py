"""Limits at the door, answered in the API's own error format (``[limits]``):

* a request body larger than ``max_request_bytes``: 413, nothing goes upstream;
* more than ``max_concurrent_exchanges`` LLM exchanges in flight: 429 with
  ``Retry-After``, so a client backs off instead of a proxy that queues without bound;
* a request body that took longer than ``max_request_seconds`` to arrive: 408;
* a connection idle for ``idle_timeout_seconds`` either way (a client gone quiet, an
  engine hung mid-stream) is closed: mitmproxy's ``tcp_timeout``, set from the config
  when the proxy starts. (Output past ``max_scanned_output_chars`` passes unscanned: the
  exchange monitor's limit.)

Only LLM calls are limited (other paths pass untouched, as always), and only where
clients connect: the detector process's copies are never refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mitmproxy import ctx, http

from proxy.config import LimitsSection
from proxy.protocols import route_for
from proxy.redaction import path_only

COUNTED_KEY = "crosstalk.limits.in_flight"
IDLE_DEFAULT = LimitsSection().idle_timeout_seconds  # also mitmproxy's tcp_timeout default

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk


class CrossTalkLimits:
    """Request size, time and concurrency limits; ``limit.exceeded`` in the event log."""

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.in_flight = 0

    def running(self) -> None:
        crosstalk = self.crosstalk
        if crosstalk.inline:
            return
        idle = crosstalk.config.limits.idle_timeout_seconds
        # The config's value, unless it is the default and the user set mitmproxy's own
        # (``--set tcp_timeout=N`` on their mitmdump): that one was meant.
        if idle != IDLE_DEFAULT or ctx.options.tcp_timeout == IDLE_DEFAULT:
            ctx.options.update(tcp_timeout=idle)

    def request(self, flow: http.HTTPFlow) -> None:
        crosstalk = self.crosstalk
        if flow.response or crosstalk.inline or not flow.live:
            return
        route = route_for(flow.request.method, flow.request.path)
        if route is None:
            return
        limits = crosstalk.config.limits
        size = len(flow.request.raw_content or b"")
        if limits.max_request_bytes and size > limits.max_request_bytes:
            self._refuse(flow, route, 413, "request_too_large",
                         f"request body of {size} bytes is over the limit of "
                         f"{limits.max_request_bytes}")  # fmt: skip
            return
        took = (flow.request.timestamp_end or 0) - flow.request.timestamp_start
        if limits.max_request_seconds and took > limits.max_request_seconds:
            self._refuse(flow, route, 408, "request_timeout",
                         f"the request body took {took:.0f} s to arrive, the limit is "
                         f"{limits.max_request_seconds:g} s")  # fmt: skip
            return
        if limits.max_concurrent_exchanges and self.in_flight >= limits.max_concurrent_exchanges:
            self._refuse(flow, route, 429, "too_many_requests",
                         f"{self.in_flight} requests in flight, the limit is "
                         f"{limits.max_concurrent_exchanges}: retry later",
                         retry_after=limits.retry_after_seconds)  # fmt: skip
            return
        self.in_flight += 1
        flow.metadata[COUNTED_KEY] = True

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        if flow.metadata.pop(COUNTED_KEY, False):
            self.in_flight -= 1

    def _refuse(
        self,
        flow: http.HTTPFlow,
        route,
        status: int,
        code: str,
        message: str,
        retry_after: int | None = None,
    ) -> None:
        headers = {"content-type": "application/json"}
        if retry_after is not None:
            headers["retry-after"] = str(retry_after)
        kind = "rate_limit_error" if status == 429 else "invalid_request_error"
        flow.response = http.Response.make(
            status, route.error_body(f"crosstalk: {message}", type=kind, code=code), headers
        )
        crosstalk = self.crosstalk
        crosstalk.log.warning(
            "limit.exceeded",
            status=status,
            code=code,
            path=path_only(flow.request.path),
            in_flight=self.in_flight,
        )
