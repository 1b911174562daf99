"""The Python implementations that the compiled core (``proxy.engine._text``, ``_tables``, ``_entities``, ``_degenerate``)
replaced,
kept as the reference it is held to (``tests/test_core_parity.py``): never on the
detection path. Each returns exactly what the compiled function it names returns.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

import numpy as np

from proxy.engine.degenerate import _RARE, DegenerateConfig, rare_scripts, special_tokens
from proxy.engine.entities import _ASTRAL, EntityScanner, fold
from proxy.engine.fingerprint import _MASK, _PRIME, _mix64

_ASCII_UNIT_RE = re.compile(r"[^\W_]+", re.ASCII)


def ascii_units(text: str, offset: int = 0) -> tuple[list[str], list[int], list[int]]:
    """``_text.ascii_units``: the units of an ASCII text, by the regex the tokenizer used."""
    matches = list(_ASCII_UNIT_RE.finditer(text.lower()))
    return (
        [m.group() for m in matches],
        [m.start() + offset for m in matches],
        [m.end() + offset for m in matches],
    )


def kgrams(hashes: Sequence[int], k: int) -> list[int]:
    """``_text.kgrams``: ``Hasher.kgram`` of every window, one by one (the definition)."""
    out = []
    for i in range(len(hashes) - k + 1):
        h = 0
        for u in hashes[i : i + k]:
            h = (h * _PRIME + u) & _MASK
        out.append(_mix64(h))
    return out


def sketch_counts(
    flat: Sequence[int], seeds: tuple[int, ...], mask: int, width: int, fingerprints: list[int]
) -> list[int]:
    """``_tables.sketch_counts``: the smallest of each fingerprint's cells, one per row."""
    return [
        min(flat[r * width + (((fp ^ seed) * 0xFF51AFD7ED558CCD >> 29) & mask)]
            for r, seed in enumerate(seeds))
        for fp in fingerprints
    ]  # fmt: skip


def sketch_increment(
    counts: np.ndarray, seeds: tuple[int, ...], mask: int, fingerprints: list[int], together: bool
) -> None:
    """``_tables.sketch_increment`` on the sketch's 2-d counters: the scalar loop (one use
    after another) or the numpy update (cells read before written) it replaced."""
    cells = [
        [(((fp ^ seed) * 0xFF51AFD7ED558CCD) >> 29) & mask for seed in seeds] for fp in fingerprints
    ]
    if not together:
        for row_cells in cells:
            for r, cell in enumerate(row_cells):
                counts[r, cell] = min(int(counts[r, cell]) + 1, 65535)
        return
    rows = np.arange(len(seeds))[:, None]
    slots = np.array(cells, dtype=np.intp).T.reshape(len(seeds), -1)
    current = counts[rows, slots]
    counts[rows, slots] = np.minimum(current.astype(np.uint32) + 1, 65535)


def pair_first_seen(
    current: bytearray, previous: bytearray, tenant_key: int, fingerprints: list[int], shift: int
) -> list[int]:
    """``_tables.pair_first_seen``: the unrolled Python loop the pair filter ran."""
    mult, new = 0x9E3779B97F4A7C15, []
    for fp in fingerprints:
        pair = tenant_key ^ fp
        x = (pair * mult) & _MASK
        d = _mix64(pair) | 1  # the pair's own step (double hashing)
        a = x >> shift
        b = ((x + d) & _MASK) >> shift
        c = ((x + 2 * d) & _MASK) >> shift
        ai, am, bi, bm, ci, cm = a >> 3, 1 << (a & 7), b >> 3, 1 << (b & 7), c >> 3, 1 << (c & 7)
        if (current[ai] & am and current[bi] & bm and current[ci] & cm) or (
            previous[ai] & am and previous[bi] & bm and previous[ci] & cm
        ):
            continue
        current[ai] |= am
        current[bi] |= bm
        current[ci] |= cm
        new.append(fp)
    return new


def add_values(
    table: dict[int, int],
    fingerprints: list[int],
    start: int,
    value: int,
    more: dict[int, tuple[int, ...]],
    cap: int,
    room: int,
) -> tuple[int, int, int]:
    """``_tables.HotTable.add_values``: the loop ``FingerprintIndex.add_many`` ran over the
    keys held with another value (``table`` any mapping of key -> first value)."""
    added = changed = 0
    for i in range(start, len(fingerprints)):
        if added >= room:
            return added, changed, i
        fp = fingerprints[i]
        current = table.get(fp)
        if current is None:
            table[fp] = value
        elif (values := more.get(fp)) is None:
            if current == value:
                continue
            more[fp] = (current, value)
        else:
            if value in values:
                continue
            values += (value,)
            if len(values) > cap:
                values = values[1:]
                added -= 1
            more[fp] = values
        added += 1
        changed += 1
    return added, changed, len(fingerprints)


