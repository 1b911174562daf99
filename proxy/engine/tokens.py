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

from proxy.engine import _scan, _text

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
_ASCII_UNIT_RE = re.compile(r"[^\W_]+", re.ASCII)
# Non-ASCII punctuation that models write in English text (curly quotes, dashes,
# ellipsis, no-break and zero-width spaces). It separates units like any punctuation,
# so turning it into a space changes no unit and lets such text take the ASCII path.
_SEPARATORS = str.maketrans(
    dict.fromkeys(
        "\u00a0\u00ab\u00bb\u00b7\u200b\u2013\u2014\u2018\u2019\u201c\u201d\u2022\u2026", " "
    )
)

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
    return unit_batch(text, offset).units()


def ascii_form(text: str) -> str | None:
    """``text`` if it is ASCII, or once common punctuation is set aside (``_SEPARATORS``,
    which changes no unit); None when other characters remain."""
    if text.isascii():
        return text
    text = text.translate(_SEPARATORS)
    return text if text.isascii() else None


def unit_texts(text: str) -> list[str]:
    """The normalised units of ``text`` without offsets: the fast path for whole texts.

    Text that is ASCII once common punctuation is set aside (most English and code) is
    lowercased and split in one pass each, in C; other text goes unit by unit.
    """
    ascii_text = ascii_form(text)
    if ascii_text is None:
        return other_unit_texts(text)
    return _ASCII_UNIT_RE.findall(ascii_text.lower())


def other_unit_texts(text: str) -> list[str]:
    """``unit_texts`` of text that ``ascii_form`` refused: unit by unit."""
    return [normalise(m.group(0)) for m in _UNIT_RE.finditer(text)]


@dataclass(slots=True)
class UnitBatch:
    """Units in columns (cheaper than one ``Unit`` object each on the hot path)."""

    texts: list[str]
    starts: list[int]
    ends: list[int]
    weights: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    def units(self) -> list[Unit]:
        return list(map(Unit, self.texts, self.starts, self.ends, self.weights))


def unit_batch(text: str, offset: int = 0) -> UnitBatch:
    """All units of ``text`` in columns, offsets shifted by ``offset``."""
    if text.isascii():
        # Compiled: ASCII lowercasing keeps offsets and no unit is a single-character
        # script, so the units are the runs of [A-Za-z0-9], one pass in C.
        texts, starts, ends = _text.ascii_units(text, offset)
        return UnitBatch(texts, starts, ends, [WORD_WEIGHT] * len(texts))
    matches = list(_UNIT_RE.finditer(text))
    texts = [normalise(m.group()) for m in matches]
    weights = [CHAR_WEIGHT if m.group(1) else WORD_WEIGHT for m in matches]
    starts = [m.start() + offset for m in matches]
    ends = [m.end() + offset for m in matches]
    return UnitBatch(texts, starts, ends, weights)


class StreamTokenizer(_scan.TokenizerState):
    """Turns a stream of deltas into units, whatever the delta boundaries.

    ``feed`` returns the units completed by a delta; a trailing word that may continue
    in the next delta is held back. ``flush`` returns it at the end of the stream.
    Offsets count characters of the concatenated deltas. The state is in
    ``_scan.TokenizerState``, whose fields the compiled delta step updates in place.
    """

    __slots__ = ()

    def feed(self, delta: str) -> UnitBatch:
        if not delta:
            return UnitBatch([], [], [], [])
        text = self._pending + delta
        base = self._pending_at
        self._consumed += len(delta)
        batch = unit_batch(text, base)
        self._pending, self._pending_at = "", self._consumed
        if batch.texts and batch.ends[-1] == self._consumed and batch.weights[-1] == WORD_WEIGHT:
            start = batch.starts.pop()
            for column in (batch.texts, batch.ends, batch.weights):
                column.pop()
            self._pending = text[start - base :]
            self._pending_at = start
        return batch

    @property
    def pending_weight(self) -> int:
        """Weight of the word held back (0 or ``WORD_WEIGHT``)."""
        return WORD_WEIGHT if self._pending else 0

    def flush(self) -> UnitBatch:
        text, base = self._pending, self._pending_at
        self._pending, self._pending_at = "", self._consumed
        return unit_batch(text, base)


def words_in(text: str) -> float:
    """Output words in ``text`` (a CJK character counts half), as the engine counts."""
    return sum(u.weight for u in units_of(text)) / WORD_WEIGHT
