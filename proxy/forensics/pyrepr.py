"""Read the Python ``repr`` text that engines write into their request logs.

SGLang logs ``GenerateReqInput(rid='...', text='...', ...)`` and a dict ``out={...}``;
vLLM logs ``prompt: '...'``, ``SamplingParams(n=1, ...)`` and ``LoRARequest(...)``. None of
it is JSON, and the field lists change with every release, so the reader must not depend
on field positions or on every value being a literal. This is a small recursive-descent
reader of the subset reprs use:

* strings (``'...'``, ``"..."``, with escapes), numbers, ``None``/``True``/``False``;
* lists, tuples, sets, dicts; calls ``Name(key=value, ...)`` and ``Name(value, ...)``
  (a dict of the keyword values; positional ones under ``"0"``, ``"1"``...);
* a bare name (``stop``) is its own text;
* anything else (``<object at 0x...>``, ``tensor([...])`` cut off...) is skipped to the
  next separator at its depth and returned as :class:`Opaque`, so one odd field never
  hides the others;
* SGLang's cut of long values at ``--log-requests-level 2``: ``'head' ... 'tail'``
  becomes :class:`Cut` (the first and the last 1,024 characters).

Never ``eval``: the text is outside input.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

# Each quoted body as a run of plain characters, then escapes each followed by their own
# run ("unrolled": the same strings as ``(?:[^'\\\n]|\\.)*``, which the regex engine
# stepped through a character at a time, 7x slower on a long prompt).
_STRING = re.compile(
    r"""[rbuRBU]{0,2}(?:'[^'\\\n]*(?:\\.[^'\\\n]*)*'|"[^"\\\n]*(?:\\.[^"\\\n]*)*")"""
)
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+|inf|nan)(?![\w.])")
_NAME = re.compile(r"[A-Za-z_][\w.]*")
# Token ids, for orjson: JSON's integers and blanks only, and at most 18 digits, which
# its 64-bit ints always hold (a longer number came back as a float; a leading zero or a
# form feed made it raise); any other list takes the reader.
_JSON_INT = r"-?(?:0|[1-9][0-9]{0,17})"
_INT_LIST = re.compile(
    rf"\[[ \t\r\n]*(?:{_JSON_INT}[ \t\r\n]*(?:,[ \t\r\n]*{_JSON_INT}[ \t\r\n]*)*)?\]"
)
_CUT = re.compile(r"\s+\.\.\.\s+")
_WS = re.compile(r"\s*")
_SPACE = " \t\r\n"
#: What ``_Reader._skip`` skips: blanks only when the first is one of ``_SPACE``.
_BLANKS = rf"(?:[{_SPACE}]\s*)?"
#: ``name=value`` in a call; ``label: value`` (labels may hold spaces) in vLLM's lines.
_LABELS = {
    "=": re.compile(r"([A-Za-z_]\w*)\s*=(?!=)\s*"),
    ":": re.compile(r"([A-Za-z_][\w ]*?)\s*:\s*"),
}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}
MAX_DEPTH = 64
_CONSTANTS = {"None": None, "True": True, "False": False}
# A whole item of the commonest kind, key, value and separator in one match: a scalar
# (a string without escapes, a decimal number, a constant) that a ``,`` or the closer
# follows, with the blanks the reader would skip (``_BLANKS``). Most of a log line's
# items are such, and the general reader spends five calls and three matches on each.
# Anything else (a cut, an escape, a nested value, another separator) does not match
# and takes the reader. A scalar's groups, in order: a string in either quote, a float,
# an int, a constant (``_SCALAR_TYPES``); the item's key comes first (a field's name;
# a dict's key in either quote).
_PLAIN_STRING = r"""'([^'\\\n]*)'|"([^"\\\n]*)["]"""  # its text is its body
_SCALAR = rf"(?:{_PLAIN_STRING}|(-?\d+\.\d+)|(-?\d+)|(None|True|False)){_BLANKS}"
_SCALAR_TYPES = (str, str, float, int, _CONSTANTS.__getitem__)
_SIMPLE_FIELD = re.compile(rf"{_LABELS['='].pattern}{_SCALAR}(?:,|(?=\)))")
_SIMPLE_ITEM = re.compile(rf"(?:{_PLAIN_STRING}){_BLANKS}:{_BLANKS}{_SCALAR}(?:,|(?=\}}))")


