"""The event log (structlog): JSON lines (orjson) for files and pipes, readable lines
for a person at a terminal.

Every event has ``ts`` (ISO-8601 UTC), ``level`` and ``event``. Log per exchange and per
finding, never per chunk: the writer flushes each line under a lock on the event loop.
Events never carry raw prompt or output text unless the operator turns that on.
``format="auto"`` (the default) is ``console`` when the log goes to a terminal and
``json`` otherwise, so what a program reads is always JSON lines.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

import orjson
import structlog

if TYPE_CHECKING:
    from structlog.typing import Processor

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
FORMATS = ("auto", "json", "console")


def make_logger(path: str | Path | None = None, level: str = "info", fmt: str = "auto") -> Any:
    """A bound logger writing to ``path`` (appended) or stderr, as JSON lines or (``fmt``
    ``console``, or ``auto`` on a terminal) structlog's console lines.

    Returns a fresh logger each call, so tests and embedded uses can log to separate
    files; structlog's global configuration is left alone.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {sorted(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {list(FORMATS)}")
    stamp: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
    ]
    console = fmt == "console" or (fmt == "auto" and not path and sys.stderr.isatty())
    if console:
        text: TextIO = open(path, "a", encoding="utf-8") if path else sys.stderr  # noqa: SIM115
        logger: Any = structlog.WriteLogger(text)
        renderer: Any = structlog.dev.ConsoleRenderer(colors=text.isatty(), timestamp_key="ts")
    else:
        stream: BinaryIO = open(path, "ab") if path else sys.stderr.buffer  # noqa: SIM115
        logger = structlog.BytesLogger(stream)
        renderer = structlog.processors.JSONRenderer(serializer=orjson.dumps)
    return structlog.wrap_logger(
        logger,
        processors=[*stamp, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=True,
    )
