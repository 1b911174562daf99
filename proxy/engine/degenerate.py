"""Degenerate output: a cheap streaming signal for the garbage corrupted KV pages produce.

An engine whose KV pages are corrupted more often emits garbage than clean foreign text
(docs/background.md, "What a leak looks like": the GLM-5 serving postmortem, SGLang #23020, vLLM #31210): a phrase
repeated in a loop, characters of rare and mixed scripts ("token soup"), or tokenizer
artifacts that a healthy detokenizer never prints. Such an answer carries no other
tenant's text, so the leak detector rightly ignores it; but a *rising rate* of it on one
upstream is the early warning that the engine's memory bookkeeping is going wrong.

:class:`DegenerateDetector` is fed one output's deltas as they stream (any cut, mid-word
included) and trips at most once, with a reason:

* ``repetition``: the last units are one phrase of 1-8 units repeated, over at least
  ``loop_units`` units and ``loop_repeats`` times (markdown table and rule syntax such as
  ``|``, ``---``, ``:--:`` does not count as a unit, so wide tables are not loops);
* ``mixed_scripts``: among the last ``window_units`` units, at least ``rare_chars``
  characters of scripts a normal answer does not use, from at least ``rare_scripts``
  different scripts (one rare script alone, e.g. an answer in Tibetan, never trips);
* ``token_artifacts``: at least ``artifacts`` special tokens or BPE markers in the text
  (``<|endoftext|>``, ``<unk>``, ``<pad>``, ``ĠĠ``, a lone ``▁``);
* ``replacement_chars``: at least ``replacement_chars`` U+FFFD characters (bytes that
  were not UTF-8: a detokenizer fed token ids from another sequence).

A unit is a CJK character or a run of other non-space characters. The step is compiled
(``_degenerate.DegenerateFeed``): units are looked at once, in C, and only units with rare
characters or a special token's first character call back into Python.

:class:`RateWindow` counts exchanges and degenerate ones per key (the upstream) over a
sliding time window, in buckets: ``rate(key)`` is what a dashboard plots.

No mitmproxy imports, no text kept beyond the last unit and a few recent units' counts.
"""

from __future__ import annotations

import re
import threading
import time
import unicodedata
from collections import deque
from dataclasses import dataclass

from proxy.engine import _degenerate

__all__ = ["REASONS", "DegenerateConfig", "DegenerateDetector", "ExchangeWatch", "RateWindow"]

REASONS = ("repetition", "mixed_scripts", "token_artifacts", "replacement_chars")


@dataclass(frozen=True, slots=True)
class DegenerateConfig:
    max_period: int = 8  # longest repeated phrase looked for, in units
    loop_units: int = 16  # a loop covers at least this many units (past its first phrase)
    loop_repeats: int = 4  # ... and repeats its phrase at least this many times
    window_units: int = 16  # recent units the script test looks at
    rare_chars: int = 8  # rare-script characters among them
    rare_scripts: int = 3  # from this many different scripts
    artifacts: int = 2  # special tokens / BPE markers in the whole output
    replacement_chars: int = 3  # U+FFFD in the whole output


# Code point ranges a normal answer uses, in any common language, code, math or emoji.
# Everything else is "rare": historic and minority scripts, private use, invisible and
# bidi controls, halfwidth katakana, mathematical alphanumerics, specials (U+FFFD).
_COMMON_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x045F),  # Latin, IPA, diacritics, Greek, basic Cyrillic
    (0x0490, 0x058F),  # Cyrillic (non-historic letters), Cyrillic supplement, Armenian
    (0x0590, 0x06FF),  # Hebrew, Arabic
    (0x0750, 0x077F),  # Arabic supplement
    (0x0900, 0x0DFF),  # Indic scripts, Sinhala
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x1000, 0x137F),  # Myanmar, Georgian, Hangul Jamo, Ethiopic
    (0x1780, 0x17FF),  # Khmer
    (0x1E00, 0x1EFF),  # Latin extended additional (Vietnamese)
    (0x2000, 0x200A),  # spaces
    (0x2010, 0x2027),  # punctuation
    (0x202F, 0x205F),  # punctuation
    (0x2070, 0x23FF),  # super/subscripts, currency, letterlike, arrows, math, technical
    (0x2460, 0x27FF),  # enclosed, box drawing, blocks, shapes, symbols, dingbats
    (0x2900, 0x2BFF),  # arrows, math, symbols
    (0x3000, 0x30FF),  # CJK punctuation, Hiragana, Katakana
    (0x3130, 0x318F),  # Hangul compatibility Jamo
    (0x3200, 0x4DBF),  # enclosed CJK, compatibility, CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFB00, 0xFEFE),  # presentation forms, variation selectors, small/vertical forms
    (0xFF00, 0xFF60),  # fullwidth forms
    (0xFFA0, 0xFFEF),  # halfwidth Hangul, fullwidth symbols
    (0x1F000, 0x1FAFF),  # emoji, pictographs, symbols
    (0x20000, 0x3134F),  # CJK extensions B-G
    (0xE0000, 0xE007F),  # tags (flag sequences)
)