@dataclass(frozen=True, slots=True)
class Cut:
    """A value the log cut in the middle: its first and last parts survive."""

    head: Any
    tail: Any


@dataclass(frozen=True, slots=True)
class Opaque:
    """A value that is not a literal (kept as its raw text)."""

    text: str


class ReprError(ValueError):
    """The text is not a repr this reader understands. The message says where it stopped,
    never what it read there (a log line holds prompts; the message reaches the log)."""


def parse(text: str, start: int = 0) -> tuple[Any, int]:
    """The value that starts at ``text[start:]`` (after blanks) and where it ends."""
    return _Reader(text).value(start, 0)


def parse_fields(text: str, start: int, separator: str = "=") -> tuple[dict[str, Any], int]:
    """``key=value, key=value`` (or ``label: value`` with ``separator=":"``) from
    ``start`` until a closing bracket or the end: the values by key, and the end."""
    return _Reader(text).fields(start, separator, 0)


def text_of(value: Any) -> tuple[str | None, bool]:
    """A logged text field as ``(text, cut)``: a string as is, a :class:`Cut` as its two
    parts on either side of a line break (``cut`` True), anything else ``(None, False)``."""
    if isinstance(value, str):
        return value, False
    if isinstance(value, Cut) and isinstance(value.head, str) and isinstance(value.tail, str):
        return f"{value.head}\n...\n{value.tail}", True
    return None, False


_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|.)", re.S)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"',
                   "a": "\a", "b": "\b", "f": "\f", "v": "\v", "0": "\0", "\n": ""}  # fmt: skip


