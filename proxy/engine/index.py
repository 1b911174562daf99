"""Where fingerprints live: a time-ordered index of generations, and a commonness sketch.

``FingerprintIndex`` maps a 64-bit fingerprint to the values (request slots) that
contributed it. New fingerprints go to a small *hot* dict; when it fills, it is frozen
into a sorted numpy generation (12 bytes a fingerprint) that is searched with a batched
binary search. Whole generations are dropped when they fall out of the time window or
when the fingerprint cap is reached (oldest first), so memory is bounded.

``CommonnessSketch`` is a count-min sketch of how many distinct tenants used a
fingerprint, decaying over hours: text that many tenants use (shared system prompts,
boilerplate) becomes common and stops counting as anyone's private text.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from proxy.engine import _scan, _tables

_EMPTY: tuple[int, ...] = ()
_SCALAR_BATCH = 8  # up to this many fingerprints, the sketch counts each use (see increment)
_ANY_BITS = 24  # buckets of the index-wide "maybe frozen" bitmap (2 MB)


@dataclass(slots=True)
class _Generation:
    keys: np.ndarray  # uint64, sorted
    values: np.ndarray  # uint32, aligned with keys
    newest: float  # time of the newest fingerprint in it
    bitmap: bytes = b""  # one bit per top-bits bucket: "maybe here" (16 to 32 bits a key)
    shift: int = 64
    # Where each top-bits bucket's keys start (_tables.bucket_starts; 4 to 8 keys a bucket,
    # half a byte to a byte a key): a lookup reads an entry and a few keys, not the ~17
    # of a binary search, each a cache miss.
    starts: np.ndarray | None = None
    columns: tuple = ()  # (keys, values, bitmap, shift, starts, starts' shift): what
    # _tables.FrozenGenerations reads

    def __post_init__(self) -> None:
        bits = max(16, (len(self.keys) * 16 - 1).bit_length())  # ~16 buckets a key
        self.shift = 64 - bits
        self.keys = np.ascontiguousarray(self.keys, dtype=np.uint64)
        self.values = np.ascontiguousarray(self.values, dtype=np.uint32)
        bitmap = bytearray((1 << bits) // 8)
        _tables.mark_buckets(bitmap, self.keys, self.shift)
        self.bitmap = bytes(bitmap)
        bucket_bits = max(1, (len(self.keys) // 8).bit_length())
        self.starts = np.empty((1 << bucket_bits) + 1, np.uint32)
        _tables.bucket_starts(self.keys, 64 - bucket_bits, self.starts)
        self.columns = (
            self.keys, self.values, self.bitmap, self.shift, self.starts, 64 - bucket_bits
        )  # fmt: skip


class FingerprintIndex(_scan.IndexFields):
    """Fingerprint -> values, bounded by time and by count.

    Values are small ints chosen by the caller (< 2**32). A fingerprint keeps at most
    ``max_values_per_key`` values in the hot generation (newest kept): a key used that
    often is common text, which the caller stops adding anyway.
    """

    def __init__(
        self,
        *,
        freeze_size: int = 65_536,
        max_generations: int = 8,
        max_fingerprints: int = 4_000_000,
        max_values_per_key: int = 8,
    ) -> None:
        if freeze_size < 1:  # add_many freezes once the hot table holds that many
            raise ValueError(f"freeze_size must be at least 1, not {freeze_size}")
        # _hot, _hot_more, _hot_count, _hot_newest, freeze_size, _frozen: fields of
        # _scan.IndexFields, which every delta's step reads and writes.
        super().__init__(freeze_size)
        self.max_generations = max_generations
        self.max_fingerprints = max_fingerprints
        self.max_values_per_key = max_values_per_key
        # The hot generation (_hot): a key's first value, in a compiled table of 64-bit
        # keys (_tables.HotTable), and, for the keys with several, all of them (_hot_more):
        # untracked tuples of ints, so the garbage collector tracks neither (a full
        # collection walked a dict of 100,000 entries, and young ones the tuples).
        self._generations: list[_Generation] = []  # oldest first
        # One bit per top-bits bucket of every frozen key: most fingerprints of a stream
        # are new, and one test here spares the test of each generation's own bitmap.
        self._any = bytearray(1 << (_ANY_BITS - 3))
        self.evicted = 0

    def __len__(self) -> int:
        return self._hot_count + sum(len(g.keys) for g in self._generations)

    @property
    def nbytes(self) -> int:
        """Approximate memory held: numpy buffers plus ~100 bytes per hot entry."""
        frozen = sum(
            g.keys.nbytes + g.values.nbytes + len(g.bitmap) + cast(np.ndarray, g.starts).nbytes
            for g in self._generations
        )
        return frozen + len(self._any) + 100 * self._hot_count

    def add(self, fingerprint: int, value: int, now: float) -> None:
        self.add_many((fingerprint,), value, now)

    def add_many(self, fingerprints: Iterable[int], value: int, now: float) -> None:
        """``add`` of each fingerprint with the same value (one loop: a call per
        fingerprint was a good part of the cost). A fingerprint given twice is added
        once."""
        hot = self._hot
        # Most fingerprints are new to the hot generation: added while it stays below
        # its freeze. The others (held with another value: an output restating its
        # prompt) take the loop below, which freezes it at its size, as one key at a
        # time would.
        added, rest = hot.add_fresh(
            fingerprints if type(fingerprints) is list else list(fingerprints),
            value,
            self.freeze_size - 1 - self._hot_count,
        )
        if added:
            self._hot_count += added
            self._hot_newest = now
        start = 0
        while start < len(rest):  # the keys held with another value, in C
            added, changed, start = hot.add_values(
                rest,
                start,
                value,
                self._hot_more,
                self.max_values_per_key,
                self.freeze_size - self._hot_count,
            )
            self._hot_count += added
            if changed:
                self._hot_newest = now
            if self._hot_count >= self.freeze_size:
                self._freeze()
                hot = self._hot  # the hot generation starts afresh

    def lookup(self, fingerprints: Sequence[int]) -> list[tuple[int, ...]]:
        """Values for each fingerprint, in order (empty tuple when unknown): the hot
        generation's first, then each frozen one's, oldest first."""
        result: list[tuple[int, ...]] = [_EMPTY] * len(fingerprints)
        self._hot.values_into(fingerprints, self._hot_more, result)
        frozen = self.frozen()
        if frozen is None or not fingerprints:
            return result
        fps = fingerprints if isinstance(fingerprints, list) else list(fingerprints)
        return frozen.values_into(fps, result)

    def frozen(self) -> _tables.FrozenGenerations | None:
        """The frozen generations, read in place (None while there are none); built
        again after they change. Compiled: reference.frozen_values is the Python it
        replaced."""
        if self._frozen is None and self._generations:
            columns = [g.columns for g in self._generations]
            self._frozen = _tables.FrozenGenerations(columns, self._any, 64 - _ANY_BITS)
        return self._frozen

    def __getstate__(self) -> dict:
        fields = {name: getattr(self, name) for name in _scan.IndexFields.FIELDS}
        return {**self.__dict__, **fields, "_frozen": None}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def evict(self, older_than: float) -> int:
        """Drop generations whose newest fingerprint is older than ``older_than``."""
        dropped = 0
        while self._generations and self._generations[0].newest < older_than:
            dropped += len(self._generations.pop(0).keys)
        if dropped:
            self._rebuild_any()
        if self._hot and self._hot_newest < older_than:
            dropped += self._hot_count
            self._hot.clear()
            self._hot_more.clear()
            self._hot_count = 0
        self.evicted += dropped
        return dropped

    def _freeze(self) -> None:
        """The hot table becomes a sorted generation (``HotTable.columns``, then a sort).
        Its keys are unique, so any sort will do; a key with several values gets its
        others after its first, in order: sorted stably, then merged in after it."""
        hot, more = self._hot, self._hot_more
        extras = sum(map(len, more.values())) - len(more)
        extra_keys, extra_values = np.empty(extras, np.uint64), np.empty(extras, np.uint32)
        hot.take_more(more, extra_keys, extra_values)
        keys, values = np.empty(len(hot), np.uint64), np.empty(len(hot), np.uint32)
        hot.columns(keys, values)
        _tables.sort_pairs(keys, values)
        if extras:
            order = np.argsort(extra_keys, kind="stable")
            first_keys, first_values = keys, values
            keys = np.empty(len(first_keys) + len(order), np.uint64)
            values = np.empty(len(keys), np.uint32)
            _tables.merge_sorted(
                first_keys, first_values, extra_keys[order], extra_values[order], keys, values
            )
        self._generations.append(_Generation(keys, values, self._hot_newest))
        self._hot.clear(keep_slots=True)  # it fills again: its grown slots stay
        self._hot_more = {}
        self._hot_count = 0
        self._mark_any(self._generations[-1].keys)
        self._compact()

    def _mark_any(self, keys: np.ndarray) -> None:
        self._frozen = None  # the generations changed
        _tables.mark_buckets(self._any, keys, 64 - _ANY_BITS)

    def _rebuild_any(self) -> None:
        self._frozen = None  # the generations changed
        self._any = bytearray(len(self._any))
        for gen in self._generations:
            self._mark_any(gen.keys)

    def _compact(self) -> None:
        capped = False
        while len(self) > self.max_fingerprints and self._generations:
            self.evicted += len(self._generations.pop(0).keys)
            capped = True
        if capped:
            self._rebuild_any()
        while len(self._generations) > self.max_generations:
            sizes = [
                len(a.keys) + len(b.keys)
                for a, b in zip(self._generations, self._generations[1:], strict=False)
            ]
            i = sizes.index(min(sizes))
            a, b = self._generations[i], self._generations[i + 1]
            keys = np.empty(len(a.keys) + len(b.keys), np.uint64)
            values = np.empty(len(keys), np.uint32)
            _tables.merge_sorted(a.keys, a.values, b.keys, b.values, keys, values)
            merged = _Generation(keys, values, max(a.newest, b.newest))
            self._generations[i : i + 2] = [merged]
            self._frozen = None


class CommonnessSketch:
    """Count-min sketch of distinct-tenant counts per fingerprint, halved every
    ``half_life`` seconds so that text stops being common when tenants stop using it.

    Over-estimates only: a private fingerprint may look common with probability about
    ``(load) ** depth``, which costs a little recall, never a false alarm.
    """

    _SEEDS = np.array(
        [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5],
        dtype=np.uint64,
    )

    DEPTH = 4  # rows

    def __init__(self, *, width_bits: int = 21, half_life: float = 3600.0):
        depth = self.DEPTH
        self._mask_int = (1 << width_bits) - 1
        self._width = 1 << width_bits
        self._counts = np.zeros((depth, 1 << width_bits), dtype=np.uint16)
        # Python-level view of the same memory: scalar reads without numpy overhead.
        self._flat = memoryview(self._counts).cast("B").cast("H")
        self._seed_ints = [int(s) for s in self._SEEDS[:depth]]
        self.half_life = half_life
        self._last_decay: float | None = None

    @property
    def nbytes(self) -> int:
        return self._counts.nbytes

    def __getstate__(self) -> dict:
        state = {name: getattr(self, name) for name in self.__dict__ if name != "_flat"}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._flat = memoryview(self._counts).cast("B").cast("H")

    @property
    def counts_array(self) -> np.ndarray:
        return self._counts

    def merge(self, counts: np.ndarray) -> None:
        """Take the larger of each counter (a sketch saved by the same configuration)."""
        if counts.shape != self._counts.shape:
            raise ValueError(f"sketch shape {counts.shape} != {self._counts.shape}")
        np.maximum(self._counts, counts, out=self._counts)  # in place: _flat stays valid

    def counts(self, fingerprints: Sequence[int]) -> list[int]:
        """Estimated distinct-tenant count of each fingerprint (compiled:
        ``reference.sketch_counts`` is the Python it replaced)."""
        return _tables.sketch_counts(
            self._flat,
            tuple(self._seed_ints),
            self._mask_int,
            self._width,
            fingerprints if isinstance(fingerprints, list) else list(fingerprints),
        )

    def increment(self, fingerprints: Sequence[int], now: float) -> None:
        """One more tenant for each fingerprint (compiled: ``reference.sketch_increment``
        is the Python it replaced). Up to ``_SCALAR_BATCH`` of them count one after
        another; a larger batch reads its cells before it writes them, so a cell two of
        its fingerprints share counts once."""
        self._decay(now)
        if len(fingerprints) == 0:
            return
        _tables.sketch_increment(
            self._flat,
            tuple(self._seed_ints),
            self._mask_int,
            self._width,
            fingerprints,
            len(fingerprints) > _SCALAR_BATCH,
        )

    def _decay(self, now: float) -> None:
        # Halvings fall on whole multiples of the half-life (epoch time), not on times
        # counted from this engine's first event: two engines that saw the same recent
        # traffic agree, whenever each began (a partition of a replay, a restarted proxy).
        if self._last_decay is None:
            self._last_decay = now - now % self.half_life
        elif now - self._last_decay >= self.half_life:
            halvings = int((now - self._last_decay) // self.half_life)
            self._counts >>= min(halvings, 16)  # in place: _flat stays valid
            self._last_decay += halvings * self.half_life


class PairFilter:
    """Which (tenant, fingerprint) pairs were already counted: a Bloom filter in two
    generations, rotated every ``period`` seconds (a pair is remembered for one to two
    periods).

    The commonness sketch counts *distinct tenants*. Within the window the index knows
    who used a fingerprint; across its eviction, and across restarts (the sketch is
    saved), only this filter keeps one tenant repeating its own text from counting as
    several tenants.
    """

    #: How a pair's three bits are placed (``_tables.pair_first_seen``): saved with the
    #: filter, and a saved filter of another layout is not loaded (1: one step for all
    #: pairs, before 2026-12-06; 2: each pair's own step).
    LAYOUT = 2

    def __init__(self, *, bits: int = 25, period: float = 3600.0) -> None:
        self._bits = bits
        self.period = period
        self.generations = [_zeroed(1 << (bits - 3)), _zeroed(1 << (bits - 3))]
        self._started: float | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(g) for g in self.generations)

    def add_new(self, tenant_key: int, fingerprint: int, now: float) -> bool:
        """Record the pair; True if it was not already there."""
        return bool(self.first_seen(tenant_key, [fingerprint], now))

    def first_seen(
        self, tenant_key: int, fingerprints: Sequence[int], now: float
    ) -> _tables.Column:
        """Record every (tenant, fingerprint) pair; return the distinct fingerprints whose
        pair was not there yet, in order, as a ``_tables.Column`` (compiled:
        ``reference.pair_first_seen`` is the Python it replaced). ``fingerprints``: a
        sequence of ints; a Column (an output's k-grams) is read in place."""
        self._rotate(now)
        current, previous = self.generations
        return _tables.pair_first_seen(
            current,
            previous,
            tenant_key,
            fingerprints,
            64 - self._bits,
        )

    def _rotate(self, now: float) -> None:
        # Rotations fall on whole multiples of the period (as the sketch's halvings).
        if self._started is None:
            self._started = now - now % self.period
        elif now - self._started >= self.period:
            periods = int((now - self._started) // self.period)
            size = len(self.generations[0])
            kept = self.generations[0] if periods == 1 else _zeroed(size)
            self.generations = [_zeroed(size), kept]
            self._started += periods * self.period

    def load(self, generations: list[bytes]) -> None:
        """OR a saved filter's generations into this one's. Only the bytes that have a
        bit are written: a generation the saved filter never used (a state saved within
        its first period has an empty previous one) stays unwritten, out of the RSS."""
        if [len(g) for g in generations] != [len(g) for g in self.generations]:
            raise ValueError("pair filter of another size")
        for mine, theirs in zip(self.generations, generations, strict=True):
            saved = np.frombuffer(theirs, np.uint8)
            at = np.flatnonzero(saved)
            np.frombuffer(mine, np.uint8)[at] |= saved[at]


def _zeroed(size: int) -> mmap.mmap:
    """``size`` zero bytes whose pages take memory only once written: an anonymous
    private mapping (reads of an unwritten page share the zero page; a shared mapping
    would take one). A ``bytearray`` is written whole when made; the previous generation of
    a pair filter may stay unwritten for its first hour (4 MB of RSS by default)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