def _rare_class() -> re.Pattern[str]:
    parts, start = [], 0
    for lo, hi in _COMMON_RANGES:
        if lo > start:
            parts.append(f"{re.escape(chr(start))}-{re.escape(chr(lo - 1))}")
        start = hi + 1
    parts.append(f"{re.escape(chr(start))}-{re.escape(chr(0x10FFFF))}")
    return re.compile("[" + "".join(parts) + "]")


_RARE = _rare_class()
_COMMON = _degenerate.CodepointRanges(_COMMON_RANGES)
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]{2,32}\|>|<unk>|<pad>|ĠĠ")


def _script(ch: str) -> str:
    """A rare character's script: the first word of its Unicode name (CYRILLIC, RUNIC, ...)."""
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else f"U+{ord(ch) >> 7:04X}"


def rare_scripts(unit: str) -> tuple[str, ...]:
    """The scripts of the rare characters of ``unit``, each once (any order)."""
    return tuple({_script(ch) for ch in _RARE.findall(unit)})


def special_tokens(unit: str) -> int:
    """How many special tokens or doubled BPE space markers ``unit`` holds."""
    return len(_SPECIAL.findall(unit))


class DegenerateDetector(_degenerate.DegenerateFeed):
    """One output stream's degenerate-output test; :meth:`feed` deltas, then :meth:`finish`.

    Both return the reason the first time the test trips, else None; ``reason`` keeps it,
    ``units`` counts the units judged. The step is compiled (``_degenerate.DegenerateFeed``);
    ``reference.DegenerateDetector`` is the Python it is held to.
    """

    __slots__ = ()

    def __init__(self, config: DegenerateConfig | None = None) -> None:
        super().__init__(config or DegenerateConfig(), _COMMON, rare_scripts, special_tokens)


class RateWindow:
    """Exchanges and degenerate exchanges per key over the last ``window_seconds``.

    Counts go into ``buckets`` time buckets per key; old buckets fall out as time passes,
    so ``rate`` follows the recent traffic. At most ``max_keys`` keys are tracked (the
    least recently used is forgotten). Thread-safe: the metrics endpoint reads it from
    its own thread.
    """

    def __init__(
        self, window_seconds: float = 600.0, buckets: int = 60, max_keys: int = 64
    ) -> None:
        if window_seconds <= 0 or buckets < 1:
            raise ValueError("window_seconds > 0 and buckets >= 1 needed")
        self.window_seconds = window_seconds
        self.width = window_seconds / buckets
        self.buckets = buckets
        self.max_keys = max_keys
        self._keys: dict[str, deque[list[int]]] = {}  # key -> [bucket, total, degenerate]
        self._lock = threading.Lock()

    def add(self, key: str, degenerate: bool, now: float | None = None) -> None:
        bucket = int((time.monotonic() if now is None else now) // self.width)
        with self._lock:
            slots = self._keys.pop(key, None)
            if slots is None:
                slots = deque()
                while len(self._keys) >= self.max_keys:
                    del self._keys[next(iter(self._keys))]
            self._keys[key] = slots  # most recently used last
            if slots and slots[-1][0] == bucket:
                slots[-1][1] += 1
                slots[-1][2] += degenerate
            else:
                slots.append([bucket, 1, int(degenerate)])
            self._expire(slots, bucket)

    def counts(self, now: float | None = None) -> dict[str, tuple[int, int]]:
        """``key -> (degenerate, total)`` over the window."""
        bucket = int((time.monotonic() if now is None else now) // self.width)
        with self._lock:
            out = {}
            for key, slots in self._keys.items():
                self._expire(slots, bucket)
                out[key] = (sum(s[2] for s in slots), sum(s[1] for s in slots))
            return out

    def rate(self, key: str, now: float | None = None) -> float:
        degenerate, total = self.counts(now).get(key, (0, 0))
        return degenerate / total if total else 0.0

    def _expire(self, slots: deque[list[int]], bucket: int) -> None:
        while slots and slots[0][0] <= bucket - self.buckets:
            slots.popleft()


class ExchangeWatch(_degenerate.WatchFields):
    """The degenerate tests of one exchange, one detector per choice: ``on_trip(reason,
    choice)`` is called once, for the first choice that trips (live proxy and replay).
    ``feed(choice, text)`` and the fields ``detectors``, ``reason``, ``on_trip`` are the
    compiled ``_degenerate.WatchFields``'."""

    __slots__ = ()

    def __init__(self, on_trip) -> None:
        super().__init__(on_trip, DegenerateDetector)

    def __deepcopy__(self, memo: dict) -> None:
        """Live state: never part of a copied or saved flow (mitmproxy deep-copies
        ``flow.metadata``, where the proxy keeps the watch), as ``ExchangeMonitor``."""
        return None

    def finish(self) -> None:
        if self.reason is not None:
            return
        for choice, detector in self.detectors.items():
            reason = detector.finish()
            if reason is not None:
                self._trip(reason, choice)
                return

    def _trip(self, reason: str, choice: int) -> None:
        self.reason = reason
        self.on_trip(reason, choice)
