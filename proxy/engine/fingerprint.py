"""Keyed fingerprints of unit k-grams.

Every unit is hashed with BLAKE2b under a secret key (64 bits); a k-gram's fingerprint
combines the hashes of its k units in order. Keyed, so stored fingerprints cannot be
brute-forced back into words by someone without the key, and stable across processes
(Python's ``hash()`` is salted per process and would not be).

Every k-gram is kept (no winnowing): any shared run of ``k`` units shares a fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import cast

from proxy.engine import _text

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
        return _text.kgrams(hashes if isinstance(hashes, list) else list(hashes), self.k)
