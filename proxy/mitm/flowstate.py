"""What the crosstalk addons share about a flow, and how they find each other.

``CrossTalk`` keeps each exchange's :class:`~proxy.pipeline.exchange.ExchangeMonitor` in
``flow.metadata[METADATA_KEY]``; the addons loaded after it (prevention, the degenerate
signal, metrics) read it from there. They are given ``CrossTalk`` itself when they are
made (``wiring.default_addons``).
"""

from __future__ import annotations

from typing import Any

from mitmproxy import ctx, http

METADATA_KEY = "crosstalk"  # CrossTalk's ExchangeMonitor in flow.metadata
# Whether the request's tenant claims count (TenantRules.trusts), decided where the
# client connected: a detector process sees only a copy, without peer or gateway secret.
CLAIMS_TRUSTED_KEY = "crosstalk.claims_trusted"


def addon_named(name: str) -> Any:
    """The loaded addon called ``name``, or None (also before a master runs)."""
    try:
        return ctx.master.addons.get(name)
    except AttributeError:
        return None


def route_parts(route: Any) -> tuple[str, str]:
    """(api, kind) of a monitor's route (a protocols.Route, or a plain kind string)."""
    return getattr(route, "api", "openai"), getattr(route, "kind", route)


def upstream_of(flow: http.HTTPFlow) -> str:
    return f"{flow.request.host}:{flow.request.port}"
