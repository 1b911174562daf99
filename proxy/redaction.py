"""What of a failure may be said in the log, a report or evidence: crosstalk handles
other people's text, and messages of parsers, codecs and peers quote the text they were
given. An exception is its type and line (``error_text``), another's message loses its
quoted parts (``unquoted``), a path its query string (``path_only``), a URL its user
info and query (``redacted``, ``scheme_of``). It imports nothing of crosstalk's: every
layer that logs failures may use it.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import TracebackType

# A quoted value in another library's message (``'...'``, ``"..."``, ``b'...'``): a
# quote that opens after a letter or digit is an apostrophe (``can't``); one left open
# runs to the end, a trailing backslash included, so every quote that opens matches (in
# linear time).
_QUOTED = re.compile(
    r"""(?<!\w)[bBrRuU]{0,2}(?:'(?:[^'\\]|\\.)*(?:'|\\?\Z)|"(?:[^"\\]|\\.)*(?:"|\\?\Z))""", re.S
)
_PACKAGE = Path(__file__).parent  # as Python names it in code objects: not resolved
LIMIT = 200  # characters of a message from elsewhere that the log keeps


def error_text(error: BaseException) -> str:
    """``error`` for the log: its type and the file and line that raised it (and the last
    line of crosstalk's own on the way, when another library raised), never its message:
    a parser's, a codec's or the engine's message may quote the text it was given. An
    exception whose class sets ``quotes_no_text`` (messages of fixed words, numbers and
    header values) is its type and message, cut at ``LIMIT``. An exception that was never
    raised has no line: its type alone."""
    name = type(error).__name__
    if getattr(error, "quotes_no_text", False):
        return f"{name}: {error}"[:LIMIT]
    raised = ours = None
    tb = error.__traceback__
    while tb is not None:
        raised = tb
        if _in_package(tb) is not None:
            ours = tb
        tb = tb.tb_next
    if raised is None:
        return name
    where = f"{name} at {_place(raised)}"
    return where if ours is None or ours is raised else f"{where} (from {_place(ours)})"


def _in_package(tb: TracebackType) -> Path | None:
    """A traceback entry's file within the package, or None when it is not ours. The
    compiled modules name their sources relative to the checkout (``proxy/...pyx``)."""
    path = Path(tb.tb_frame.f_code.co_filename)
    if path.is_relative_to(_PACKAGE):
        return path.relative_to(_PACKAGE)
    if not path.is_absolute() and path.parts[:1] == ("proxy",):
        return path.relative_to("proxy")
    return None


def _place(tb: TracebackType) -> str:
    """A traceback entry's file (within the package when it is ours) and line."""
    shown = _in_package(tb) or Path(tb.tb_frame.f_code.co_filename).name
    return f"{shown}:{tb.tb_lineno}"


def unquoted(message: str, limit: int = LIMIT) -> str:
    """``message`` (another library's, or a peer's) cut at ``limit`` characters, with
    every quoted part, ``'...'``, ``"..."``, ``b'...'``, shown as ``'…'``: what is left
    says what went wrong, not what was in the text. A quote left open drops the rest.
    Quotes that are not Python's (curly ones, backticks) are left as they are, and an
    apostrophe after a letter inside a quoted value ends it early (``'Ann's pay'``
    shows ``'…'s pay'``): a message this must hold to no text at all needs
    ``error_text``."""
    return _QUOTED.sub("'…'", message[:limit])[:limit]


def path_only(path: str) -> str:
    """A request's path without its query string (which can carry a key or a token)."""
    return path.split("?", 1)[0]


def redacted(url: str) -> str:
    """``url`` without its user info and its query (redis-py reads a password from
    either). A password may hold ``@``, ``/``, ``?`` or ``#`` unescaped, so all before
    the last ``@`` goes, even when that ``@`` was in the query: more than needed (the
    host, then), never less."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    return scheme + sep + path_only(rest).split("#", 1)[0]


def scheme_of(url: str) -> str:
    """What may be said of a refused URL: its scheme, never the rest (which may hold a
    password)."""
    m = re.match(r"[A-Za-z][A-Za-z0-9+.-]{0,15}(?=://)", url)
    return f"its scheme is {m.group(0)!r}" if m else "it is not a scheme:// URL"
