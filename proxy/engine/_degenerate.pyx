# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The degenerate-output test's per-delta step, compiled (``degenerate.DegenerateDetector``,
whose Python is ``reference.DegenerateDetector``), and an exchange's watch over its
choices (``degenerate.ExchangeWatch``)."""

cimport cython
from cpython.unicode cimport (
    Py_UNICODE_ISDECIMAL, Py_UNICODE_ISDIGIT, Py_UNICODE_ISSPACE, PyUnicode_DecodeASCII,
    PyUnicode_1BYTE_KIND, PyUnicode_2BYTE_KIND, PyUnicode_KIND, PyUnicode_READ,
    PyUnicode_READ_CHAR, PyUnicode_Substring,
)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from proxy.engine._bits cimport PyUnicode_DATA, PyUnicode_GET_LENGTH

# -- degenerate output (``proxy.engine.degenerate``) -----------------------------------

cdef inline bint is_cjk_unit(Py_UCS4 c) noexcept:
    """A character that is a unit alone (``degenerate._CJK``), whitespace or not."""
    return ((0x3000 <= c <= 0x30FF) or (0x3400 <= c <= 0x4DBF) or (0x4E00 <= c <= 0x9FFF)
            or (0xAC00 <= c <= 0xD7AF) or (0xF900 <= c <= 0xFAFF) or (0xFF00 <= c <= 0xFF60))


cdef inline bint in_word(Py_UCS4 c) noexcept:
    """Part of a run unit: ``[^\\s<CJK>]`` (re's ``\\s`` is ``Py_UNICODE_ISSPACE``)."""
    return not Py_UNICODE_ISSPACE(c) and not is_cjk_unit(c)


cdef inline bint is_table_syntax(Py_UCS4 c) noexcept:
    return c == u'|' or c == u':' or c == u'+' or c == u'=' or c == u'*' or c == u'#' or c == u'-'


@cython.final
cdef class CodepointRanges:
    """Sorted, disjoint inclusive code point ranges (``degenerate._COMMON_RANGES``), for
    a membership test by binary search."""

    cdef uint32_t* lows
    cdef uint32_t* highs
    cdef Py_ssize_t n

    def __cinit__(self, ranges):
        ranges = sorted(ranges)
        self.lows = <uint32_t*>malloc(max(len(ranges), 1) * sizeof(uint32_t))
        self.highs = <uint32_t*>malloc(max(len(ranges), 1) * sizeof(uint32_t))
        if self.lows == NULL or self.highs == NULL:
            raise MemoryError()
        for i, (lo, hi) in enumerate(ranges):
            if lo > hi or (i and lo <= self.highs[i - 1]):
                raise ValueError(f"ranges must be disjoint and lo <= hi: {ranges!r}")
            self.lows[i], self.highs[i] = lo, hi
        self.n = len(ranges)

    def __dealloc__(self):
        free(self.lows)
        free(self.highs)

    cdef inline bint has(self, Py_UCS4 c) noexcept:
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.highs[mid] < c:
                lo = mid + 1
            else:
                hi = mid
        return lo < self.n and self.lows[lo] <= c


from collections import deque

cdef object REPETITION = "repetition"
cdef object MIXED_SCRIPTS = "mixed_scripts"
cdef object TOKEN_ARTIFACTS = "token_artifacts"
cdef object REPLACEMENT_CHARS = "replacement_chars"


cdef class DegenerateFeed:
    """``degenerate.DegenerateDetector``'s state and its per-delta step, compiled: every
    delta of every output goes through it. Units are found and judged in C; the rare
    paths call back into the module that gives them (``rare_scripts(unit)``: the scripts
    of a unit's rare characters; ``special_tokens(unit)``: how many special tokens or BPE
    markers it holds), so this module imports nothing of the engine's. The reference
    (``reference.DegenerateDetector``) is held to the same reasons at the same units."""

    cdef public object config
    cdef public object reason
    cdef public Py_ssize_t units
    cdef str pending
    cdef CodepointRanges common
    cdef object rare_scripts
    cdef object special_tokens
    cdef int max_period, loop_units, loop_repeats, window_units, rare_chars, rare_scripts_min
    cdef int artifacts_min, replacement_chars_min
    # The last ``max_period`` units, a ring: their hashes first (most units meet none).
    cdef list recent
    cdef Py_hash_t* recent_hashes
    cdef Py_ssize_t recent_count, recent_next
    cdef Py_ssize_t* runs
    cdef bint looping
    # The recent units' rare characters, while any is in sight (a rare path).
    cdef object window
    cdef Py_ssize_t window_rare
    cdef dict scripts
    cdef Py_ssize_t artifacts, replacements

    def __cinit__(self, *args, **kwargs):
        # Usable (it trips on nothing) even when ``__init__`` never ran or failed.
        self.reason, self.units, self.pending = None, 0, ""
        self.recent, self.window, self.scripts = [], deque(), {}

    def __init__(self, config, CodepointRanges common not None, rare_scripts, special_tokens):
        if config.max_period < 1:
            raise ValueError("max_period must be >= 1")
        cdef Py_hash_t* recent_hashes = <Py_hash_t*>calloc(config.max_period, sizeof(Py_hash_t))
        cdef Py_ssize_t* runs = <Py_ssize_t*>calloc(config.max_period + 1, sizeof(Py_ssize_t))
        if recent_hashes == NULL or runs == NULL:
            free(recent_hashes)
            free(runs)
            raise MemoryError()
        free(self.recent_hashes)
        free(self.runs)
        self.recent_hashes, self.runs = recent_hashes, runs
        self.config, self.reason, self.units, self.pending = config, None, 0, ""
        self.common, self.rare_scripts, self.special_tokens = common, rare_scripts, special_tokens
        self.max_period, self.loop_units = config.max_period, config.loop_units
        self.loop_repeats, self.window_units = config.loop_repeats, config.window_units
        self.rare_chars, self.rare_scripts_min = config.rare_chars, config.rare_scripts
        self.artifacts_min = config.artifacts
        self.replacement_chars_min = config.replacement_chars
        self.recent = [None] * self.max_period
        self.recent_count = self.recent_next = 0
        self.looping = False
        self.window, self.window_rare, self.scripts = deque(), 0, {}
        self.artifacts = self.replacements = 0

    def __dealloc__(self):
        free(self.recent_hashes)
        free(self.runs)

    def feed(self, str delta):
        """The next delta (any cut): the reason the first time the test trips, else
        None. A unit still open at the delta's end waits for the next one (at most 256
        characters: a longer run without a space is judged as it is)."""
        return self._feed(delta)

    cdef object _feed(self, str delta):
        if self.reason is not None or not delta:
            return None
        if self.runs == NULL:
            raise RuntimeError("DegenerateFeed: __init__ did not run")
        cdef str text = self.pending + delta
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), end = n
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        while end > 0 and in_word(PyUnicode_READ(kind, data, end - 1)):
            end -= 1
        if n - end > 256:
            self.pending = ""
            return self.units_of(text, n)
        self.pending = PyUnicode_Substring(text, end, n) if end < n else ""
        return self.units_of(text, end)

    def finish(self):
        """The end of the output: the last unit is judged."""
        if self.reason is not None:
            return None
        if self.runs == NULL:
            raise RuntimeError("DegenerateFeed: __init__ did not run")
        cdef str text = self.pending
        self.pending = ""
        return self.units_of(text, PyUnicode_GET_LENGTH(text))

    cdef object units_of(self, str text, Py_ssize_t end):
        """Judge the units of ``text[:end]`` in order; stop at the first that trips."""
        cdef int kind = PyUnicode_KIND(text)
        cdef void* data = PyUnicode_DATA(text)
        cdef Py_ssize_t i = 0, start
        cdef Py_UCS4 c
        cdef object reason
        while i < end:
            c = PyUnicode_READ(kind, data, i)
            start = i
            if is_cjk_unit(c):
                i += 1
            elif Py_UNICODE_ISSPACE(c):
                i += 1
                continue
            else:
                i += 1
                while i < end and in_word(PyUnicode_READ(kind, data, i)):
                    i += 1
            self.units += 1
            reason = self.unit(text, kind, data, start, i)
            if reason is not None:
                self.reason = reason
                return reason
        return None

    cdef object unit(self, str text, int kind, void* data, Py_ssize_t start, Py_ssize_t end):
        cdef Py_ssize_t i, rare = 0, replacements = 0
        cdef Py_UCS4 c, high = 0
        cdef bint angle = False, table = True
        for i in range(start, end):
            c = PyUnicode_READ(kind, data, i)
            if c > high:
                high = c
            if c == u'<' or c == 0x0120:  # a special token's start, or BPE's "Ġ"
                angle = True
            if not is_table_syntax(c):
                table = False
            if c >= 0x80 and not self.common.has(c):
                rare += 1
                if c == 0xFFFD:
                    replacements += 1
        cdef str unit = PyUnicode_Substring(text, start, end)
        if high < 0x80:  # most units: no rare script, and only "<" may start a token
            if self.window:
                self.window_push(0, ())
        else:
            if replacements:
                self.replacements += replacements
                if self.replacements >= self.replacement_chars_min:
                    return REPLACEMENT_CHARS
            if end - start == 1 and high == 0x2581:  # SentencePiece's word marker, alone
                self.artifacts += 1
            if self.window_push(rare, self.rare_scripts(unit) if rare else ()):
                return MIXED_SCRIPTS
        if angle:
            self.artifacts += self.special_tokens(unit)
        if self.artifacts >= self.artifacts_min:
            return TOKEN_ARTIFACTS
        if table:
            return None
        return REPETITION if self.loop(unit) else None

    cdef bint loop(self, str unit) except -1:
        """Whether ``unit`` extends a run of one phrase repeated long enough."""
        cdef Py_hash_t h = hash(unit)
        cdef Py_ssize_t n = self.recent_count, period, slot, i, top = self.max_period
        cdef bint seen = False, looped = False, counting = False
        for i in range(n):
            if self.recent_hashes[i] == h and self.recent[i] == unit:
                seen = True
                break
        if seen:
            for period in range(1, top + 1):
                slot = (self.recent_next - period + top) % top
                if period <= n and self.recent_hashes[slot] == h and self.recent[slot] == unit:
                    self.runs[period] += 1
                    counting = True
                    if self.runs[period] >= max(self.loop_units, self.loop_repeats * period):
                        looped = True
                else:
                    self.runs[period] = 0
            self.looping = counting
        elif self.looping:
            memset(self.runs, 0, (top + 1) * sizeof(Py_ssize_t))
            self.looping = False
        self.recent[self.recent_next] = unit
        self.recent_hashes[self.recent_next] = h
        self.recent_next = (self.recent_next + 1) % top
        if self.recent_count < top:
            self.recent_count += 1
        return looped

    cdef bint window_push(self, Py_ssize_t rare, tuple scripts) except -1:
        """Slide the window of recent units' rare characters; whether it trips."""
        cdef dict counts = self.scripts
        self.window.append((rare, scripts))
        self.window_rare += rare
        for s in scripts:
            counts[s] = counts.get(s, 0) + 1
        if len(self.window) > self.window_units:
            old_rare, old_scripts = self.window.popleft()
            self.window_rare -= old_rare
            for s in old_scripts:
                left = counts[s] - 1
                if left:
                    counts[s] = left
                else:
                    del counts[s]
        if not self.window_rare:
            self.window.clear()  # nothing rare in sight: ASCII units need not be counted
            return False
        return self.window_rare >= self.rare_chars and len(counts) >= self.rare_scripts_min


cdef class WatchFields:
    """``degenerate.ExchangeWatch``'s state and its ``feed``, compiled: every delta of
    every stream takes it (a Python call was ~0.15 us of a replayed event's ~2 us).
    ``make()`` makes a choice's detector, a ``DegenerateFeed``; the subclass has what
    runs at a trip and at the end."""

    cdef public dict detectors
    cdef public object reason
    cdef public object on_trip
    cdef object make

    def __init__(self, on_trip, make):
        self.detectors = {}
        self.reason = None
        self.on_trip = on_trip
        self.make = make

    def feed(self, choice, str text):
        """The next delta of ``choice``'s output; ``_trip`` at the first that trips a
        test, once for the exchange."""
        if self.reason is not None:
            return
        detector = self.detectors.get(choice)
        if detector is None:
            detector = self.detectors[choice] = self.make()
        reason = (<DegenerateFeed?>detector)._feed(text)
        if reason is not None:
            self._trip(reason, choice)

