"""Streaming text normalisation: raw output deltas in, comparable units out.

A *unit* is one word of a script written with spaces, or one character of a script
written without them (Chinese, Japanese kana, Thai, ...). Units are NFKC-normalised and
casefolded; punctuation and whitespace separate units and are otherwise dropped, so
"Q3-Roadmap," and "q3 roadmap" give the same units.

Stream deltas may cut a word anywhere, so the tokenizer holds back a word that touches
the end of what it has seen until the next delta (or ``flush``) shows where it ends.
Every unit keeps the offsets of its raw text so that findings can point at the span of
the victim's output that leaked.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# Scripts written without spaces between words: each character is a unit.
_NO_SPACE_RANGES = (
    "\u0e00-\u0e7f"  # Thai
    "\u0e80-\u0eff"  # Lao
    "\u1000-\u109f"  # Myanmar
    "\u1780-\u17ff"  # Khmer
    "\u3040-\u30ff"  # Hiragana, Katakana
    "\u3400-\u4dbf"  # CJK extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\uff66-\uff9f"  # half-width Katakana
)
_UNIT_RE = re.compile(rf"([{_NO_SPACE_RANGES}])|[^\W_{_NO_SPACE_RANGES}]+")

#: Weight of a unit in "word" terms, doubled to stay integral: a character of a script
#: without spaces carries about half a word of information.
WORD_WEIGHT = 2
CHAR_WEIGHT = 1


@dataclass(frozen=True, slots=True)
class Unit:
    """One normalised unit with the raw offsets it came from."""

    text: str
    start: int
    end: int
    weight: int


def normalise(token: str) -> str:
    """NFKC + casefold; ASCII (the common case) skips the Unicode tables."""
    if token.isascii():
        return token.lower()
    return unicodedata.normalize("NFKC", token).casefold()


def units_of(text: str, offset: int = 0) -> list[Unit]:
    """All units of a complete text (a prompt, or a finished output)."""
    return [_unit(m, offset) for m in _UNIT_RE.finditer(text)]


def unit_texts(text: str) -> list[str]:
    """The normalised units of ``text`` without offsets: the fast path for prompts."""
    return [normalise(m.group(0)) for m in _UNIT_RE.finditer(text)]


def _unit(match: re.Match[str], offset: int) -> Unit:
    weight = CHAR_WEIGHT if match.group(1) else WORD_WEIGHT
    return Unit(normalise(match.group(0)), offset + match.start(), offset + match.end(), weight)


class StreamTokenizer:
    """Turns a stream of deltas into units, whatever the delta boundaries.

    ``feed`` returns the units completed by a delta; a trailing word that may continue
    in the next delta is held back. ``flush`` returns it at the end of the stream.
    Offsets count characters of the concatenated deltas.
    """

    __slots__ = ("_pending", "_pending_at", "_consumed")

    def __init__(self) -> None:
        self._pending = ""
        self._pending_at = 0
        self._consumed = 0

    def feed(self, delta: str) -> list[Unit]:
        if not delta:
            return []
        text = self._pending + delta
        base = self._pending_at
        self._consumed += len(delta)
        units = [_unit(m, base) for m in _UNIT_RE.finditer(text)]
        self._pending, self._pending_at = "", self._consumed
        if units and units[-1].end == self._consumed and units[-1].weight == WORD_WEIGHT:
            last = units.pop()
            self._pending = text[last.start - base :]
            self._pending_at = last.start
        return units

    def flush(self) -> list[Unit]:
        text, base = self._pending, self._pending_at
        self._pending, self._pending_at = "", self._consumed
        return units_of(text, base)
