"""Keyed fingerprints of unit k-grams, and winnowing.

Every unit is hashed with BLAKE2b under a secret key (64 bits); a k-gram's fingerprint
combines the hashes of its k units in order. Keyed, so stored fingerprints cannot be
brute-forced back into words by someone without the key, and stable across processes
(Python's ``hash()`` is salted per process and would not be).

Winnowing (Schleimer, Wilkerson, Aiken 2003) keeps the minimum fingerprint of every
window of ``w`` consecutive k-grams: any shared run of ``w + k - 1`` units keeps at least
one shared fingerprint. ``w = 1`` keeps every k-gram.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterable, Sequence
from typing import cast

from proxy.engine import _core

_MASK = (1 << 64) - 1
_PRIME = 0x9E3779B97F4A7C15  # odd 64-bit multiplier: position-sensitive combining
_UNIT_CACHE_LIMIT = 200_000


def _mix64(x: int) -> int:
    """splitmix64 finaliser: spreads the combined k-gram value over all 64 bits."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class Hasher:
    """Keyed 64-bit hashes of units and k-grams. Not thread-safe (unit cache)."""

    __slots__ = ("key", "key_id", "k", "_cache", "_keyed")

    def __init__(self, key: bytes, k: int) -> None:
        if not 16 <= len(key) <= 64:
            raise ValueError("fingerprint key must be 16 to 64 bytes")
        if k < 1:
            raise ValueError("k must be >= 1")
        self.key = key
        self.k = k
        #: Identifies the key in journals and logs without revealing it.
        self.key_id = hashlib.blake2b(b"crosstalk-key-id", key=key, digest_size=6).hexdigest()
        self._cache: dict[str, int] = {}
        # The key block compressed once: a copy of this state hashes a unit for 60% of
        # the cost of a new keyed blake2b, the same digest (a word the caches miss).
        self._keyed = hashlib.blake2b(key=key, digest_size=8)

    def unit(self, text: str) -> int:
        h = self._cache.get(text)
        if h is None:
            if len(self._cache) >= _UNIT_CACHE_LIMIT:
                self._cache.clear()
            state = self._keyed.copy()
            state.update(text.encode())
            h = self._cache[text] = int.from_bytes(state.digest(), "little")
        return h

    def units(self, texts: Sequence[str]) -> list[int]:
        """``unit`` of each text: the cache answers the common words."""
        hashes = list(map(self._cache.get, texts))
        if None in hashes:  # a word not seen lately (the cache answers most)
            hashes = [self.unit(t) if h is None else h for t, h in zip(texts, hashes, strict=True)]
        return cast("list[int]", hashes)  # no None left

    def kgram(self, unit_hashes: Iterable[int]) -> int:
        h = 0
        for u in unit_hashes:
            h = (h * _PRIME + u) & _MASK
        return _mix64(h)

    def digest(self, data: bytes) -> str:
        """Keyed hex digest for evidence in logs (entities, whole texts)."""
        return hashlib.blake2b(data, key=self.key, digest_size=8).hexdigest()

    def kgrams(self, units: Sequence[str]) -> list[int]:
        """Fingerprints of every k-gram of a complete unit sequence, in order."""
        return self.kgrams_of_hashes(self.units(units))

    def kgrams_of_hashes(self, hashes: Sequence[int]) -> list[int]:
        """Fingerprints of every k-gram of a sequence of unit hashes, in order: ``kgram``
        of each window, each rolled from the one before (compiled)."""
        return _core.kgrams(hashes if isinstance(hashes, list) else list(hashes), self.k)


def winnow(fingerprints: Sequence[int], w: int) -> list[tuple[int, int]]:
    """Winnowed ``(index, fingerprint)`` pairs: the rightmost minimum of each window.

    A text shorter than one window keeps its minimum, so short texts still count.
    """
    n = len(fingerprints)
    if w <= 1 or n <= 1:
        return list(enumerate(fingerprints))
    selected: list[tuple[int, int]] = []
    window: deque[int] = deque()  # indices with increasing fingerprints
    last = -1
    for i, fp in enumerate(fingerprints):
        while window and fingerprints[window[-1]] >= fp:
            window.pop()
        window.append(i)
        if window[0] <= i - w:
            window.popleft()
        if i >= w - 1 or i == n - 1:
            m = window[0]
            if m != last:
                selected.append((m, fingerprints[m]))
                last = m
    return selected


def winnowed(fingerprints: list[int], w: int) -> list[int]:
    """The fingerprints ``winnow`` selects, without their indices; with a window of one
    (every k-gram kept) ``fingerprints`` itself, no pairs made and taken apart."""
    if w <= 1:
        return fingerprints
    return [fp for _, fp in winnow(fingerprints, w)]


class StreamWinnower:
    """Winnowing over a stream of fingerprints; same selection as ``winnow``
    for the windows it has seen (a short stream's minimum comes out in ``flush``)."""

    __slots__ = ("w", "_window", "_seen", "_last")

    def __init__(self, w: int) -> None:
        self.w = w
        self._window: deque[tuple[int, int]] = deque()
        self._seen = 0
        self._last = -1

    def push(self, index: int, fp: int) -> tuple[int, int] | None:
        if self.w <= 1:
            return (index, fp)
        window = self._window
        while window and window[-1][1] >= fp:
            window.pop()
        window.append((index, fp))
        self._seen += 1
        if window[0][0] <= index - self.w:
            window.popleft()
        if self._seen >= self.w and window[0][0] != self._last:
            self._last = window[0][0]
            return window[0]
        return None

    def flush(self) -> tuple[int, int] | None:
        if self.w > 1 and 0 < self._seen < self.w and self._window:
            self._last = self._window[0][0]
            return self._window[0]
        return None