def frozen_values(
    generations: list[tuple[np.ndarray, np.ndarray, bytes, int]],
    any_bits: bytes | bytearray,
    any_shift: int,
    fingerprints: list[int],
    result: list[tuple[int, ...]],
) -> list[tuple[int, ...]]:
    """``_tables.FrozenGenerations.values_after``'s reading: each generation's values for each fingerprint appended
    to ``result``, oldest generation first (bitmaps, then a binary search)."""
    for i, fp in enumerate(fingerprints):
        bucket = fp >> any_shift
        if not any_bits[bucket >> 3] >> (bucket & 7) & 1:
            continue
        for keys, values, bitmap, shift, *_ in generations:  # the directory: a speed-up
            bucket = fp >> shift
            if not bitmap[bucket >> 3] >> (bucket & 7) & 1:
                continue
            key = np.uint64(fp)  # a bare Python int above 2**63 would convert the array
            lo = int(keys.searchsorted(key))
            if lo == len(keys) or int(keys[lo]) != fp:
                continue
            hi = int(keys.searchsorted(key, side="right"))
            result[i] = result[i] + tuple(values[lo:hi].tolist())
    return result


class FrozenGenerations:
    """``_tables.FrozenGenerations``: ``frozen_values`` over the generations it was made of."""

    def __init__(self, generations: list, any_bits: bytes | bytearray, any_shift: int) -> None:
        self.generations, self.any_bits, self.any_shift = generations, any_bits, any_shift

    def values_into(
        self, fingerprints: list[int], result: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        return frozen_values(self.generations, self.any_bits, self.any_shift, fingerprints, result)


def entity_feed(self: EntityScanner, delta: str) -> list[tuple[int, int, str]]:
    """``_entities.EntityFeed.feed``: the Python ``EntityScanner.feed`` ran, on ``self``'s state."""
    self._raw.append(delta)
    delta = fold(delta)
    if not delta.isascii():
        delta = _ASTRAL.sub("\ufffd", delta)
    if not delta:
        return []
    base = self._length
    self._text.append(delta)
    self._length += len(delta)
    candidates: list[tuple[int, str, str]] = []
    # The last characters, in which a key that ends in this delta may begin: a string
    # here (the compiled feed makes it from its text when a delta needs it).
    tail = getattr(self, "_window_tail", "")
    # The continued iterators are the reference's own state (the compiled feed searches
    # each delta's window afresh): kept on the Python object, made on its first delta.
    if getattr(self, "_generation", None) != self._index.generation:
        # Automata swapped: new iterators, primed with the tail so that an entity
        # cut by the swap is still found.
        self._generation = self._index.generation
        origin = base - len(tail)
        self._iterators = [(a.iter(tail + delta), origin) for a in self._index.automata()]
    else:
        for it, _ in self._iterators:
            it.set(delta, False)
    for it, origin in self._iterators:
        # A continued iterator counts positions over all the input it was given.
        for end, (entity_id, text) in it:
            if origin + end + 1 > base:
                candidates.append((origin + end + 1, entity_id, text))
    window = tail + delta
    if pending := self._index.pending:
        window_base = base - len(tail)
        for entity_id, key in pending:
            start = window.find(key)
            while start != -1:
                end = window_base + start + len(key)
                if end > base:
                    candidates.append((end, entity_id, key))
                start = window.find(key, start + 1)
    longest = self._index.longest
    self._window_tail = window[-(longest - 1) :] if longest > 1 else ""
    if not candidates and not self._undecided:
        return []  # most deltas: nothing to confirm
    return self._confirm(candidates, final=False)


# -- degenerate output -----------------------------------------------------------------

_CJK = "\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uff60"
_UNITS = re.compile(f"[{_CJK}]|[^\\s{_CJK}]+")
_TAIL = re.compile(f"[^\\s{_CJK}]+\\Z")  # an unfinished unit at the end of a delta
_TABLE_SYNTAX = re.compile(r"[|:+=*#-]+")  # markdown table/rule/heading syntax: no unit
_TABLE_CHARS = frozenset("|:+=*#-")  # a unit that starts with none of these is no syntax
_BPE_SPACE = "▁"  # SentencePiece's word marker, alone


class DegenerateDetector:
    """``degenerate.DegenerateDetector`` (``_degenerate.DegenerateFeed``): the same reasons at
    the same units, by regular expressions over each delta's text."""

    __slots__ = (
        "config",
        "reason",
        "units",
        "_pending",
        "_recent",
        "_runs",
        "_looping",
        "_window",
        "_window_rare",
        "_scripts",
        "_artifacts",
        "_replacements",
    )

    def __init__(self, config: DegenerateConfig | None = None) -> None:
        self.config = config or DegenerateConfig()
        self.reason: str | None = None
        self.units = 0
        self._pending = ""
        self._recent: deque[str] = deque(maxlen=self.config.max_period)
        self._runs = [0] * (self.config.max_period + 1)
        self._looping = False  # some run is counting (any(self._runs))
        self._window: deque[tuple[int, tuple[str, ...]]] = deque()
        self._window_rare = 0
        self._scripts: dict[str, int] = {}
        self._artifacts = 0
        self._replacements = 0

    def feed(self, delta: str) -> str | None:
        if self.reason is not None or not delta:
            return None
        text = self._pending + delta
        tail = _TAIL.search(text)
        if tail is not None:
            self._pending, text = tail.group(), text[: tail.start()]
        else:
            self._pending = ""
        if len(self._pending) > 256:  # no whitespace for long: judge what is there
            text, self._pending = text + self._pending, ""
        return self._units(text)

    def finish(self) -> str | None:
        if self.reason is not None:
            return None
        text, self._pending = self._pending, ""
        return self._units(text)

    # -- internals -------------------------------------------------------------------

    def _units(self, text: str) -> str | None:
        if not text:
            return None
        for unit in _UNITS.findall(text):
            self.units += 1
            reason = self._unit(unit)
            if reason is not None:
                self.reason = reason
                return reason
        return None

    def _unit(self, unit: str) -> str | None:
        config = self.config
        if unit.isascii():  # most units: no rare script, and only "<" may start a token
            if self._window:
                self._window_push(0, ())
            if "<" in unit:
                self._artifacts += special_tokens(unit)
        else:
            rare = _RARE.findall(unit)
            if rare and "\ufffd" in unit:
                self._replacements += unit.count("\ufffd")
                if self._replacements >= config.replacement_chars:
                    return "replacement_chars"
            if unit == _BPE_SPACE:
                self._artifacts += 1
            if self._window_push(len(rare), rare_scripts(unit)):
                return "mixed_scripts"
            if "<" in unit or "Ġ" in unit:
                self._artifacts += special_tokens(unit)
        if self._artifacts >= config.artifacts:
            return "token_artifacts"
        if unit[0] in _TABLE_CHARS and _TABLE_SYNTAX.fullmatch(unit):
            return None
        return "repetition" if self._loop(unit) else None

    def _loop(self, unit: str) -> bool:
        """Whether ``unit`` extends a run of one phrase repeated long enough."""
        config, recent, runs = self.config, self._recent, self._runs
        if unit not in recent:  # the common case: no period can continue
            if self._looping:
                self._runs = [0] * len(runs)
                self._looping = False
            recent.append(unit)
            return False
        n = len(recent)
        looped = counting = False
        for period in range(1, config.max_period + 1):
            if period <= n and recent[n - period] == unit:
                runs[period] += 1
                counting = True
                if runs[period] >= max(config.loop_units, config.loop_repeats * period):
                    looped = True
            else:
                runs[period] = 0
        self._looping = counting
        recent.append(unit)
        return looped

    def _window_push(self, rare: int, scripts: tuple[str, ...]) -> bool:
        """Slide the window of recent units' rare characters; whether it trips."""
        window = self._window
        window.append((rare, scripts))
        self._window_rare += rare
        for s in scripts:
            self._scripts[s] = self._scripts.get(s, 0) + 1
        if len(window) > self.config.window_units:
            old_rare, old_scripts = window.popleft()
            self._window_rare -= old_rare
            for s in old_scripts:
                left = self._scripts[s] - 1
                if left:
                    self._scripts[s] = left
                else:
                    del self._scripts[s]
        if not self._window_rare:
            window.clear()  # nothing rare in sight: ASCII units need not be counted
            return False
        return (
            self._window_rare >= self.config.rare_chars
            and len(self._scripts) >= self.config.rare_scripts
        )
