# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The per-delta scan, compiled: the per-stream state every delta reads and writes in
place (``EngineClock``, ``IndexFields``, ``ScanFields``, ``TokenizerState``,
``ChoiceColumns`` and its coverage ``Run``s), and the fused step (``DeltaScanner``):
tokenizer step, unit hashes, k-grams, their classification against the index and the
commonness sketch, and the slow path for k-grams another tenant holds. The only written
copy of the scan: ``tests/test_core_parity.py`` holds its findings and the state it
leaves to golden records."""

cimport cython
from cpython.unicode cimport (
    Py_UNICODE_ISDECIMAL, Py_UNICODE_ISDIGIT, Py_UNICODE_ISSPACE, PyUnicode_DecodeASCII,
    PyUnicode_1BYTE_KIND, PyUnicode_2BYTE_KIND, PyUnicode_KIND, PyUnicode_READ,
    PyUnicode_READ_CHAR, PyUnicode_Substring,
)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from proxy.engine._bits cimport (
    AHEAD, PRIME, PyObject_GC_UnTrack, PyUnicode_DATA, PyUnicode_GET_LENGTH,
    PyUnicode_IS_ASCII, is_alnum, mix64, prefetch, sorted_has,
)
from proxy.engine._entities cimport ID_STRIDE, EntityFeed, EntityIndexFields
from proxy.engine._records cimport RequestRecord, distinct_holders, owned_by, similar_prompts
from proxy.engine._tables cimport (
    Column, FrozenGenerations, HotTable, as_column, sketch_below, sketch_cell,
    sketch_prefetch,
)
from proxy.engine._text cimport (
    append_ascii_units, ascii_word, kgram_count, list_at, list_of, next_word,
    roll_kgrams, specific_ascii_number,
)

# --- per-stream state the per-delta step reads and writes in place -----------------------


cdef class EngineClock:
    """``detector.Engine``'s sequence numbers (``tick``), as a field: every delta takes
    one."""

    cdef public long long sequence
    #: What every delta's step reads of the engine besides: its compiled step (None
    #: until built, and after the baseline corpus changes) and its entity index.
    cdef public object _delta_scanner
    cdef public EntityIndexFields entities

    def __init__(self, long long sequence):
        self.sequence = sequence

    def tick(self):
        """The next sequence number."""
        self.sequence += 1
        return self.sequence


@cython.auto_pickle(False)  # FingerprintIndex pickles its own state, these fields included
cdef class IndexFields:
    """What every delta's step reads and writes of ``index.FingerprintIndex``, as
    fields: the hot generation (a key's first value; the keys with several), its count
    and newest time, the size that freezes it, and the compiled view of the frozen
    generations (None until built, and after they change)."""

    cdef public HotTable _hot
    cdef public dict _hot_more
    cdef public Py_ssize_t _hot_count
    cdef public object _hot_newest
    cdef public Py_ssize_t freeze_size
    cdef public object _frozen

    def __init__(self, Py_ssize_t freeze_size):
        self._hot, self._hot_more = HotTable(), {}
        self._hot_count, self._hot_newest = 0, 0.0
        self.freeze_size = freeze_size
        self._frozen = None

    FIELDS = ("_hot", "_hot_more", "_hot_count", "_hot_newest", "freeze_size", "_frozen")


cdef class ScanFields:
    """What every delta's step reads of ``detector.ResponseScan``, as fields: its
    engine, its choices' states, the request's slot in the engine, the scan's clock, and
    the output's fingerprints waiting to be counted in the commonness sketch at its end;
    and ``feed``, which every delta calls (compiled: no Python frame per delta)."""

    cdef public EngineClock engine
    cdef public dict _choices
    cdef public object slot
    cdef public object _now
    cdef public Column _to_count
    cdef public str tenant
    cdef public dict _similar  # slot -> asked (nearly) the same as this one
    # The index's value for this output's k-grams, slot << 1 | 1: made once, not two
    # int operations on every delta that indexes one.
    cdef readonly uint32_t output_value

    def __init__(self, EngineClock engine not None, slot, now):
        self.engine = engine
        self._choices = {}
        self.slot = slot
        self.output_value = (slot << 1) | 1
        self._now = now
        self._to_count = Column()
        self._similar = {}

    def feed(self, str delta, choice=0, now=None):
        """Scan one output delta of ``choice``; returns the findings it completed."""
        if now is not None:
            self._now = now
        state = self._choices.get(choice)
        if state is None:
            state = self._state(choice)
        cdef EngineClock engine = self.engine
        scanner = engine._delta_scanner
        if scanner is None:
            scanner = engine.delta_scanner()
        return feed_delta(scanner, self, state, delta, choice, engine.entities, engine)


cdef class TokenizerState:
    """``tokens.StreamTokenizer``'s state, as fields the compiled step reads without an
    attribute lookup: the word held back (it may continue in the next delta), where it
    starts, and the characters consumed."""

    cdef public str _pending
    cdef public Py_ssize_t _pending_at
    cdef public Py_ssize_t _consumed

    def __init__(self):
        self._pending = ""
        self._pending_at = 0
        self._consumed = 0




@cython.final
cdef class Run:
    """Coverage of one victim choice by one foreign request's fingerprints (what
    ``ChoiceColumns.cover`` marked): the current and the best contiguous run (unit
    indexes, weight), the weight covered in all, the first unit ever covered, the
    k-grams matched and up to 64 of them (the evidence's hash), the distinct units seen
    (two are enough) and up to 8 units that may tie a foreign output to its exchange
    (``ChoiceColumns.tied`` decides, once the units around them have arrived)."""

    cdef public Py_ssize_t start, end, best, best_start, best_end, covered, first, kgrams
    cdef public list fingerprints
    cdef public set distinct_units
    cdef public set specific

    def __init__(self):
        self.start = self.end = self.first = -1
        self.best = self.best_start = self.best_end = self.covered = self.kgrams = 0
        self.fingerprints = []
        self.distinct_units = set()
        self.specific = set()


cdef class ChoiceColumns:
    """The columns of ``detector._ChoiceState`` that every delta appends to (unit hashes,
    specific numbers, weights, their running sum, offsets, the record of each feed), its
    tokenizer, entity scanner and count of private k-grams, as fields: the compiled
    steps read them without an attribute lookup. Also the coverage of the choice by
    foreign requests (``runs``: index value -> ``Run``) and what judging it reads: the
    victim's own prompt units, the engine's plain words and public numbers, the unit of
    the fictional 555 exchange, and whether the choice's last unit has arrived."""

    cdef public TokenizerState tokenizer
    cdef readonly Column hashes
    cdef readonly Column numbers
    cdef readonly Column weights
    cdef readonly Column cumulative
    cdef readonly Column starts
    cdef readonly Column ends
    cdef public long private_kgrams
    cdef public EntityFeed entities
    cdef readonly Column batches
    cdef readonly Column seqs
    cdef readonly Column foreign
    cdef public dict runs
    cdef public bint complete
    cdef public HotTable own_units  # the victim's prompt units (values unused)
    cdef public HotTable plain  # the vocabulary's plain words
    cdef public frozenset public_numbers
    cdef public object exchange_555

    def __init__(self, tokenizer, entities):
        self.tokenizer = tokenizer
        self.runs = {}
        self.complete = False
        # Columns hold no objects: out of the collector's sight (issue 16's GC target).
        self.hashes, self.numbers, self.weights = Column(), Column(), Column()
        self.cumulative, self.starts, self.ends = Column((0,)), Column(), Column()
        self.private_kgrams = 0
        self.entities = entities  # an EntityFeed, or None when entities are off
        # For the keyed record: units scanned after each feed, and its sequence number.
        self.batches, self.seqs = Column(), Column()
        # ... and the k-grams (their first units) found another tenant's text: what a
        # replica that ingests the record learns without judging owners again.
        self.foreign = Column()

    def distinct(self, Py_ssize_t i):
        """Unit ``i`` is a specific number or a word few tenants use, and not one the
        victim's own prompt holds (two tenants' code from the same template differs by
        the names each one gave it)."""
        return self._distinct(i)

    def specific(self, Py_ssize_t i, prompt_units):
        """Unit ``i`` ties a foreign output to its own exchange: a specific number (not
        one public by convention, such as a test card's digits), or a non-plain word of
        that exchange's prompt (``prompt_units``, sorted); and not a unit of the victim's
        own prompt (which explains it)."""
        cdef const uint64_t[::1] units = prompt_units
        return self._specific(i, &units[0] if units.shape[0] else NULL, units.shape[0])

    def tied(self, Py_ssize_t i):
        """A candidate of ``specific`` still stands with the units around it: a number
        next to the fictional 555 exchange (an area code, a line) is a placeholder's."""
        return self._tied(i)

    def distinctive(self, Py_ssize_t start, Py_ssize_t stop):
        """One of units ``start .. stop-1`` is ``distinct``."""
        return self._distinctive(start, stop)

    def extend_units(self, const uint64_t[::1] hashes, const uint8_t[::1] numbers,
                     const uint32_t[::1] starts, const uint32_t[::1] ends,
                     const uint8_t[::1] weights):
        """Append units given as columns (a replayed feed's: unit hashes, whether each
        is a specific number, character offsets, weights), then ``scan_added`` scans
        them. All or none: columns of different lengths raise ValueError."""
        cdef Py_ssize_t n = hashes.shape[0], i
        if not (numbers.shape[0] == starts.shape[0] == ends.shape[0] == weights.shape[0] == n):
            raise ValueError("extend_units: columns of different lengths")
        cdef Column column
        for column in (self.hashes, self.numbers, self.starts, self.ends, self.weights,
                       self.cumulative):
            column.resizable()
            if column.size + n > column.capacity:
                column.grow(column.size + n)  # all room first: no push below can fail
        cdef uint64_t total = self.cumulative.last()
        for i in range(n):
            self.hashes.push(hashes[i])
            self.numbers.push(numbers[i] != 0)
            self.starts.push(starts[i])
            self.ends.push(ends[i])
            self.weights.push(weights[i])
            total += weights[i]
            self.cumulative.push(total)

    def cover(self, source, Py_ssize_t index, Py_ssize_t k, fp, specific_to=None):
        """Mark units ``index .. index+k-1`` as matching ``source`` (an index value);
        ``specific_to``: the source's prompt units, when the source is an output."""
        self._cover(source, index, k, fp, specific_to)

    cdef bint _distinct(self, Py_ssize_t i) except -1:
        cdef uint64_t unit = self.hashes.data[i]
        if self.own_units.has(unit):
            return False
        return True if self.numbers.data[i] else not self.plain.has(unit)

    cdef bint _specific(self, Py_ssize_t i, const uint64_t* units, Py_ssize_t n) except -1:
        cdef uint64_t value = self.hashes.data[i]
        unit = value
        if self.own_units.has(unit):
            return False
        if self.numbers.data[i]:
            return unit not in self.public_numbers
        return n > 0 and sorted_has(units, n, value)

    cdef bint _tied(self, Py_ssize_t i) except -1:
        if not self.numbers.data[i]:
            return True
        cdef Py_ssize_t size = self.hashes.size, j
        if i + 1 >= size and not self.complete:
            return False  # undecided until the next unit (or the end) arrives
        if self.exchange_555 is None:
            return True
        cdef uint64_t exchange = <uint64_t>self.exchange_555
        for j in range(max(0, i - 1), min(size, i + 2)):
            if self.hashes.data[j] == exchange:
                return False
        return True

    cdef bint _distinctive(self, Py_ssize_t start, Py_ssize_t stop) except -1:
        cdef Py_ssize_t i
        for i in range(start, stop):
            if self._distinct(i):
                return True
        return False

    cdef int _cover(self, source, Py_ssize_t index, Py_ssize_t k, fp, specific_to) except -1:
        cdef Py_ssize_t last = index + k - 1, i, weight
        if index < 0 or k < 1 or last >= self.hashes.size:
            raise IndexError("ChoiceColumns.cover: units out of range")
        cdef Run run = self.runs.get(source)
        if run is None:
            run = self.runs[source] = Run()
        cdef const uint64_t* cum = self.cumulative.data
        cdef bint starts_run = run.start < 0 or index > run.end + 1
        cdef Py_ssize_t first_new = index if starts_run else max(run.end + 1, index)
        if starts_run:
            run.start = index
        if run.first < 0:
            run.first = index
        run.covered += <Py_ssize_t>cum[last + 1] - <Py_ssize_t>cum[first_new]
        run.end = max(run.end, last)
        if len(run.distinct_units) < 2:
            for i in range(first_new, last + 1):
                if self._distinct(i):
                    run.distinct_units.add(i)
        cdef const uint64_t[::1] units
        if specific_to is not None and len(run.specific) < 8:
            units = specific_to
            for i in range(first_new, last + 1):
                if self._specific(i, &units[0] if units.shape[0] else NULL, units.shape[0]):
                    run.specific.add(i)
        weight = <Py_ssize_t>cum[run.end + 1] - <Py_ssize_t>cum[run.start]
        if weight > run.best:
            run.best, run.best_start, run.best_end = weight, run.start, run.end
        run.kgrams += 1
        if len(run.fingerprints) < 64:
            run.fingerprints.append(fp)
        return 0


# --- the per-delta step, fused -----------------------------------------------------------


ctypedef struct ShortWord:
    uint64_t low, high  # the lowercased word's bytes, zero-padded to 16; 0: an empty slot
    uint64_t unit  # its unit hash


ctypedef struct WordAt:
    # A word ``_add_ascii`` found, waiting for its unit hash: where it is, and its set
    # and key in the short-word cache (``ways`` NULL: too long to be cached there).
    Py_ssize_t start, length
    bint upper
    ShortWord* ways
    uint64_t key[2]


cdef enum:
    WORDS_AHEAD = 16  # words whose short-word cache lines are asked for at once
    # k-grams of scratch (16 bytes each) kept between scans: a response longer than
    # this (a whole book in one answer) has its scratch freed once scanned.
    GRAMS_KEPT = 1 << 16


@cython.final
cdef class ShortWords:
    """The unit hashes of recent ASCII words of at most 16 characters, keyed by their
    lowercased bytes: a 2-way set-associative cache of ``2 ** bits`` slots (24 bytes
    each), a new word in the first way and the one it displaces in the second. It sits
    in front of the hasher's dict cache: a hit costs no string object, no ``lower``,
    no dict probe. A word is nonzero bytes, so its zero padding says where it ends."""

    cdef ShortWord* slots
    cdef uint64_t mask

    def __cinit__(self, int bits=16):
        if not 1 <= bits <= 24:
            raise ValueError("ShortWords: bits out of range")
        self.slots = <ShortWord*>calloc(1 << bits, sizeof(ShortWord))
        if self.slots == NULL:
            raise MemoryError()
        self.mask = ((<uint64_t>1 << bits) - 1) & ~(<uint64_t>1)

    def __dealloc__(self):
        free(self.slots)

    cdef ShortWord* way(self, const unsigned char* data, Py_ssize_t n, uint64_t* key) noexcept:
        """The set ``data[:n]`` (0 < n <= 16) belongs to, its key written to ``key[0:2]``."""
        cdef Py_ssize_t j
        cdef unsigned char c
        key[0] = key[1] = 0
        for j in range(n):
            c = data[j]
            if 65 <= c <= 90:
                c += 32
            key[j >> 3] |= <uint64_t>c << ((j & 7) * 8)
        return &self.slots[mix64(key[0] ^ mix64(key[1])) & self.mask]

    cdef inline bint get(self, const ShortWord* ways, const uint64_t* key,
                         uint64_t* unit) noexcept:
        """Whether the set ``ways`` holds ``key`` (a nonempty word's: its ``low`` is not
        0, as an empty slot's is); its unit hash written to ``unit``."""
        if ways[0].low == key[0] and ways[0].high == key[1]:
            unit[0] = ways[0].unit
            return True
        if ways[1].low == key[0] and ways[1].high == key[1]:
            unit[0] = ways[1].unit
            return True
        return False

    cdef inline void put(self, ShortWord* ways, const uint64_t* key, uint64_t unit) noexcept:
        ways[1] = ways[0]
        ways[0].low, ways[0].high, ways[0].unit = key[0], key[1], unit


@cython.final
cdef class Matched:
    """What the slow path read of some k-grams (``DeltaScanner._match``): the private
    ones not found foreign, how many were private before that, their owners where they
    have any, those whose use the sketch must count, and the runs they touched."""
    cdef set private, touched
    cdef long kept
    cdef dict holders
    cdef list unowned


@cython.final
cdef class DeltaScanner:
    """The common case of ``ResponseScan.feed``'s fragment scan in one call: the streaming
    tokenizer's step (``StreamTokenizer.feed``, on that object's own state), unit hashes
    (through the hasher's cache), the choice's columns (``_ChoiceState.add_units``), the
    new k-grams, and their classification against the index and the commonness sketch
    (``Engine._classify``). A new k-gram that is not common and has an owner other than
    this tenant's requests may be foreign: those few take the slow path (``_scan_held``,
    which reads their owners), the others are done here as ``_learn_from`` does
    them (the private k-grams indexed as this output's, the uses queued for the
    sketch). ``step`` returns the delta's findings; ``scan_added`` scans units already
    in the columns (a stream's end, a replayed feed, an ingested output). The only written copy of the scan:
    ``tests/test_core_parity.py`` holds its findings and state to golden records.

    Holds the engine's tables by reference: the sketch's counters and the hasher's cache
    change in place, the index is asked for its frozen generations on every call. The
    engine builds a new one when its baseline corpus changes."""

    cdef dict cache
    cdef ShortWords short_words
    cdef object unit
    cdef object unit_batch
    cdef object specific_number
    cdef int k
    cdef int word_weight
    cdef const unsigned short[::1] flat
    cdef uint64_t seeds[8]
    cdef Py_ssize_t depth
    cdef uint64_t mask
    cdef Py_ssize_t width
    cdef long common_tenants  # a sketch count at least this is common text
    cdef IndexFields index
    cdef HotTable baseline  # the engine's baseline k-grams (``Engine.baseline``)
    cdef const uint64_t[::1] corpus
    # What the slow path (_scan_held) reads of the engine: its window of requests, the
    # prompt units of a request no longer there, and its configuration.
    cdef dict requests
    cdef object no_units
    cdef double window_seconds
    cdef long run_threshold  # round(min_run_words * 2): weights count half-words
    cdef double plain_output_factor, plain_run_factor, plain_user_factor, plain_cover_factor
    cdef double exclusive, containment
    cdef double same_prompt_similarity
    # The newest units' k-grams, and after the classification the private ones: the
    # step's scratch, so that a delta makes no int object per k-gram (a whole response
    # made hundreds) unless the slow path needs them.
    cdef uint64_t* grams
    cdef readonly Py_ssize_t grams_capacity
    # Where, among ``grams``, the k-grams another request may hold are: the slow path's
    # share of a delta (``_scan_held``). Of ``grams_capacity`` too.
    cdef Py_ssize_t* held_at

    def __dealloc__(self):
        free(self.grams)
        free(self.held_at)

    def __init__(self, hasher, sketch, index, HotTable baseline, corpus,
                 unit_batch, specific_number, int word_weight, *, dict requests, config,
                 no_units, int short_word_bits=16):
        self.cache = hasher._cache
        self.short_words = ShortWords(short_word_bits)
        self.unit = hasher.unit
        self.k = hasher.k
        self.flat = sketch._flat
        self.depth = len(sketch._seed_ints)
        if self.depth > 8 or self.depth * sketch._width > self.flat.shape[0]:
            raise ValueError("DeltaScanner: the sketch's seeds do not fit its counters")
        for r in range(self.depth):
            self.seeds[r] = <uint64_t>sketch._seed_ints[r]
        self.mask, self.width = sketch._mask_int, sketch._width
        self.common_tenants = config.common_tenants
        self.index = index
        self.baseline = baseline
        self.corpus = corpus
        self.unit_batch, self.specific_number = unit_batch, specific_number
        self.word_weight = word_weight
        self.requests, self.no_units = requests, no_units
        self.window_seconds = config.window_seconds
        self.run_threshold = round(config.min_run_words * 2)
        self.plain_output_factor = config.plain_output_factor
        self.plain_run_factor = config.plain_run_factor
        self.plain_user_factor = config.plain_user_factor
        self.plain_cover_factor = config.plain_cover_factor
        self.exclusive, self.containment = config.exclusive, config.containment
        self.same_prompt_similarity = config.same_prompt_similarity

    def flush(self, response, ChoiceColumns columns):
        """The end of the choice's stream: its held-back word, a unit now, appended to
        the columns (``StreamTokenizer.flush``). Returns how many units the columns held
        before, for ``scan_added`` to finish."""
        cdef TokenizerState tokenizer = columns.tokenizer
        cdef str text = tokenizer._pending
        cdef Py_ssize_t base = tokenizer._pending_at, consumed = tokenizer._consumed
        cdef Py_ssize_t before = columns.hashes.size
        tokenizer._pending, tokenizer._pending_at = "", consumed
        if text:
            if PyUnicode_IS_ASCII(text):
                self._add_ascii(columns, tokenizer, text, base, consumed, True, 0)
            else:
                self._add_batch(columns, tokenizer, text, base, consumed, True)
        return before

    cpdef list scan_added(self, ScanFields response, ChoiceColumns state, choice,
                          Py_ssize_t before, bint final=False):
        """The fragment scan of the units added to the choice's columns since it held
        ``before`` of them, as the delta step scans a delta's (``_classify``); with
        ``final``, the end of the choice: candidates that waited for a next unit decide,
        and every run is judged. Returns the findings. The live scan's end, a replayed
        feed and a whole ingested output all take this path."""
        cdef Py_ssize_t first = max(0, before - self.k + 1)
        cdef Py_ssize_t n = kgram_count(state.hashes.size, first, self.k)
        if n == 0:
            if not final:
                return []
            state.complete = True
            return self._fragment_findings(response, state, choice, set(state.runs))
        if n > self.grams_capacity:
            self._grow_grams(n)
        roll_kgrams(state.hashes.data, first, n, self.k, self.grams)
        try:
            found = self._classify(response, state, choice, first, n, final)
        finally:
            if self.grams_capacity > GRAMS_KEPT:
                self._release_grams()  # one huge response's scratch is not kept
        return [] if found is None else found

    cdef list step(self, ScanFields response, ChoiceColumns columns, str delta, choice):
        if not delta:
            return None
        cdef TokenizerState tokenizer = columns.tokenizer
        cdef str pending = tokenizer._pending, text
        cdef Py_ssize_t base = tokenizer._pending_at
        cdef Py_ssize_t consumed = tokenizer._consumed + len(delta)
        cdef Py_ssize_t before = columns.hashes.size
        tokenizer._consumed = consumed
        if pending and PyUnicode_IS_ASCII(delta) and ascii_word(pending):
            # Most deltas: a held word and an ASCII delta, tokenized as one text.
            if not self._add_after(columns, tokenizer, pending, delta, base, consumed):
                return None
        else:
            text = pending + delta if pending else delta
            if PyUnicode_IS_ASCII(text):
                if not self._add_ascii(columns, tokenizer, text, base, consumed, False, 0):
                    return None
            elif not self._add_batch(columns, tokenizer, text, base, consumed, False):
                return None
        cdef Py_ssize_t first = before - self.k + 1
        if first < 0:
            first = 0
        cdef Py_ssize_t n = kgram_count(columns.hashes.size, first, self.k)
        if n == 0:
            return None
        if n > self.grams_capacity:
            self._grow_grams(n)
        roll_kgrams(columns.hashes.data, first, n, self.k, self.grams)
        return self._classify(response, columns, choice, first, n, False)

    cpdef int learn_output(self, ScanFields response, ChoiceColumns state,
                           const uint32_t[::1] foreign) except -1:
        """What a whole output in which another engine's scan found no leak teaches this
        one, without scanning it again (``ResponseScan.ingest_output``): its k-grams
        that are not common are queued for the sketch (the pair filter drops the uses
        this tenant made before), and those of them that are neither public nor
        ``foreign`` (the sorted first units of the k-grams the scanning engine found
        another tenant's text) become the output's index values. No owner is read:
        the owners a held k-gram has here differ from the scanning engine's only by the
        records in flight between them."""
        cdef Py_ssize_t n = kgram_count(state.hashes.size, 0, self.k)
        state.complete = True
        if n == 0:
            return 0
        if n > self.grams_capacity:
            self._grow_grams(n)
        roll_kgrams(state.hashes.data, 0, n, self.k, self.grams)
        cdef uint64_t* grams = self.grams
        cdef const unsigned short* flat = &self.flat[0]
        cdef Column to_count = response._to_count
        cdef HotTable hot = self.index._hot
        cdef Py_ssize_t i, kept = 0, j = 0, n_foreign = foreign.shape[0]
        cdef bint hot_held = False
        cdef uint64_t fp
        try:
            for i in range(n):
                if i + AHEAD < n:
                    prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width,
                                                grams[i + AHEAD]))
                fp = grams[i]
                if not sketch_below(flat, self.seeds, self.depth, self.mask, self.width, fp,
                                    self.common_tenants):
                    continue
                to_count.push(fp)
                while j < n_foreign and foreign[j] < i:
                    j += 1
                if (j < n_foreign and foreign[j] == i) or self._public(fp):
                    continue
                hot_held = hot_held or hot.has(fp)
                grams[kept] = fp  # in place (kept <= i)
                kept += 1
            state.private_kgrams += kept
            if hot_held:  # a key the hot table holds gains a value: add_many's loop
                self.index.add_many(list_of(grams, kept), response.output_value, response._now)
            elif kept:
                self._index_fresh(grams, kept, response.output_value, response._now)
        finally:
            if self.grams_capacity > GRAMS_KEPT:
                self._release_grams()
        return 0

    cdef void _release_grams(self) noexcept:
        free(self.grams)
        free(self.held_at)
        self.grams, self.held_at, self.grams_capacity = NULL, NULL, 0

    cdef int _grow_grams(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t capacity = max(n, 2 * self.grams_capacity, 64)
        cdef uint64_t* grams = <uint64_t*>realloc(self.grams, capacity * sizeof(uint64_t))
        if grams == NULL:
            raise MemoryError()
        self.grams = grams
        cdef Py_ssize_t* held_at = <Py_ssize_t*>realloc(self.held_at,
                                                        capacity * sizeof(Py_ssize_t))
        if held_at == NULL:
            raise MemoryError()
        self.held_at, self.grams_capacity = held_at, capacity
        return 0

    cdef Py_ssize_t _add_ascii(self, ChoiceColumns columns, TokenizerState tokenizer,
                               str text, Py_ssize_t base, Py_ssize_t consumed,
                               bint final, Py_ssize_t i) except -1:
        """The tokenizer's step on ASCII ``text`` from ``i`` (``ascii_units``'s loop), its
        units appended straight to the columns; the word that touches the end is held
        back, unless the stream has ended (``final``). Returns how many units it added.
        Words are found ``WORDS_AHEAD`` at a time and their short-word cache lines asked
        for before any is looked up: a whole response's cache misses overlap."""
        cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), start, added = 0, queued = 0
        cdef Py_ssize_t held = -1
        cdef bint upper
        cdef WordAt words[WORDS_AHEAD]
        cdef WordAt* word
        tokenizer._pending, tokenizer._pending_at = "", consumed
        while True:
            start = next_word(data, i, n, &i, &upper)
            if start == n:
                break
            if i == n and not final:  # the word touches the end so far: it may continue
                # Held back once the words before it are in: a hasher that raises on
                # one of them leaves no word held, as a word-at-a-time step would.
                held = start
                break
            word = &words[queued]
            word.start, word.length, word.upper = start, i - start, upper
            word.ways = NULL
            if word.length <= 16:
                word.ways = self.short_words.way(data + start, word.length, word.key)
                prefetch(word.ways)
            queued += 1
            if queued == WORDS_AHEAD:
                self._push_words(columns, data, words, queued, base)
                added, queued = added + queued, 0
        if queued:
            self._push_words(columns, data, words, queued, base)
        if held >= 0:
            tokenizer._pending = PyUnicode_Substring(text, held, n)
            tokenizer._pending_at = base + held
        return added + queued

    cdef int _push_words(self, ChoiceColumns columns, const unsigned char* data,
                         const WordAt* words, Py_ssize_t count, Py_ssize_t base) except -1:
        """``_push_word`` of ``count`` words of ``data`` found by ``_add_ascii``."""
        cdef Py_ssize_t j
        cdef const WordAt* word
        for j in range(count):
            word = &words[j]
            self._push_unit(
                columns,
                self._cached_unit(word.ways, word.key, data + word.start, word.length,
                                  word.upper),
                data + word.start, word.length, base + word.start)
        return 0

    cdef Py_ssize_t _add_after(self, ChoiceColumns columns, TokenizerState tokenizer,
                               str pending, str delta, Py_ssize_t base,
                               Py_ssize_t consumed) except -1:
        """``_add_ascii`` of ``pending + delta`` (``pending`` the ASCII word held back, at
        ``base``; ``delta`` ASCII) without joining the two: only the held word's characters and
        the delta's that continue it are, in a buffer when short."""
        cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(delta)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(delta), held = PyUnicode_GET_LENGTH(pending)
        cdef Py_ssize_t j = 0, length, c
        cdef unsigned char buffer[64]
        cdef const unsigned char* word
        cdef str joined = None
        cdef bint upper = False
        while j < n and is_alnum(data[j]):
            j += 1
        if j == n:  # the delta only continues the word: it may go on still
            tokenizer._pending = pending + delta
            return 0
        length = held + j
        if length <= 64:
            memcpy(buffer, PyUnicode_DATA(pending), held)
            memcpy(buffer + held, data, j)
            word = buffer
        else:
            joined = pending + PyUnicode_Substring(delta, 0, j)
            word = <const unsigned char*>PyUnicode_DATA(joined)
        for c in range(length):
            upper |= 65 <= word[c] <= 90
        self._push_word(columns, word, length, upper, base)
        return 1 + self._add_ascii(columns, tokenizer, delta, base + held, consumed, False, j)

    cdef inline int _push_word(self, ChoiceColumns columns, const unsigned char* word,
                        Py_ssize_t length, bint upper, Py_ssize_t start) except -1:
        """Append the ASCII word ``word[:length]`` at ``start`` to the columns: its unit
        hash, whether it is a specific number, its weight and offsets."""
        return self._push_unit(columns, self._ascii_unit(word, length, upper), word, length,
                               start)

    cdef inline int _push_unit(self, ChoiceColumns columns, uint64_t unit,
                               const unsigned char* word, Py_ssize_t length,
                               Py_ssize_t start) except -1:
        """``_push_word`` of a word whose unit hash is ``unit``."""
        columns.hashes.push(unit)
        columns.numbers.push(specific_ascii_number(word, length))
        columns.weights.push(self.word_weight)
        columns.cumulative.push(columns.cumulative.last() + self.word_weight)
        columns.starts.push(start)
        columns.ends.push(start + length)
        return 0

    def ascii_unit_hashes(self, str text not None):
        """``Hasher.units(unit_texts(text))`` of an ASCII text: its words
        (``ascii_units``) hashed through the short-word cache as the delta step hashes
        them, a list of ints. A whole prompt's words need no string objects."""
        if not PyUnicode_IS_ASCII(text):
            raise ValueError("ascii_unit_hashes: the text is not ASCII")
        cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0, start
        cdef bint upper
        cdef list hashes = []
        while True:
            start = next_word(data, i, n, &i, &upper)
            if start == n:
                return hashes
            hashes.append(self._ascii_unit(data + start, i - start, upper))

    cdef uint64_t _ascii_unit(self, const unsigned char* word, Py_ssize_t length,
                              bint upper) except? 0:
        """The unit hash of the ASCII word ``word[:length]`` (not empty)."""
        cdef uint64_t key[2]
        cdef ShortWord* ways = NULL
        if length <= 16:
            ways = self.short_words.way(word, length, key)
        return self._cached_unit(ways, key, word, length, upper)

    cdef uint64_t _cached_unit(self, ShortWord* ways, const uint64_t* key,
                               const unsigned char* word, Py_ssize_t length,
                               bint upper) except? 0:
        """``_ascii_unit`` of a word whose short-word set is ``ways`` with ``key`` (NULL:
        a word longer than 16 characters, not cached there)."""
        cdef uint64_t value
        if ways != NULL and self.short_words.get(ways, key, &value):
            return value
        cdef str unit = PyUnicode_DecodeASCII(<const char*>word, length, NULL)
        if upper:
            unit = unit.lower()
        h = self.cache.get(unit)
        if h is None:
            h = self.unit(unit)
        value = <uint64_t>h
        if ways != NULL:
            self.short_words.put(ways, key, value)
        return value

    cdef Py_ssize_t _add_batch(self, ChoiceColumns columns, TokenizerState tokenizer,
                               str text, Py_ssize_t base, Py_ssize_t consumed,
                               bint final) except -1:
        """The tokenizer's step on other text (``unit_batch``: words, CJK characters),
        its units appended to the columns; a word (not a CJK character) that touches the
        end is held back, unless the stream has ended (``final``). Returns how many
        units it added."""
        batch = self.unit_batch(text, base)
        cdef list texts = batch.texts, starts = batch.starts, ends = batch.ends
        cdef list weights = batch.weights
        cdef Py_ssize_t n = len(texts), i
        if not final and n and ends[n - 1] == consumed and weights[n - 1] == self.word_weight:
            start = starts.pop()
            texts.pop()
            ends.pop()
            weights.pop()
            tokenizer._pending = text[start - base:]
            tokenizer._pending_at = start
            n -= 1
        else:
            tokenizer._pending, tokenizer._pending_at = "", consumed
        cdef Column cumulative = columns.cumulative
        cdef uint64_t total = cumulative.last(), weight
        cdef str unit
        for i in range(n):
            unit = texts[i]
            h = self.cache.get(unit)
            columns.hashes.push(<uint64_t>(self.unit(unit) if h is None else h))
            columns.numbers.push(
                Py_UNICODE_ISDIGIT(PyUnicode_READ_CHAR(unit, 0)) and self.specific_number(unit)
            )
            weight = <uint64_t>weights[i]
            columns.weights.push(weight)
            total += weight
            cumulative.push(total)
            columns.starts.push(<uint64_t>starts[i])
            columns.ends.push(<uint64_t>ends[i])
        return n

    cdef list _classify(self, ScanFields response, ChoiceColumns state, choice,
                        Py_ssize_t first, Py_ssize_t n, bint final):
        """The classification of the ``n`` k-grams in ``grams``, the first at unit
        ``first``, and what the output learns from them; the findings, or None. Owned
        but common k-grams (shared system prompts, popular questions) and k-grams only
        this tenant holds (its prompt echoed, its earlier answers) are no evidence of a
        leak: handled here without reading their owners. One that
        is not common and has an owner other than this tenant's requests of the window
        may be foreign: those take the slow path (``_scan_held``). ``final``: these are
        the choice's last units (``scan_added``)."""
        cdef IndexFields index = self.index
        cdef HotTable hot = index._hot
        cdef FrozenGenerations frozen = index._frozen  # a call only after they change
        if frozen is None:
            frozen = self.index.frozen()
        cdef uint64_t* grams = self.grams
        cdef const unsigned short* flat = &self.flat[0]
        cdef uint64_t fp
        cdef Py_ssize_t i, kept = 0, held = 0
        cdef set tenant_owned = None
        for i in range(n):
            if i + AHEAD < n:  # a whole text's k-grams: its misses overlap
                hot.prefetch(grams[i + AHEAD])
                if frozen is not None:
                    frozen.prefetch(grams[i + AHEAD])
            fp = grams[i]
            if (hot.has(fp) or (frozen is not None and frozen.holds(fp))) and sketch_below(
                    flat, self.seeds, self.depth, self.mask, self.width, fp,
                    self.common_tenants):
                # Once one may be another tenant's, the slow path takes every held one
                # (it reads their owners anyway) without asking who holds it here.
                if held or not self._only_tenant_holds(response, fp):
                    self.held_at[held] = i
                    held += 1
                    continue
                if tenant_owned is None:
                    tenant_owned = set()
                tenant_owned.add(fp)
        if held:
            return self._scan_held(response, state, choice, first, n, held, tenant_owned,
                                   final)
        cdef Column to_count = response._to_count
        for i in range(n):
            if i + AHEAD < n:
                prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width, grams[i + AHEAD]))
            fp = grams[i]
            if self._private(flat, fp, tenant_owned, to_count):
                grams[kept] = fp  # the private ones, in place (kept <= i)
                kept += 1
        state.private_kgrams += kept
        if tenant_owned is not None:  # keys held already: the index adds a value
            self.index.add_many(list_of(grams, kept), response.output_value, response._now)
        elif kept:
            self._index_fresh(grams, kept, response.output_value, response._now)
        if final:
            state.complete = True
            return self._fragment_findings(response, state, choice, set(state.runs))
        return None

    cdef inline bint _private(self, const unsigned short* flat, uint64_t fp, set tenant_owned,
                              Column to_count) except -1:
        """Whether k-gram ``fp``, held by no other tenant's request, is private (not
        common, in neither the baseline nor its corpus); its use queued for the sketch
        unless common or this tenant's own (counted already)."""
        if not sketch_below(flat, self.seeds, self.depth, self.mask, self.width, fp,
                            self.common_tenants):
            return False  # common text: neither private nor to be counted again
        if tenant_owned is None or fp not in tenant_owned:
            to_count.push(fp)  # this tenant's own text is counted already
        return not self._public(fp)

    cdef inline bint _public(self, uint64_t fp) noexcept:
        """``fp`` is shared by design: in the baseline, or in its corpus."""
        cdef Py_ssize_t corpus_size = self.corpus.shape[0]
        return self.baseline.has(fp) or (
            corpus_size > 0 and sorted_has(&self.corpus[0], corpus_size, fp))

    cdef list _scan_held(self, ScanFields response, ChoiceColumns state, choice,
                         Py_ssize_t first, Py_ssize_t n, Py_ssize_t held, set tenant_owned,
                         bint final):
        """``_classify`` of a delta with ``held`` k-grams another request may hold (at
        ``held_at``): those are classified and matched against their owners
        (``_match``), the others as ``_classify`` does, and the delta is learned in its
        order. All is read before anything is written: the sketch and the index change
        only once every k-gram is classified. From the first such k-gram on, the held
        ones take the slow path; the others of the delta do not. ``final``: the
        choice's last units, after which every run is judged (a candidate waiting for
        its next unit decides)."""
        cdef uint64_t* grams = self.grams
        cdef Py_ssize_t* held_at = self.held_at
        cdef list fps = list_at(grams, held_at, held)
        cdef Matched matched = self._match(response, state, first, fps, held_at)
        # The delta in order, the held k-grams in their places: the index's order.
        cdef const unsigned short* flat = &self.flat[0]
        cdef Column to_count = response._to_count
        cdef list to_index = []
        cdef Py_ssize_t i, j = 0
        cdef long kept = matched.kept
        for i in range(n):
            if i + AHEAD < n:  # as _classify's loop: a whole response's misses overlap
                prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width, grams[i + AHEAD]))
            if j < held and held_at[j] == i:
                if fps[j] in matched.private:
                    to_index.append(fps[j])
                j += 1
            elif self._private(flat, grams[i], tenant_owned, to_count):
                to_index.append(grams[i])
                kept += 1
        state.private_kgrams += kept
        self._learn_from(response, matched.unowned, matched.holders, to_index)
        if final:
            state.complete = True
            matched.touched.update(state.runs)
        return self._fragment_findings(response, state, choice, matched.touched)

    def classify(self, dict requests, str tenant, list fps):
        """``Engine._classify``: per k-gram, whether it is still private (not common,
        held by fewer than 64 values, in neither the baseline nor its corpus) and its
        owners in the index; and the k-grams whose use by ``tenant`` the sketch must
        count (not common, and held by none of the tenant's requests in ``requests``)."""
        return self._classify_all(requests, tenant, fps)

    def classify_prompt(self, list fps, Py_ssize_t start, Py_ssize_t stop):
        """``Engine._classify_prompt``: of ``fps[start:stop]``, the private k-grams (not
        common, in neither the baseline nor its corpus) and the ones whose use the
        sketch must count (not common), in order. No owner is read: the pair filter
        drops a use its tenant counted before, and a k-gram that many requests hold is
        judged where it is met (``classify``), not where it is stored."""
        stop = min(stop, len(fps))
        cdef const unsigned short* flat = &self.flat[0]
        cdef Py_ssize_t i
        cdef uint64_t fp
        cdef list private = [], unowned = []
        for i in range(start, stop):
            if i + AHEAD < stop:
                prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width,
                                            <uint64_t>fps[i + AHEAD]))
            item = fps[i]
            fp = <uint64_t>item
            if not sketch_below(flat, self.seeds, self.depth, self.mask, self.width, fp,
                                self.common_tenants):
                continue
            unowned.append(item)
            if not self._public(fp):
                private.append(item)
        return private, unowned

    cdef tuple _classify_all(self, dict requests, str tenant, list fps):
        cdef list owners = self.index.lookup(fps), private = [], unowned = []
        cdef Py_ssize_t i, n = len(fps)
        cdef uint64_t fp
        cdef bint common
        cdef const unsigned short* flat = &self.flat[0]
        for i in range(n):
            if i + AHEAD < n:  # a prompt's k-grams: their sketch misses overlap
                prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width,
                                            <uint64_t>fps[i + AHEAD]))
            item, values = fps[i], owners[i]
            fp = <uint64_t>item
            common = not sketch_below(flat, self.seeds, self.depth, self.mask,
                                      self.width, fp, self.common_tenants)
            private.append(not common and distinct_holders(requests, values)
                           and not self._public(fp))
            if not common and not (values and owned_by(requests, tenant, values)):
                unowned.append(item)
        return private, owners, unowned

    cdef Matched _match(self, ScanFields response, ChoiceColumns state, Py_ssize_t first,
                        list fps, const Py_ssize_t* at):
        """The slow path's reading of ``fps`` (``at[i]`` the place of ``fps[i]`` among
        the new k-grams, the first at unit ``first``):
        classified, and each private one that another tenant's request holds covering
        that request's run of this choice. Writes nothing but the choice's runs."""
        cdef tuple classified = self._classify_all(self.requests, response.tenant, fps)
        cdef list is_private = classified[0], owners = classified[1]
        cdef Matched matched = Matched.__new__(Matched)
        matched.unowned, matched.private, matched.touched = classified[2], set(), set()
        matched.holders, matched.kept = {}, 0
        cdef Py_ssize_t i, n = len(fps)
        for i in range(n):
            if is_private[i]:
                matched.private.add(fps[i])
                matched.kept += 1
        cdef double horizon = response._now - self.window_seconds
        cdef list foreign
        for i in range(n):
            values = owners[i]
            if values:
                matched.holders[fps[i]] = values
            if not values or not is_private[i]:
                continue
            foreign = self._foreign_values(response, values, horizon)
            for value in foreign:
                state._cover(value, first + at[i], self.k, fps[i],
                             self._specific_units(value))
                matched.touched.add(value)
            if foreign:
                # Another tenant's text in this output is not this tenant's text: it must
                # not make a later leak of it to the same tenant look like its own.
                matched.private.discard(fps[i])
                state.foreign.push(first + at[i])
        return matched

    cdef list _foreign_values(self, ScanFields response, tuple values, double horizon):
        """The index values (request slot and
        prompt/output bit) that make this k-gram foreign: none when the victim's tenant
        or enough tenants use it, or when it is in the answer to the same question.
        A request older than ``horizon`` is out of the window, swept or not."""
        cdef set tenants = set(), prompted = set(), written = set()
        cdef list foreign = []
        cdef RequestRecord record
        for value in values:
            record = self.requests.get(value >> 1)
            if record is None or record.time < horizon:
                continue  # expired
            if value & 1:
                if self.same_question(response, value >> 1):
                    return []  # the answer to the same question: explained, whoever has it
                if record.carries is not None and response.tenant in record.carries:
                    continue  # a copy of this tenant's answer: no evidence (_carried)
                written.add(record.tenant)
            else:
                prompted.add(record.tenant)
            tenants.add(record.tenant)
            foreign.append(value)
        if response.tenant in tenants or len(tenants) >= self.common_tenants:
            return []
        if len(tenants) > 1 and not written <= prompted:
            # A model wrote this text for one of them: where a prompt holds it too, it
            # is the model's text there as well; not where an output only repeats its
            # own tenant's prompt (_foreign_values).
            return [v for v in foreign if v & 1]
        return foreign

    cpdef bint same_question(self, ScanFields response, slot) except -1:
        """Whether ``slot``'s request asked (nearly) what this response's did
        (``similar_prompts``), asked once per slot: a response meets the same source
        on many of its k-grams."""
        same = response._similar.get(slot)
        if same is None:
            same = response._similar[slot] = similar_prompts(
                self.requests, response.slot, slot, self.same_prompt_similarity)
        return same

    def values_of(self, uint64_t fp):
        """``_values_of``, for tests that hold it to ``FingerprintIndex.lookup``."""
        return self._values_of(fp)

    cdef tuple _values_of(self, uint64_t fp):
        """``FingerprintIndex.lookup([fp])[0]``: the values the index holds for ``fp``
        (the hot generation's, then each frozen one's), without a list; Python runs only
        to build the frozen generations' view after they changed (``frozen``)."""
        cdef IndexFields index = self.index
        cdef uint32_t value
        cdef tuple found = ()
        if index._hot.find(fp, &value):
            found = index._hot.values_of(fp, value, index._hot_more)
        cdef FrozenGenerations frozen = index._frozen
        if frozen is None:
            frozen = self.index.frozen()
        return found if frozen is None else frozen.values_after(fp, found)

    cdef object _specific_units(self, value):
        """For a foreign output (index value with the output bit), the units that make
        its text specific to its exchange: its prompt's units (the
        engine's empty array once its request is gone); None for a foreign prompt."""
        if not value & 1:
            return None
        record = self.requests.get(value >> 1)
        return (<RequestRecord>record).prompt_units if record is not None else self.no_units

    cdef int _learn_from(self, ScanFields response, list unowned, dict holders,
                         list to_index) except -1:
        """What the output teaches the engine: its private fingerprints (``to_index``),
        a source for later and concurrent responses, right away; and its use of text
        (``unowned``) in the commonness sketch. Text another request holds (``holders``)
        may be turning common: counted now for the holders
        (``ResponseScan._use_held``), and for this tenant at the end
        (``ResponseScan._count_output``: not where it leaked to it). Text only this
        output holds so far cannot be common yet: counted at the response's end, in one
        batch (counting every fingerprint on every feed was a third of a delta's time)."""
        cdef list count_now = [fp for fp in unowned if fp in holders] if holders else []
        if count_now:
            # A Python frame, ~5,000 calls a replay: one rule for both scans, not a copy.
            response._use_held(count_now, holders)
            response._to_count.extend([fp for fp in unowned if fp not in holders])
        else:
            response._to_count.extend(unowned)
        self.index.add_many(to_index, response.output_value, response._now)
        return 0

    cdef list _fragment_findings(self, ScanFields response, ChoiceColumns state, choice,
                                 set touched):
        """The runs ``touched`` that are evidence
        (``_enough``), each reported once per source tenant by the Python
        ``_fragment_finding``, in the set's order."""
        if not touched:
            return []
        cdef list found = []
        for value in touched:
            run = state.runs[value]
            record = self.requests.get(value >> 1)
            if record is None or not self._enough(state, run, value & 1, record.turns_known):
                continue
            finding = response._fragment_finding(state, choice, run, record, value & 1)
            if finding is not None:
                found.append(finding)
        if found:
            response.findings.extend(found)
        return found

    cdef bint _enough(self, ChoiceColumns state, Run run, bint of_output,
                      bint user_words) except -1:
        """Whether a foreign prompt's or output's coverage of this choice is evidence.

        A contiguous run of ``min_run_words`` with a distinctive word; without one,
        ``plain_run_factor`` (prompt), ``plain_user_factor`` (a prompt whose turns are
        known: ``user_words``) or ``plain_output_factor`` (output, 0: never) times as
        long; or, for pages cut into short pieces by common text and for whole
        mis-routed answers, coverage of ``2 * min_run_words`` that fills at least
        ``containment`` of the span it is scattered over, with two distinctive words (or
        ``plain_cover_factor * min_run_words`` of coverage without them). A foreign
        output's coverage must also hold a unit specific to its exchange (``Run.specific``)
        on every path: a model writes the same phrasing, code scaffolding and even names
        for many tenants; what only one exchange's output holds is its numbers and the
        words of its own prompt it restates. Without one, a foreign output's text is the
        model's habit (a mis-route included: an answer with nothing of its exchange in
        it tells nobody anything)."""
        cdef long threshold = self.run_threshold
        if of_output:
            for i in run.specific:
                if state._tied(i):
                    break
            else:
                return False  # no unit ties the foreign output to its exchange
        cdef double factor = (
            self.plain_output_factor if of_output
            else self.plain_user_factor if user_words else self.plain_run_factor
        )
        if factor and run.best >= threshold * factor:
            return True
        if run.best >= threshold and state._distinctive(run.best_start, run.best_end + 1):
            return True
        cdef const uint64_t* cum = state.cumulative.data
        cdef Py_ssize_t span = <Py_ssize_t>cum[run.end + 1] - <Py_ssize_t>cum[run.first]
        if run.covered < 2 * threshold:
            return False
        if self.exclusive and run.kgrams >= self.exclusive * state.private_kgrams:
            return True  # nearly all of this answer's uncommon text is one request's
        if run.covered < self.containment * span:
            return False
        return len(run.distinct_units) >= 2 or (
            self.plain_cover_factor > 0 and run.covered >= threshold * self.plain_cover_factor
        )

    cdef bint _only_tenant_holds(self, response, uint64_t fp) except -1:
        """Every request that holds ``fp`` is this response's tenant's and in the window
        (``ResponseScan._source_record``'s test): then no value of it is foreign
        (``_foreign_values``), and the tenant's use of it is counted already
        (``Engine._classify``'s ``unowned``)."""
        cdef tuple values = self._values_of(fp)
        if not values or len(values) >= 64:
            return False  # kept for the slow path: rare, and not private there
        tenant = (<ScanFields>response).tenant
        cdef double horizon = (<ScanFields>response)._now - self.window_seconds
        cdef RequestRecord record
        for value in values:
            record = self.requests.get(value >> 1)
            if record is None or record.time < horizon or record.tenant != tenant:
                return False
        return True

    cdef int _index_fresh(self, const uint64_t* fps, Py_ssize_t n, uint32_t value,
                          now) except -1:
        """``FingerprintIndex.add_many`` of the ``n`` k-grams ``fps``, which no generation
        holds (``_classify`` checked): stored in the hot table here while that does not
        fill it, a Python call less on every delta; else by ``add_many``, which freezes
        the full table."""
        cdef IndexFields index = self.index
        cdef HotTable hot = index._hot
        cdef Py_ssize_t count = index._hot_count, i
        if count + n >= index.freeze_size:
            self.index.add_many(list_of(fps, n), value, now)
            return 0
        for i in range(n):
            # One probe: stored unless the same k-gram came twice in this delta.
            count += hot.put(fps[i], value, False)
        index._hot_count = count
        index._hot_newest = now
        return 0


