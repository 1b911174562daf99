"""Addon failures in crosstalk's own event log.

When an addon's hook raises, mitmproxy logs ``Addon error: ...`` with the traceback to
its own log (Python logging, ``mitmproxy.addonmanager``) and carries on: the flow goes
on unchanged, so crosstalk fails open. An operator who reads only crosstalk's JSON-lines
log would never know that an exchange went unscanned. This handler forwards each such
failure as an ``addon.failed`` event (counted as ``addon_errors``): the exception type,
the hook and the file and line that raised. Never the message: an exception's text may
quote a prompt or an answer.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOGGER = "mitmproxy.addonmanager"


class AddonFailures(logging.Handler):
    """Forwards mitmproxy's addon errors to ``log`` (a structlog logger)."""

    def __init__(self, log: Callable[[], Any], count: Callable[[], None]) -> None:
        super().__init__(logging.ERROR)
        self._log = log
        self._count = count

    def emit(self, record: logging.LogRecord) -> None:
        if not record.exc_info or record.exc_info[0] is None:
            return
        etype, _value, tb = record.exc_info
        frames = traceback.extract_tb(tb)
        if not frames:
            return
        hook, raised = frames[0], frames[-1]  # the addon's hook; where it raised
        self._count()
        self._log().error(
            "addon.failed",
            error=etype.__name__,
            hook=hook.name,
            addon=Path(hook.filename).name,
            where=f"{Path(raised.filename).name}:{raised.lineno}",
            action="failed_open",
        )


_installed: AddonFailures | None = None


def install(handler: AddonFailures) -> None:
    """Forward addon errors to ``handler`` (one per process: a second install replaces
    the first)."""
    global _installed
    uninstall()
    logging.getLogger(LOGGER).addHandler(handler)
    _installed = handler


def uninstall() -> None:
    global _installed
    if _installed is not None:
        logging.getLogger(LOGGER).removeHandler(_installed)
        _installed = None
