"""The one ordered list of crosstalk's mitmproxy addons.

``addons/crosstalk.py`` (``mitmdump -s``), ``crosstalk run`` and the detector process all
load :func:`default_addons`, so the three cannot drift apart. The order matters: the
limits first (a refused request never gets a monitor), ``CrossTalk`` (it creates each
flow's monitor, which the others read), then
prevention (its stream transform runs after the scan and enforce mode's gate), the
degenerate signal, metrics and OpenTelemetry export. Each side addon is given the
``CrossTalk`` it serves: its configuration, log and counters, and ``placement.elsewhere``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.mitm.addon import CrossTalk
from proxy.mitm.degenerate_addon import CrossTalkDegenerate
from proxy.mitm.limits import CrossTalkLimits
from proxy.mitm.metrics import CrossTalkMetrics
from proxy.mitm.otel import CrossTalkOtel
from proxy.mitm.prevention_addon import CrossTalkPrevention


def default_addons(
    crosstalk: CrossTalk | None = None,
    *,
    before: Sequence[Any] = (),
    after_crosstalk: Sequence[Any] = (),
) -> list[Any]:
    """crosstalk's addons in load order. ``crosstalk`` replaces the default ``CrossTalk()``
    (the detector process passes its inline one); ``before`` go ahead of it and
    ``after_crosstalk`` straight after it, ahead of the others (``--capture``'s writer
    sees the upstream response first; its tee keeps the bodies as the engine saw them)."""
    crosstalk = crosstalk or CrossTalk()
    return [
        *before,
        CrossTalkLimits(crosstalk),
        crosstalk,
        *after_crosstalk,
        CrossTalkPrevention(crosstalk),
        CrossTalkDegenerate(crosstalk),
        CrossTalkMetrics(crosstalk),
        CrossTalkOtel(crosstalk),
    ]
