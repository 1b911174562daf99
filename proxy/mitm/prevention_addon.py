"""Prevention as a mitmproxy addon: tenant-keyed ``cache_salt`` and canaries
(docs/operations.md, "Prevention"; the pure logic is :mod:`proxy.prevention`).

Added after ``CrossTalk``: it sets the tenant's ``cache_salt`` in the request body, adds
the tenant's canary to the chat system prompt (registered with the engine, its record
journaled and shared like a prompt's) and removes that canary from what the tenant
receives. CrossTalk has already read the request as the client sent it, so the engine's
view of the prompt is the client's; the stream transform runs after CrossTalk's (after
the scan and enforce mode's gate), so the detector sees what the engine sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mitmproxy import http

from proxy.mitm.flowstate import (
    METADATA_KEY,
    route_parts,
)
from proxy.prevention import CanaryStripper, cache_salt, canary_for, rewrite_request, strip_body

CANARY_KEY = "crosstalk.canary"  # the canary injected into this flow's request
STRIPPER_KEY = "crosstalk.canary_stripper"

if TYPE_CHECKING:
    from proxy.mitm.addon import CrossTalk


class CrossTalkPrevention:
    """Tenant-keyed cache_salt and canaries, per the policy of each request."""

    def __init__(self, crosstalk: CrossTalk) -> None:
        self.crosstalk = crosstalk
        self.counters: dict[str, int] = {
            "cache_salt_injected": 0,
            "cache_salt_replaced": 0,
            "canary_injected": 0,
            "canary_echoes_removed": 0,
        }
        self._engine: Any = None
        self._registered: set[str] = set()

    def request(self, flow: http.HTTPFlow) -> None:
        crosstalk = self.crosstalk
        monitor = flow.metadata.get(METADATA_KEY)
        if flow.response or monitor is None or crosstalk.log is None:
            return
        config = crosstalk.config
        policy = config.policy_for(monitor.tenant, flow.request.path)
        if not (policy.inject_cache_salt or policy.inject_canary):
            return
        api, kind = route_parts(monitor.route)
        if api != "openai":
            return  # cache_salt is a field of vLLM's and SGLang's OpenAI-compatible API
        secret = config.prevention.secret()
        salt = None
        if policy.inject_cache_salt:
            salt = cache_salt(secret, monitor.tenant, config.prevention.group_of())
        canary = canary_for(secret, monitor.tenant) if policy.inject_canary else None
        if kind != "chat":
            canary = None  # no system prompt to carry it (docs/operations.md)
        if salt is None and canary is None:
            return
        try:
            rewrite = rewrite_request(
                flow.request.get_content(strict=False) or b"", salt=salt, canary=canary
            )
        except ValueError as e:
            if not crosstalk.placement.elsewhere:
                crosstalk.log.warning(
                    "prevention.skipped", request_id=monitor.request_id, reason=str(e)[:200]
                )
            return
        flow.request.content = rewrite.body  # re-encoded if compressed; Content-Length set
        if rewrite.canary_added:
            assert canary is not None  # only a given canary is added
            self._register(crosstalk, monitor.tenant, canary)
            flow.metadata[CANARY_KEY] = canary
            # The canary is removed from the plaintext stream: no compressed answer.
            flow.request.headers["accept-encoding"] = "identity"
        if crosstalk.placement.elsewhere:
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
        crosstalk.sink(record)  # journal and replicas, like a prompt's record

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        canary = flow.metadata.get(CANARY_KEY)
        response = flow.response
        assert response is not None  # responseheaders: mitmproxy has the response
        if canary is None or "text/event-stream" not in response.headers.get("content-type", ""):
            return
        if response.headers.get("content-encoding", "identity") not in ("", "identity"):
            if self.crosstalk.placement.elsewhere:
                return
            monitor = flow.metadata.get(METADATA_KEY)
            self.crosstalk.log.warning(
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
        assert flow.response is not None  # the response hook: mitmproxy has the response
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
        if not removed or self.crosstalk.placement.elsewhere:
            return
        self.counters["canary_echoes_removed"] += removed
        monitor = flow.metadata.get(METADATA_KEY)
        self.crosstalk.log.info(
            "canary.echo_removed",
            request_id=monitor.request_id if monitor else None,
            tenant=monitor.tenant if monitor else None,
            count=removed,
        )
