"""JSON-lines event log (structlog + orjson), one object per line.

Every line has ``ts`` (ISO-8601 UTC), ``level`` and ``event``. Log per exchange and per
finding, never per chunk: the writer flushes each line under a lock on the event loop.
Events never carry raw prompt or output text unless the operator turns that on.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import IO, Any

import orjson
import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def make_logger(path: str | Path | None = None, level: str = "info") -> Any:
    """A bound logger writing JSON lines to ``path`` (appended) or stderr.

    Returns a fresh logger each call, so tests and embedded uses can log to separate
    files; structlog's global configuration is left alone.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {sorted(LEVELS)}")
    stream: IO[bytes] = open(path, "ab") if path else sys.stderr.buffer  # noqa: SIM115
    return structlog.wrap_logger(
        structlog.BytesLogger(stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.JSONRenderer(serializer=orjson.dumps),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        cache_logger_on_first_use=True,
    )