def _escape(m: re.Match[str]) -> str:
    code = m.group(1)
    if code in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[code]
    if code[0] in "xuU" and len(code) > 1:
        value = int(code[1:], 16)
    elif code[0].isdigit() and code[0] < "8":
        value = int(code, 8)
    else:
        return "\\" + code  # not an escape: Python keeps the backslash
    if value > 0x10FFFF:
        raise ReprError("an escape is out of range")
    return chr(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def string_value(literal: str) -> str:
    """A quoted string literal's text (``'it\\'s'`` -> ``it's``); a ``b''`` literal's
    text as characters. Never ``eval``; an escape Python would reject is kept as is; a
    lone surrogate (``'\\ud800'``, which no UTF-8 text can hold) becomes U+FFFD."""
    body = literal.lstrip("rbuRBU")
    raw = len(body) != len(literal) and "r" in literal[: len(literal) - len(body)].lower()
    body = body[1:-1]
    text = body if raw or "\\" not in body else _ESCAPE.sub(_escape, body)
    return _SURROGATE.sub("\ufffd", text) if "\\u" in body or "\\U" in body else text


def _scalar(m: re.Match[str], first: int) -> Any:
    """The value of a ``_SCALAR`` whose groups start at ``first``."""
    last: int = m.lastindex  # type: ignore[assignment]
    return _SCALAR_TYPES[last - first](m.group(last))


class _Reader:
    def __init__(self, text: str) -> None:
        self.s = text

    def _skip(self, i: int) -> int:
        s = self.s
        if i < len(s) and s[i] not in _SPACE:
            return i  # the usual case: no blank to skip
        return _WS.match(s, i).end()  # type: ignore[union-attr]

    def value(self, i: int, depth: int) -> tuple[Any, int]:
        if depth > MAX_DEPTH:
            raise ReprError(f"nested deeper than {MAX_DEPTH} at {i}")
        i = self._skip(i)
        value, end = self._single(i, depth)
        cut = _CUT.match(self.s, end)
        if cut and isinstance(value, str | list) and cut.end() < len(self.s):
            tail, tail_end = self._single(self._skip(cut.end()), depth)
            if type(tail) is type(value):
                return Cut(value, tail), tail_end
        return value, end

    def _single(self, i: int, depth: int) -> tuple[Any, int]:
        s = self.s
        if i >= len(s):
            raise ReprError("a value was expected at the end of the text")
        c = s[i]
        if (c in "'\"" or c in "rbuRBU") and (m := _STRING.match(s, i)):
            return string_value(m.group()), m.end()
        if c == "[" and (m := _INT_LIST.match(s, i)):
            return orjson.loads(m.group()), m.end()  # token ids: thousands at a time
        if c in "[(":
            items, end = self._sequence(i + 1, _CLOSERS[c], depth)
            return (items if c == "[" else tuple(items)), end
        if c == "{":
            return self._mapping(i + 1, depth)
        if (c.isdigit() or c in "-.in") and (m := _NUMBER.match(s, i)):
            number = m.group()
            return (float(number) if any(c in number for c in ".eEn") else int(number)), m.end()
        if m := _NAME.match(s, i):
            name, end = m.group(), m.end()
            if end < len(s) and s[end] == "(":
                return self.fields(end + 1, "=", depth + 1, positional=True)
            return _CONSTANTS.get(name, name), end
        return self._opaque(i)

    def _sequence(self, i: int, closer: str, depth: int) -> tuple[list[Any], int]:
        items: list[Any] = []
        while True:
            i = self._skip(i)
            if i < len(self.s) and self.s[i] == closer:
                return items, i + 1
            item, i = self.value(i, depth + 1)
            items.append(item)
            i = self._after_item(i, closer)

    def _mapping(self, i: int, depth: int) -> tuple[Any, int]:
        out: dict[Any, Any] = {}
        items: list[Any] = []  # a set literal
        while True:
            i = self._skip(i)
            if i < len(self.s) and self.s[i] == "}":
                return (out if out or not items else items), i + 1
            if depth < MAX_DEPTH and (m := _SIMPLE_ITEM.match(self.s, i)):
                key = m.group(1)
                out[m.group(2) if key is None else key] = _scalar(m, 3)
                i = m.end()
                continue
            key, i = self.value(i, depth + 1)
            i = self._skip(i)
            if i < len(self.s) and self.s[i] == ":":
                value, i = self.value(i + 1, depth + 1)
                out[key if isinstance(key, str | int | float | bool | None) else repr(key)] = value
            else:
                items.append(key)
            i = self._after_item(i, "}")

    def fields(
        self, i: int, separator: str, depth: int, *, positional: bool = False
    ) -> tuple[dict[str, Any], int]:
        out: dict[str, Any]
        s, out, n = self.s, {}, 0
        label = _LABELS[separator]
        while True:
            i = self._skip(i)
            if i >= len(s) and positional:
                raise ReprError("a call is not closed at the end of the text")
            if i >= len(s) or s[i] == ")":
                return out, i + 1
            if separator == "=" and depth < MAX_DEPTH and (m := _SIMPLE_FIELD.match(s, i)):
                out[m.group(1)] = _scalar(m, 2)
                i = m.end()
                continue
            m = label.match(s, i)
            if m is None and not positional:
                raise ReprError(f"a field with {separator} was expected at {i}")
            key = m.group(1) if m else str(n)
            n += m is None
            try:
                out[key], i = self.value(m.end() if m else i, depth + 1)
            except ReprError:
                out[key], i = self._opaque(m.end() if m else i)
            i = self._after_item(i, ")")

    def _after_item(self, i: int, closer: str) -> int:
        i = self._skip(i)
        if i < len(self.s) and self.s[i] == ",":
            return i + 1
        if i >= len(self.s) or self.s[i] == closer:
            return i
        raise ReprError(f"a comma or {closer} was expected at {i}")

    def _opaque(self, i: int) -> tuple[Opaque, int]:
        """Skip to the next ``,`` or closing bracket at this depth (strings skipped whole)."""
        s, start, stack = self.s, i, []
        while i < len(s):
            c = s[i]
            if c in "'\"" and (m := _STRING.match(s, i)):
                i = m.end()
                continue
            if c in "([{<":
                stack.append(c)
            elif c in ")]}>":
                if not stack:
                    break
                stack.pop()
            elif c == "," and not stack:
                break
            i += 1
        if i == start:
            raise ReprError(f"a value was expected at {i}")
        return Opaque(s[start:i]), i