cdef list feed_delta(DeltaScanner scanner, ScanFields response, ChoiceColumns state, str delta, choice,
                     EntityIndexFields entity_index, EngineClock clock):
    """``ScanFields.feed`` once its choice's state is found: ``scanner``'s fragment
    step (its slow path included), the entity scan, and the record of the feed (the
    units so far, the next of ``clock``'s sequence numbers). Returns the findings.
    Python runs only when a step meets something: a k-gram another tenant holds that is
    not common yet, an entity, a pending key."""
    cdef list found = scanner.step(response, state, delta, choice)
    if found is None:
        found = []
    entities = state.entities
    if entities is not None:
        if entity_index.pending and entity_index.rebuild_due():
            entity_index.maybe_rebuild()
        matches = (<EntityFeed>entities)._feed(delta)
        # Another replica's keys (no automaton holds them), every ID_STRIDE units: a key
        # is found within half an enforce holdback of words, CJK text's included.
        if (entity_index.id_only
                and state.hashes.size - (<EntityFeed>entities).ids_units >= ID_STRIDE):
            (<EntityFeed>entities).ids_units = state.hashes.size
            by_id = entities.match_ids()
            if by_id:
                matches = by_id if matches is None else matches + by_id
        if matches:  # most deltas meet no entity
            found += response._met_entities(state, choice, matches)
    state.batches.push(state.hashes.size)
    clock.sequence += 1
    state.seqs.push(clock.sequence)
    return found


