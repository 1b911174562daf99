# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The engine's per-word loops, compiled (issue 16's first slice).

Each function here replaces a Python loop of ``proxy.engine.tokens`` or
``proxy.engine.fingerprint`` and returns exactly what that loop returned: the Python
versions stay in ``proxy.engine.reference`` and ``tests/test_core_parity.py`` holds the
two to the same output over the quality workload and random text. At the end, the
records the engine keeps per request and per entity of its window, as classes the
garbage collector does not walk (issue 16's GC target).
"""

cimport cython
from cpython.unicode cimport (
    Py_UNICODE_ISDECIMAL, Py_UNICODE_ISDIGIT, Py_UNICODE_ISSPACE, PyUnicode_DecodeASCII,
    PyUnicode_1BYTE_KIND, PyUnicode_2BYTE_KIND, PyUnicode_KIND, PyUnicode_READ,
    PyUnicode_READ_CHAR, PyUnicode_Substring,
)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void*)
    bint PyObject_IS_GC(object)
    bint PyObject_GC_IsTracked(object)
    bint PyUnicode_IS_ASCII(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)

cdef extern from "stdlib.h" nogil:
    void qsort(void* base, size_t count, size_t size,
               int (*compare)(const void*, const void*) noexcept nogil)

cdef extern from *:
    """
    #define CROSSTALK_PREFETCH(p) __builtin_prefetch((const void*)(p), 0, 1)
    #define CROSSTALK_PREFETCH_W(p) __builtin_prefetch((const void*)(p), 1, 1)
    """
    void prefetch "CROSSTALK_PREFETCH"(const void* p) noexcept nogil
    void prefetch_w "CROSSTALK_PREFETCH_W"(const void* p) noexcept nogil

# How many fingerprints ahead a loop over a large table (the sketch, the pair filter,
# the vocabulary) asks for the cache lines it will touch: each fingerprint's are a
# cache miss apart, and a loop that waits for one miss at a time runs at memory latency.
cdef enum:
    AHEAD = 8

cdef uint64_t PRIME = 0x9E3779B97F4A7C15ULL


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    """splitmix64's finaliser (``fingerprint._mix64``)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline bint is_alnum(unsigned char c) noexcept nogil:
    return (c >= 48 and c <= 57) or (c >= 65 and c <= 90) or (c >= 97 and c <= 122)


cdef inline bint ascii_word(str text) noexcept:
    """``text`` is one ASCII word, a run of ``[A-Za-z0-9]`` (what ``next_word`` finds)."""
    if not PyUnicode_IS_ASCII(text):
        return False
    cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
    cdef Py_ssize_t i
    for i in range(PyUnicode_GET_LENGTH(text)):
        if not is_alnum(data[i]):
            return False
    return True


cdef inline bint has_ascii_upper(str text) noexcept:
    """An ASCII ``text`` holds a capital letter."""
    cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
    cdef Py_ssize_t i
    for i in range(PyUnicode_GET_LENGTH(text)):
        if 65 <= data[i] <= 90:
            return True
    return False


cdef inline bint specific_ascii_number(const unsigned char* unit, Py_ssize_t n) noexcept:
    """``detector.is_specific_number`` of an ASCII unit: three digits or more, and not a
    year (19xx, 20xx)."""
    cdef Py_ssize_t i
    if n < 3:
        return False
    for i in range(n):
        if not 48 <= unit[i] <= 57:
            return False
    return not (n == 4 and unit[0] in b"12" and (unit[1] == 57 if unit[0] == 49 else unit[1] == 48))


cdef inline Py_ssize_t next_word(const unsigned char* data, Py_ssize_t i, Py_ssize_t n,
                                  Py_ssize_t* end, bint* upper) noexcept:
    """The start of the first run of ``[A-Za-z0-9]`` at or after ``i`` (``n`` when there
    is none); its end goes to ``end``, and whether it holds a capital to ``upper``."""
    while i < n and not is_alnum(data[i]):
        i += 1
    cdef Py_ssize_t start = i
    upper[0] = False
    while i < n and is_alnum(data[i]):
        upper[0] |= 65 <= data[i] <= 90
        i += 1
    end[0] = i
    return start


cdef int append_ascii_units(str text, Py_ssize_t offset, list texts, list starts,
                            list ends) except -1:
    """``ascii_units``'s loop, appending to the caller's columns."""
    cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t start, end = 0
    cdef bint upper
    while True:
        start = next_word(data, end, n, &end, &upper)
        if start == n:
            return 0
        unit = PyUnicode_Substring(text, start, end)
        texts.append(unit.lower() if upper else unit)  # most words have no capital
        starts.append(start + offset)
        ends.append(end + offset)


def ascii_units(str text, Py_ssize_t offset=0):
    """The units of an ASCII ``text`` (runs of ``[A-Za-z0-9]``, lowercased) as three
    columns: texts, start offsets, end offsets (shifted by ``offset``). The caller has
    checked ``text.isascii()``; anything else is a ValueError."""
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("ascii_units needs an ASCII string")
    cdef list texts = [], starts = [], ends = []
    append_ascii_units(text, offset, texts, starts, ends)
    return texts, starts, ends


cdef inline Py_ssize_t kgram_count(Py_ssize_t size, Py_ssize_t first, int k) noexcept:
    """How many k-grams start in ``hashes[first:size]`` (0 for none)."""
    return size - first - k + 1 if k >= 1 and size - first - k + 1 > 0 else 0


cdef void roll_kgrams(const uint64_t* hashes, Py_ssize_t first, Py_ssize_t n, int k,
                      uint64_t* out) noexcept:
    """The ``n`` (> 0) k-grams that start at ``hashes[first]``, into ``out``: each rolled
    from the one before (``Hasher.kgram`` of each window)."""
    cdef uint64_t h = 0, top = 1
    cdef Py_ssize_t i
    cdef int j
    for j in range(k - 1):
        top *= PRIME  # the oldest unit's multiplier, PRIME ** (k - 1) mod 2**64
    for j in range(k):
        h = h * PRIME + hashes[first + j]
    out[0] = mix64(h)
    for i in range(first + 1, first + n):
        h = (h - hashes[i - 1] * top) * PRIME + hashes[i + k - 1]
        out[i - first] = mix64(h)


cdef list list_of(const uint64_t* values, Py_ssize_t n):
    """``values[:n]`` as a list of ints."""
    cdef Py_ssize_t i
    return [values[i] for i in range(n)]


cdef list list_at(const uint64_t* values, const Py_ssize_t* at, Py_ssize_t n):
    """``values`` at the ``n`` positions ``at``, as a list of ints."""
    cdef Py_ssize_t i
    return [values[at[i]] for i in range(n)]


cdef list kgrams_from(const uint64_t* hashes, Py_ssize_t size, Py_ssize_t first, int k):
    """``kgrams`` of ``hashes[first:size]``, a list."""
    cdef Py_ssize_t n = kgram_count(size, first, k)
    if n == 0:
        return []
    cdef uint64_t* grams = <uint64_t*>malloc(n * sizeof(uint64_t))
    if grams == NULL:
        raise MemoryError()
    try:
        roll_kgrams(hashes, first, n, k, grams)
        return list_of(grams, n)
    finally:
        free(grams)


def kgrams(hashes, int k):
    """The fingerprint of every k-gram of ``hashes`` (unit hashes, 64-bit ints: a list
    or a ``Column``), in order: ``Hasher.kgram`` of each window, rolled from the one
    before."""
    cdef Column column
    if isinstance(hashes, Column):
        column = hashes
    else:
        column = Column.__new__(Column)
        column.extend_from(hashes)
    return kgrams_from(column.data, column.size, 0, k)


def sketch_counts(const unsigned short[::1] flat, tuple seeds, uint64_t mask,
                  Py_ssize_t width, list fingerprints):
    """``CommonnessSketch.counts``: per fingerprint, the smallest of its cells, one per
    row of ``flat`` (the counters, row after row, each ``width`` long), the slot of row
    ``r`` being bits 29 and up of ``(fp ^ seeds[r]) * C`` under ``mask``."""
    cdef Py_ssize_t depth = len(seeds), r
    if depth > 8 or depth * width > flat.shape[0]:
        raise ValueError("sketch_counts: seeds do not fit the counters")
    cdef uint64_t s[8]
    for r in range(depth):
        s[r] = <uint64_t>seeds[r]
    cdef list out = []
    cdef Py_ssize_t n = len(fingerprints), i
    for i in range(n):
        if i + AHEAD < n:
            sketch_prefetch(&flat[0], s, depth, mask, width, <uint64_t>fingerprints[i + AHEAD], False)
        out.append(sketch_min(&flat[0], s, depth, mask, width, <uint64_t>fingerprints[i]))
    return out


cdef inline Py_ssize_t sketch_cell(const uint64_t* seeds, Py_ssize_t r, uint64_t mask,
                                   Py_ssize_t width, uint64_t fp) noexcept nogil:
    """The cell of ``fp`` in row ``r``."""
    return r * width + <Py_ssize_t>((((fp ^ seeds[r]) * 0xFF51AFD7ED558CCDULL) >> 29) & mask)


cdef inline void sketch_prefetch(const unsigned short* flat, const uint64_t* seeds,
                                 Py_ssize_t depth, uint64_t mask, Py_ssize_t width,
                                 uint64_t fp, bint write) noexcept nogil:
    """Ask for the cache lines of ``fp``'s cells (``AHEAD``)."""
    cdef Py_ssize_t r
    for r in range(depth):
        if write:
            prefetch_w(flat + sketch_cell(seeds, r, mask, width, fp))
        else:
            prefetch(flat + sketch_cell(seeds, r, mask, width, fp))


cdef inline unsigned short sketch_min(const unsigned short* flat, const uint64_t* seeds,
                                      Py_ssize_t depth, uint64_t mask, Py_ssize_t width,
                                      uint64_t fp) noexcept nogil:
    """One fingerprint's count in ``sketch_counts``: the smallest of its cells."""
    cdef unsigned short low = 65535, cell
    cdef Py_ssize_t r
    for r in range(depth):
        cell = flat[sketch_cell(seeds, r, mask, width, fp)]
        if cell < low:
            low = cell
    return low


cdef inline bint sketch_below(const unsigned short* flat, const uint64_t* seeds,
                              Py_ssize_t depth, uint64_t mask, Py_ssize_t width, uint64_t fp,
                              long threshold) noexcept nogil:
    """``sketch_min(...) < threshold``, reading no row after one below it: a k-gram few
    tenants used (most of a stream's) costs one of the sketch's cache misses, not one a
    row."""
    cdef Py_ssize_t r
    for r in range(depth):
        if flat[sketch_cell(seeds, r, mask, width, fp)] < threshold:
            return True
    return False


def sketch_increment(unsigned short[::1] flat, tuple seeds, uint64_t mask,
                     Py_ssize_t width, fingerprints, bint together):
    """``CommonnessSketch.increment``'s loop: one more use in every cell of each
    fingerprint (``sketch_counts``'s cells), saturating at 65535. ``together``: every
    cell is read before any is written, so a cell that several of the fingerprints share
    counts one use (the numpy update of the batch path, ``reference.sketch_increment``);
    otherwise one fingerprint after another, each use counted. ``fingerprints``: a list
    of ints or a ``Column``."""
    cdef Column column = as_column(fingerprints)
    cdef const uint64_t* fps = column.data
    cdef Py_ssize_t depth = len(seeds), n = column.size, r, i
    if depth > 8 or depth * width > flat.shape[0]:
        raise ValueError("sketch_increment: seeds do not fit the counters")
    cdef uint64_t s[8]
    for r in range(depth):
        s[r] = <uint64_t>seeds[r]
    cdef Py_ssize_t* cells = <Py_ssize_t*>malloc(max(n * depth, 1) * sizeof(Py_ssize_t))
    cdef unsigned short* counts = <unsigned short*>malloc(max(n * depth, 1) * sizeof(unsigned short))
    if not cells or not counts:
        free(cells)
        free(counts)
        raise MemoryError()
    cdef uint64_t fp
    cdef Py_ssize_t cell
    try:
        for i in range(n):
            if i + AHEAD < n:
                sketch_prefetch(&flat[0], s, depth, mask, width, fps[i + AHEAD], True)
            fp = fps[i]
            for r in range(depth):
                cell = sketch_cell(s, r, mask, width, fp)
                if together:
                    cells[i * depth + r] = cell
                    counts[i * depth + r] = flat[cell]
                elif flat[cell] < 65535:
                    flat[cell] += 1
        if together:
            for i in range(n * depth):
                if counts[i] < 65535:
                    flat[cells[i]] = counts[i] + 1
    finally:
        free(cells)
        free(counts)


cdef Column as_column(values):
    """``values``, a ``Column`` or a list of ints, as a ``Column`` (a copy of a list)."""
    return values if isinstance(values, Column) else Column(values)


cdef uint64_t PAIR_STEP = 0xC2B2AE3D27D4EB4FULL
cdef uint64_t PAIR_MULTIPLIER = 0x9E3779B97F4A7C15ULL


def pair_first_seen(unsigned char[::1] current, const unsigned char[::1] previous,
                    uint64_t tenant_key, fingerprints, int shift):
    """``PairFilter.first_seen``'s loop: each (tenant, fingerprint) pair is three bits,
    the top ``64 - shift`` bits of ``(pair + i * STEP) * MULTIPLIER`` for i = 0, 1, 2
    (``pair = tenant_key ^ fp``), in two Bloom generations of equal size. A pair in
    neither is recorded in ``current`` and its fingerprint returned, in order; a
    fingerprint given twice is new at most once. ``fingerprints``: a list of ints or a
    ``Column`` (an output's, read in place). The new ones: a ``Column``."""
    if not 0 < shift < 64 or previous.shape[0] != current.shape[0]:
        raise ValueError("pair_first_seen: generations differ or the shift is out of range")
    if ((<uint64_t>-1) >> shift) >> 3 >= <uint64_t>current.shape[0]:
        raise ValueError("pair_first_seen: the generations are too short for the shift")
    cdef uint64_t fp, pair, a, b, c
    cdef unsigned char am, bm, cm
    cdef Column new = Column()
    cdef Column column = as_column(fingerprints)
    cdef const uint64_t* fps = column.data
    cdef Py_ssize_t n = column.size, i
    for i in range(n):
        if i + AHEAD < n:  # a new pair reads its first bit in both, then writes three
            pair = tenant_key ^ fps[i + AHEAD]
            a = (pair * PAIR_MULTIPLIER) >> shift
            prefetch(&previous[a >> 3])
            prefetch_w(&current[a >> 3])
            prefetch_w(&current[((pair + PAIR_STEP) * PAIR_MULTIPLIER) >> shift >> 3])
            prefetch_w(&current[((pair + 2 * PAIR_STEP) * PAIR_MULTIPLIER) >> shift >> 3])
        fp = fps[i]
        pair = tenant_key ^ fp
        a = (pair * PAIR_MULTIPLIER) >> shift
        b = ((pair + PAIR_STEP) * PAIR_MULTIPLIER) >> shift
        c = ((pair + 2 * PAIR_STEP) * PAIR_MULTIPLIER) >> shift
        am, bm, cm = 1 << (a & 7), 1 << (b & 7), 1 << (c & 7)
        if (current[a >> 3] & am and current[b >> 3] & bm and current[c >> 3] & cm) or (
            previous[a >> 3] & am and previous[b >> 3] & bm and previous[c >> 3] & cm
        ):
            continue
        current[a >> 3] |= am
        current[b >> 3] |= bm
        current[c >> 3] |= cm
        new.push(fp)
    return new


cdef inline Py_ssize_t lower_bound(const uint64_t* keys, Py_ssize_t n, uint64_t key) noexcept nogil:
    cdef Py_ssize_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef inline bint sorted_has(const uint64_t* keys, Py_ssize_t n, uint64_t key) noexcept nogil:
    """``key`` is in the ``n`` sorted ``keys``."""
    cdef Py_ssize_t at = lower_bound(keys, n, key)
    return at < n and keys[at] == key


def untracked(tuple items):
    """``items``, out of the garbage collector's sight unless one of them is a tracked
    container. A tuple of ints, floats and strings can be in no reference cycle, and
    CPython untracks one itself, but only in the first collection that walks it: the
    index's and the entity table's long-lived tuples, made thousands a second, were
    most of what a young collection of the detector walked, a cache miss or more each
    (issue 16's GC target). Returns ``items``."""
    for item in items:
        if PyObject_IS_GC(item) and PyObject_GC_IsTracked(item):
            return items
    PyObject_GC_UnTrack(<void*>items)
    return items


def sorted_contains(const uint64_t[::1] keys, uint64_t key):
    """``key`` is in the sorted array ``keys``: numpy's ``searchsorted`` on one scalar
    costs microseconds of conversions, paid for every unit a foreign output covers."""
    return keys.shape[0] > 0 and sorted_has(&keys[0], keys.shape[0], key)


def sorted_members(const uint64_t[::1] keys, list fingerprints):
    """``[fp in keys for fp in fingerprints]`` for the sorted array ``keys``."""
    cdef Py_ssize_t n = keys.shape[0]
    if n == 0:
        return [False] * len(fingerprints)
    return [sorted_has(&keys[0], n, <uint64_t>item) for item in fingerprints]


def sorted_intersection_size(const uint64_t[::1] a, const uint64_t[::1] b):
    """``len(np.intersect1d(a, b, assume_unique=True))`` of two sorted arrays of unique
    keys, by merging: numpy's concatenates and sorts both (about 19 us for two prompt
    signatures), once per pair of requests a response meets."""
    return intersection_size(a, b)


cdef Py_ssize_t intersection_size(const uint64_t[::1] a, const uint64_t[::1] b) noexcept:
    cdef Py_ssize_t i = 0, j = 0, shared = 0, n = a.shape[0], m = b.shape[0]
    while i < n and j < m:
        if a[i] < b[j]:
            i += 1
        elif b[j] < a[i]:
            j += 1
        else:
            shared += 1
            i += 1
            j += 1
    return shared


cpdef bint similar_prompts(dict requests, a, b, double similarity) except -1:
    """``Engine.similar_prompts``: whether requests ``a`` and ``b`` (``RequestRecord``s of
    ``requests``, by slot) asked (nearly) the same thing: the same prompt digest, or
    bottom-k signatures of at least 4 private k-grams each that share ``similarity`` of
    the smaller one. False when either is gone."""
    cdef RequestRecord x = requests.get(a), y = requests.get(b)
    if x is None or y is None:
        return False
    if x.prompt_digest == y.prompt_digest:
        return True
    cdef Py_ssize_t small = min(len(x.signature), len(y.signature))
    if small < 4:
        return False  # too little private text to tell: only identical prompts count
    return intersection_size(x.signature, y.signature) / <double>small >= similarity


cpdef dict holders_by_tenant(dict requests, str tenant, list fps, dict holders):
    """``fps`` by the tenants other than ``tenant`` whose requests (``RequestRecord``s
    of ``requests``, by slot) hold them, in the order met: ``holders`` maps a k-gram to
    its index values (slot << 1 | output bit). A k-gram two requests of one tenant hold
    is listed twice (the pair filter counts it once)."""
    cdef dict by_tenant = {}
    cdef RequestRecord record
    cdef list used
    cdef tuple values
    for fp in fps:
        values = holders[fp]
        for value in values:
            record = requests.get(value >> 1)
            if record is None or record.tenant == tenant:
                continue
            used = by_tenant.get(record.tenant)
            if used is None:
                by_tenant[record.tenant] = [fp]
            else:
                used.append(fp)
    return by_tenant


def mark_buckets(unsigned char[::1] bitmap, const uint64_t[::1] keys, int shift):
    """Set bit ``key >> shift`` of ``bitmap`` (little-endian bits in bytes) for every key:
    the "maybe here" bitmaps of the index's generations. ``numpy.bitwise_or.at`` did it
    at ~10 ns a key, on the delta that froze the hot generation."""
    if not 0 < shift < 64 or ((<uint64_t>-1) >> shift) >> 3 >= <uint64_t>bitmap.shape[0]:
        raise ValueError("mark_buckets: the bitmap is too short for the shift")
    cdef Py_ssize_t i
    cdef uint64_t bucket
    for i in range(keys.shape[0]):
        bucket = keys[i] >> shift
        bitmap[bucket >> 3] |= <unsigned char>(1 << (bucket & 7))


def bucket_starts(const uint64_t[::1] keys, int shift, uint32_t[::1] starts):
    """``starts[b]``: the first index of sorted ``keys`` whose top bits (``key >>
    shift``) are at least ``b``, for every bucket ``b`` below ``len(starts) - 1``; the
    last entry is ``len(keys)``. The keys of bucket ``b`` are ``keys[starts[b]:starts[b +
    1]]``: a generation's directory, where a binary search over all its keys waited for a
    cache miss at each of ~17 steps."""
    cdef Py_ssize_t n = keys.shape[0], buckets = starts.shape[0] - 1, i = 0, b
    if buckets < 1 or n >= <Py_ssize_t>0xFFFFFFFF or not 0 < shift < 64:
        raise ValueError("bucket_starts: no buckets, too many keys or a shift out of range")
    if ((<uint64_t>-1) >> shift) >= <uint64_t>buckets:
        raise ValueError("bucket_starts: fewer buckets than the shift makes")
    for b in range(buckets):
        while i < n and (keys[i] >> shift) < <uint64_t>b:
            i += 1
        starts[b] = <uint32_t>i
    starts[buckets] = <uint32_t>n


cdef struct KeyValue:
    uint64_t key
    uint32_t value


cdef int _by_key(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const KeyValue*>a).key, y = (<const KeyValue*>b).key
    return (x > y) - (x < y)


cdef void _sort_run(KeyValue* run, Py_ssize_t n) noexcept nogil:
    """Sort ``run[:n]`` by key: insertion for the few of a bucket, ``qsort`` past 16."""
    cdef Py_ssize_t i, j
    cdef KeyValue x
    if n > 16:
        qsort(run, n, sizeof(KeyValue), _by_key)
        return
    for i in range(1, n):
        x = run[i]
        j = i
        while j > 0 and run[j - 1].key > x.key:
            run[j] = run[j - 1]
            j -= 1
        run[j] = x


def sort_pairs(uint64_t[::1] keys not None, uint32_t[::1] values not None):
    """Sort ``keys`` ascending in place, each of ``values`` moved with its key (equal keys
    in no set order). One pass deals the keys into about ``len(keys) / 2`` buckets by their
    top bits, and each bucket is sorted on its own: linear time for keys spread as evenly
    as fingerprints (hashes) are, where ``numpy.argsort`` and the two gathers after it
    were most of an index freeze, on the delta that paid for it. Keys that are not spread
    (small integers, in tests) crowd a few buckets, which ``qsort`` then sorts."""
    cdef Py_ssize_t n = keys.shape[0], i, j, start, end, b
    if values.shape[0] != n:
        raise ValueError("sort_pairs: keys and values differ in length")
    if n < 2:
        return
    cdef uint64_t top = 0
    for i in range(n):
        top |= keys[i]
    cdef int width = 0, bits = 1
    while width < 64 and top >> width:
        width += 1
    while bits < 20 and (<Py_ssize_t>1 << (bits + 1)) <= n:
        bits += 1
    cdef int shift = width - bits if width > bits else 0
    cdef Py_ssize_t buckets = <Py_ssize_t>1 << bits
    # ends[b]: first the count of bucket b - 1, then (summed) where bucket b starts, then
    # (dealt) where it ends.
    cdef Py_ssize_t* ends = <Py_ssize_t*>calloc(buckets + 1, sizeof(Py_ssize_t))
    cdef KeyValue* dealt = <KeyValue*>malloc(n * sizeof(KeyValue))
    if ends == NULL or dealt == NULL:
        free(ends)
        free(dealt)
        raise MemoryError()
    for i in range(n):
        ends[(keys[i] >> shift) + 1] += 1
    for b in range(buckets):
        ends[b + 1] += ends[b]
    for i in range(n):
        b = keys[i] >> shift
        j = ends[b]
        ends[b] = j + 1
        dealt[j].key = keys[i]
        dealt[j].value = values[i]
    start = 0
    for b in range(buckets):
        end = ends[b]
        if end - start > 1:
            _sort_run(dealt + start, end - start)
        start = end
    for i in range(n):
        keys[i] = dealt[i].key
        values[i] = dealt[i].value
    free(ends)
    free(dealt)


cdef int _by_value(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef void sort_keys(uint64_t* keys, Py_ssize_t n, int depth=48) noexcept nogil:
    """Sort ``keys[:n]`` ascending in place: quicksort on the middle key, insertion
    below 17 keys. A prompt's few hundred k-grams: numpy's sort cost more to call.
    Past ``depth`` partitions (an order that defeats the middle key, such as an organ
    pipe: keyed hashes never come so) the rest goes to ``qsort``, so no input is
    quadratic."""
    cdef Py_ssize_t i, j
    cdef uint64_t x, pivot
    while n > 16:
        if depth == 0:
            qsort(keys, n, sizeof(uint64_t), _by_value)
            return
        depth -= 1
        pivot = keys[n // 2]
        i, j = 0, n - 1
        while i <= j:
            while keys[i] < pivot:
                i += 1
            while keys[j] > pivot:
                j -= 1
            if i <= j:
                x = keys[i]
                keys[i] = keys[j]
                keys[j] = x
                i += 1
                j -= 1
        # The smaller side recursively, the larger by the loop: bounded stack depth.
        if j + 1 < n - i:
            sort_keys(keys, j + 1, depth)
            keys, n = keys + i, n - i
        else:
            sort_keys(keys + i, n - i, depth)
            n = j + 1
    for i in range(1, n):
        x = keys[i]
        j = i
        while j > 0 and keys[j - 1] > x:
            keys[j] = keys[j - 1]
            j -= 1
        keys[j] = x


def ints_into(list values not None, uint64_t[::1] out not None):
    """``values`` (ints below 2**64) written to the start of ``out`` (at least as long):
    a prompt's unit hashes as an array, where ``numpy.array`` first asks each int which
    type the array should have."""
    copy_ints(values, out)


cdef int copy_ints(list values, uint64_t[::1] out) except -1:
    cdef Py_ssize_t n = len(values), i
    if out.shape[0] < n:
        raise ValueError("out is shorter than values")
    for i in range(n):
        out[i] = <uint64_t>values[i]
    return 0


def sorted_unique_into(list values not None, uint64_t[::1] out not None):
    """``numpy.unique`` of ``values`` (ints below 2**64) written to the start of ``out``
    (at least as long): ascending, no repeats. Returns how many were written. The
    prompt signature's step: numpy's five calls for a prompt's k-grams cost more than
    their sort."""
    cdef Py_ssize_t n = len(values), i, kept = 0
    copy_ints(values, out)
    if n == 0:
        return 0
    sort_keys(&out[0], n)
    for i in range(n):
        if kept == 0 or out[i] != out[kept - 1]:
            out[kept] = out[i]
            kept += 1
    return kept


def units_beyond(list units not None, list of not None):
    """``detector.beyond``: the units (ints below 2**64) that ``units`` holds more often
    than ``of`` does, in order, each of ``of``'s uses taking away the first one left of
    ``units``' (``Counter(units) - Counter(of)``'s keys, some repeated). ``of`` is sorted
    once and searched by halves."""
    cdef Py_ssize_t n = len(units), m = len(of), distinct = 0, i, at
    if m == 0:
        return list(units)
    cdef list kept = []
    cdef uint64_t unit
    cdef uint64_t* keys = <uint64_t*>malloc(m * sizeof(uint64_t))
    cdef Py_ssize_t* left = <Py_ssize_t*>malloc(m * sizeof(Py_ssize_t))
    try:
        if keys == NULL or left == NULL:
            raise MemoryError()
        for i in range(m):
            keys[i] = <uint64_t>of[i]
        sort_keys(keys, m)
        for i in range(m):  # the distinct keys, each with its count
            if distinct and keys[i] == keys[distinct - 1]:
                left[distinct - 1] += 1
            else:
                keys[distinct], left[distinct] = keys[i], 1
                distinct += 1
        for i in range(n):
            item = units[i]
            unit = <uint64_t>item
            at = lower_bound(keys, distinct, unit)
            if at < distinct and keys[at] == unit and left[at]:
                left[at] -= 1
            else:
                kept.append(item)
    finally:
        free(keys)
        free(left)
    return kept


def merge_sorted(const uint64_t[::1] a_keys, const uint32_t[::1] a_values,
                 const uint64_t[::1] b_keys, const uint32_t[::1] b_values,
                 uint64_t[::1] keys, uint32_t[::1] values):
    """Merge two key-sorted generations into ``keys``/``values`` (as long as both):
    a key in both has ``a``'s values first, as a stable sort of ``a`` then ``b`` would
    order them. One pass, where a sort of the two gathered every key again."""
    cdef Py_ssize_t na = a_keys.shape[0], nb = b_keys.shape[0], i = 0, j = 0, k = 0
    if (a_values.shape[0] != na or b_values.shape[0] != nb or keys.shape[0] != na + nb
            or values.shape[0] != na + nb):
        raise ValueError("merge_sorted: the columns do not align")
    while i < na and j < nb:
        if b_keys[j] < a_keys[i]:
            keys[k], values[k] = b_keys[j], b_values[j]
            j += 1
        else:
            keys[k], values[k] = a_keys[i], a_values[i]
            i += 1
        k += 1
    while i < na:
        keys[k], values[k] = a_keys[i], a_values[i]
        i += 1
        k += 1
    while j < nb:
        keys[k], values[k] = b_keys[j], b_values[j]
        j += 1
        k += 1


cdef class FrozenGenerations:
    """The frozen generations of a ``FingerprintIndex``, read in place: built once when
    they change, so that a lookup acquires no buffer. ``generations`` are ``(keys,
    values, bitmap, shift, starts, starts_shift)``: sorted uint64 keys, their uint32
    values, a bit per top-``64 - shift``-bits bucket that says "maybe here", and a
    directory of where each top-``64 - starts_shift``-bits bucket's keys start
    (``bucket_starts``: a search reads one entry and a few keys, not ~17 keys far
    apart); ``any_bits`` is the union of the bitmaps over ``any_shift``. The arrays must
    not change while this object lives (the index replaces them, never writes to them,
    except ``any_bits``, which it only ORs bits into)."""

    cdef Py_ssize_t count
    cdef const uint64_t** keys
    cdef const uint32_t** values
    cdef const unsigned char** bitmaps
    cdef Py_ssize_t* sizes
    cdef int* shifts
    cdef const uint32_t** starts
    cdef int* starts_shifts
    cdef const unsigned char[::1] any_bits
    cdef int any_shift
    cdef list held  # the buffers stay acquired while the pointers are used

    def __cinit__(self, list generations, const unsigned char[::1] any_bits, int any_shift):
        cdef Py_ssize_t g, count = len(generations)
        cdef const uint64_t[::1] keys
        cdef const uint32_t[::1] values
        cdef const unsigned char[::1] bitmap
        cdef const uint32_t[::1] starts
        if not 0 < any_shift < 64 or ((<uint64_t>-1) >> any_shift) >> 3 >= <uint64_t>any_bits.shape[0]:
            raise ValueError("FrozenGenerations: any_bits is too short for its shift")
        self.count, self.any_bits, self.any_shift, self.held = count, any_bits, any_shift, []
        self.keys = <const uint64_t**>malloc((count + 1) * sizeof(void*))
        self.values = <const uint32_t**>malloc((count + 1) * sizeof(void*))
        self.bitmaps = <const unsigned char**>malloc((count + 1) * sizeof(void*))
        self.sizes = <Py_ssize_t*>malloc((count + 1) * sizeof(Py_ssize_t))
        self.shifts = <int*>malloc((count + 1) * sizeof(int))
        self.starts = <const uint32_t**>malloc((count + 1) * sizeof(void*))
        self.starts_shifts = <int*>malloc((count + 1) * sizeof(int))
        if not (self.keys and self.values and self.bitmaps and self.sizes and self.shifts
                and self.starts and self.starts_shifts):
            raise MemoryError()
        for g in range(count):
            gen_keys, gen_values, gen_bitmap, gen_shift, gen_starts, starts_shift = generations[g]
            keys, values, bitmap, starts = gen_keys, gen_values, gen_bitmap, gen_starts
            if (not 0 < starts_shift < 64 or starts.shape[0] < 2
                    or ((<uint64_t>-1) >> starts_shift) >= <uint64_t>(starts.shape[0] - 1)
                    or starts[starts.shape[0] - 1] != keys.shape[0]):
                raise ValueError("FrozenGenerations: a directory does not fit its keys")
            self.starts[g], self.starts_shifts[g] = &starts[0], starts_shift
            if values.shape[0] != keys.shape[0] or not 0 < gen_shift < 64:
                raise ValueError("FrozenGenerations: a generation's columns do not align")
            if ((<uint64_t>-1) >> gen_shift) >> 3 >= <uint64_t>bitmap.shape[0]:
                raise ValueError("FrozenGenerations: a bitmap is too short for its shift")
            self.held.append((keys, values, bitmap, starts))
            self.sizes[g], self.shifts[g] = keys.shape[0], gen_shift
            self.keys[g] = &keys[0] if keys.shape[0] else NULL
            self.values[g] = &values[0] if values.shape[0] else NULL
            self.bitmaps[g] = &bitmap[0]

    def __dealloc__(self):
        free(self.keys)
        free(self.values)
        free(self.bitmaps)
        free(self.sizes)
        free(self.shifts)
        free(self.starts)
        free(self.starts_shifts)

    cdef inline Py_ssize_t first_at_least(self, Py_ssize_t g, uint64_t fp) noexcept:
        """The index of generation ``g``'s first key >= ``fp`` (its size when none),
        searched in ``fp``'s bucket of the directory."""
        cdef const uint32_t* starts = self.starts[g]
        cdef Py_ssize_t b = <Py_ssize_t>(fp >> self.starts_shifts[g]), lo = starts[b]
        return lo + lower_bound(self.keys[g] + lo, starts[b + 1] - lo, fp)

    cdef inline void prefetch(self, uint64_t fp) noexcept:
        """Start loading the byte of the index-wide bitmap that ``holds`` reads first
        for ``fp`` (2 MB: most reads of it miss the cache)."""
        prefetch(&self.any_bits[(fp >> self.any_shift) >> 3])

    cdef bint holds(self, uint64_t fp) noexcept:
        """Some generation holds ``fp``."""
        cdef Py_ssize_t g, size, at
        cdef uint64_t bucket = fp >> self.any_shift
        if not (self.any_bits[bucket >> 3] >> (bucket & 7)) & 1:
            return False
        for g in range(self.count):
            size = self.sizes[g]
            bucket = fp >> self.shifts[g]
            if not size or not (self.bitmaps[g][bucket >> 3] >> (bucket & 7)) & 1:
                continue
            at = self.first_at_least(g, fp)
            if at < size and self.keys[g][at] == fp:
                return True
        return False

    def values_into(self, list fingerprints, list result):
        """Appends to ``result[i]`` (a tuple) the values every generation holds for
        ``fingerprints[i]``, oldest generation first; returns ``result``."""
        cdef Py_ssize_t n = len(fingerprints), i
        if len(result) != n:
            raise ValueError("values_into: result and fingerprints differ in length")
        for i in range(n):
            if i + AHEAD < n:
                self.prefetch(<uint64_t>fingerprints[i + AHEAD])
            result[i] = self.values_after(<uint64_t>fingerprints[i], result[i])
        return result

    cdef tuple values_after(self, uint64_t fp, tuple before):
        """``before`` (the hot generation's values of ``fp``, maybe none), then the values
        every frozen generation holds for ``fp``, oldest generation first."""
        cdef Py_ssize_t g, j, lo, hi, size
        cdef uint64_t bucket = fp >> self.any_shift
        cdef const uint64_t* keys
        if not (self.any_bits[bucket >> 3] >> (bucket & 7)) & 1:
            return before
        found = None
        for g in range(self.count):
            size = self.sizes[g]
            bucket = fp >> self.shifts[g]
            if not size or not (self.bitmaps[g][bucket >> 3] >> (bucket & 7)) & 1:
                continue
            keys = self.keys[g]
            lo = self.first_at_least(g, fp)
            if lo == size or keys[lo] != fp:
                continue
            hi = lo + 1
            while hi < size and keys[hi] == fp:
                hi += 1
            got = tuple([self.values[g][j] for j in range(lo, hi)])
            found = got if found is None else found + got
        if found is None:
            return before
        return before + found if before else found


# --- which tenants used a word (``detector.Vocabulary``) --------------------------------


ctypedef struct WordEntry:
    uint64_t unit
    # 0: an empty slot. Odd: one tenant used the word, number << 1 | 1. Else a pointer to
    # its bitset: word 0 holds the 64-bit words that follow and, above bit 32, the users.
    uintptr_t users


# A bitset's word 0, below bit 32: how many 64-bit words follow. Typed: a literal this
# large in an expression made Cython compute it with Python ints, on every word learned.
cdef uint64_t BITSET_WORDS = 0xFFFFFFFF


@cython.final
cdef class WordUsers:
    """Which tenants used each word (a keyed unit hash), for tenants numbered below
    ``bitset_tenants``: an open-addressing table (linear probing, backward-shift
    deletion, at most 3/4 full) of 16-byte entries, a word's users being its one
    tenant's number or a bitset of their numbers. ``detector.Vocabulary`` keeps the
    plain words, and the words of later tenants by name, itself. It replaces a dict of
    Python ints that took ~90 bytes a word and microseconds to update. Numbers only,
    no text."""

    cdef WordEntry* table
    cdef Py_ssize_t capacity  # a power of two
    cdef Py_ssize_t count
    cdef Py_ssize_t bitset_bytes
    cdef readonly uint32_t bitset_tenants

    def __cinit__(self, uint32_t bitset_tenants):
        self.bitset_tenants = bitset_tenants
        self.capacity = 1024
        self.table = <WordEntry*>calloc(self.capacity, sizeof(WordEntry))
        if self.table == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.table != NULL:
            self._free_bitsets()
            free(self.table)

    def __len__(self):
        return self.count

    @property
    def nbytes(self):
        """The table's and the bitsets' bytes."""
        return self.capacity * sizeof(WordEntry) + self.bitset_bytes

    cdef void _free_bitsets(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.capacity):
            if self.table[i].users and not self.table[i].users & 1:
                free(<void*>self.table[i].users)
        self.bitset_bytes = 0

    cdef Py_ssize_t _slot(self, uint64_t unit) noexcept:
        """The slot holding ``unit``, or the empty one where it would go."""
        cdef Py_ssize_t mask = self.capacity - 1
        cdef Py_ssize_t i = <Py_ssize_t>(mix64(unit) & <uint64_t>mask)
        while self.table[i].users and self.table[i].unit != unit:
            i = (i + 1) & mask
        return i

    cdef int _insert(self, Py_ssize_t i, uint64_t unit, uint32_t number) except -1:
        cdef Py_ssize_t old_capacity = self.capacity, j
        cdef WordEntry* old = self.table
        self.table[i].unit, self.table[i].users = unit, (<uintptr_t>number << 1) | 1
        self.count += 1
        if self.count * 4 <= self.capacity * 3:
            return 0
        self.table = <WordEntry*>calloc(old_capacity * 2, sizeof(WordEntry))
        if self.table == NULL:
            self.table = old
            raise MemoryError()
        self.capacity = old_capacity * 2
        for j in range(old_capacity):
            if old[j].users:
                self.table[self._slot(old[j].unit)] = old[j]
        free(old)
        return 0

    cdef void _remove(self, Py_ssize_t i) noexcept:
        """Empty slot ``i``, moving back the entries after it that probed past it."""
        cdef Py_ssize_t mask = self.capacity - 1, j = i, home
        cdef uintptr_t users = self.table[i].users
        if not users & 1:
            self.bitset_bytes -= (((<uint64_t*>users)[0] & BITSET_WORDS) + 1) * sizeof(uint64_t)
            free(<void*>users)
        while True:
            j = (j + 1) & mask
            if not self.table[j].users:
                break
            home = <Py_ssize_t>(mix64(self.table[j].unit) & <uint64_t>mask)
            if (i < home <= j) if i <= j else (i < home or home <= j):
                continue  # its home is after the hole: it stays
            self.table[i] = self.table[j]
            i = j
        self.table[i].users = 0
        self.count -= 1

    cdef uint32_t _add_user(self, WordEntry* e, uint32_t number) except 0:
        """Count ``number`` among the word's users: their count after it, or 1 when it
        was one of them already (the caller's "no change")."""
        cdef uint64_t* bits
        cdef uint64_t words, have, first
        if e.users & 1:
            first = e.users >> 1
            if first == number:
                return 1
            words = max(first, number) // 64 + 1
            bits = <uint64_t*>calloc(words + 1, sizeof(uint64_t))
            if bits == NULL:
                raise MemoryError()
            bits[0] = words | (<uint64_t>1 << 32)
            bits[1 + (first >> 6)] |= 1ULL << (first & 63)
            self.bitset_bytes += (words + 1) * sizeof(uint64_t)
            e.users = <uintptr_t>bits
        bits = <uint64_t*>e.users
        have = bits[0] & BITSET_WORDS
        if number >> 6 >= have:
            words = number // 64 + 1
            bits = <uint64_t*>realloc(bits, (words + 1) * sizeof(uint64_t))
            if bits == NULL:
                raise MemoryError()
            memset(bits + 1 + have, 0, (words - have) * sizeof(uint64_t))
            self.bitset_bytes += (words - have) * sizeof(uint64_t)
            bits[0] += words - have
            e.users = <uintptr_t>bits
        elif bits[1 + (number >> 6)] >> (number & 63) & 1:
            return 1
        bits[1 + (number >> 6)] |= 1ULL << (number & 63)
        bits[0] += <uint64_t>1 << 32
        return <uint32_t>(bits[0] >> 32)

    def learn(self, units, uint32_t number, double needed, HotTable plain, dict named,
              Py_ssize_t max_entries):
        """Tenant ``number``'s use of ``units`` (a ``Column`` or a list of ints; below
        ``bitset_tenants``): a word it is the ``needed``-th tenant of goes to ``plain``
        (the vocabulary's table of plain words) and is forgotten here. Plain words are
        skipped; words in ``named`` (users kept by name) are returned, in order, for the
        caller to count. Before a new word makes the words here and in ``named`` reach
        ``max_entries``, both are cleared (rare words of the past)."""
        if number >= self.bitset_tenants:
            raise ValueError("WordUsers.learn: the tenant's number is past the bitset's")
        cdef Column column = as_column(units)
        cdef const uint64_t* data = column.data
        cdef list by_name = []
        cdef Py_ssize_t i, at, n = column.size
        cdef uint32_t users
        cdef uint64_t unit
        cdef const WordEntry* near
        cdef uint64_t mask = <uint64_t>(self.capacity - 1)
        for at in range(n):
            if at + AHEAD < n:
                prefetch(&self.table[mix64(data[at + AHEAD]) & mask])
                plain.prefetch(data[at + AHEAD])
            if at + AHEAD // 2 < n:
                # Its entry asked for AHEAD words ago: a word of several users points to
                # a bitset, a second cache miss, asked for now. (A word of the bitset
                # past its end, for a tenant it has no room for yet, is only an address:
                # a prefetch never faults.) A word in a slot past its home is not asked.
                near = &self.table[mix64(data[at + AHEAD // 2]) & mask]
                if near.unit == data[at + AHEAD // 2] and near.users and not near.users & 1:
                    prefetch(<const uint64_t*>near.users + 1 + (number >> 6))
            unit = data[at]
            if plain.has(unit):
                continue
            if named and unit in named:
                by_name.append(unit)
                continue
            i = self._slot(unit)
            if not self.table[i].users:
                if self.count + len(named) >= max_entries:
                    self.clear()
                    named.clear()
                    i = self._slot(unit)
                self._insert(i, unit, number)
                continue
            users = self._add_user(&self.table[i], number)
            if users > 1 and users >= needed:
                plain.put(unit, 1, False)
                self._remove(i)
        return by_name

    cdef list _numbers(self, Py_ssize_t i):
        cdef uintptr_t users = self.table[i].users
        cdef uint64_t* bits = <uint64_t*>users
        cdef uint64_t w, b
        if users & 1:
            return [users >> 1]
        return [w * 64 + b for w in range(bits[0] & BITSET_WORDS) for b in range(64)
                if bits[1 + w] >> b & 1]

    def pop(self, uint64_t unit):
        """Forget ``unit``: its users' numbers, ascending, or None when it is not here."""
        cdef Py_ssize_t i = self._slot(unit)
        if not self.table[i].users:
            return None
        numbers = self._numbers(i)
        self._remove(i)
        return numbers

    def clear(self):
        self._free_bitsets()
        memset(self.table, 0, self.capacity * sizeof(WordEntry))
        self.count = 0

    def items(self):
        """``(unit, [numbers])`` of every word, in table order."""
        cdef Py_ssize_t i
        return [(self.table[i].unit, self._numbers(i))
                for i in range(self.capacity) if self.table[i].users]

    def __reduce__(self):
        return _word_users, (self.bitset_tenants, self.items())


def _word_users(uint32_t bitset_tenants, list items):
    """A pickled ``WordUsers`` again."""
    cdef WordUsers users = WordUsers(bitset_tenants)
    cdef Py_ssize_t i
    for unit, numbers in items:
        users._insert(users._slot(unit), unit, numbers[0])
        i = users._slot(unit)  # the insert may have grown the table
        for number in numbers[1:]:
            users._add_user(&users.table[i], number)
    return users


# --- the index's hot generation ---------------------------------------------------------


cdef enum:
    HOT_MIN_SLOTS = 1024  # a power of two; a table at most half full doubles


@cython.final
cdef class HotTable:
    """The hot generation of a ``FingerprintIndex``: each fingerprint's first value, in
    an open-addressing table of 64-bit keys and 32-bit values (12 bytes a slot, at most
    half of them full), where a dict took ~100 bytes an entry: an int object for each
    key and value, and a hash of each on every probe. Reads as a mapping of ints (``in``,
    ``[]``, ``get``, ``keys``, ``items``, ``len``); the compiled step probes it with no
    object made. Empty slots hold key 0, so fingerprint 0 is kept beside the table. It
    holds no objects: the garbage collector never sees it. A key out of the 64-bit
    range raises ``OverflowError``, as the frozen generations' columns would."""

    cdef uint64_t* slot_keys
    cdef uint32_t* slot_values
    cdef Py_ssize_t capacity, count
    cdef bint has_zero
    cdef uint32_t zero_value

    def __cinit__(self, items=()):
        self.slot_keys, self.slot_values = NULL, NULL
        self.capacity = self.count = 0
        self.has_zero, self.zero_value = False, 0
        self._allocate(HOT_MIN_SLOTS)
        for key, value in items:
            self.put(key, value, True)

    def __dealloc__(self):
        free(self.slot_keys)
        free(self.slot_values)

    cdef int _allocate(self, Py_ssize_t capacity) except -1:
        """Empty arrays of ``capacity`` slots in place of the current ones (freed)."""
        cdef uint64_t* keys = <uint64_t*>calloc(capacity, sizeof(uint64_t))
        cdef uint32_t* values = <uint32_t*>malloc(capacity * sizeof(uint32_t))
        if keys == NULL or values == NULL:
            free(keys)
            free(values)
            raise MemoryError()
        free(self.slot_keys)
        free(self.slot_values)
        self.slot_keys, self.slot_values, self.capacity = keys, values, capacity
        return 0

    cdef inline Py_ssize_t _slot(self, uint64_t key) noexcept:
        """The slot of ``key`` (not 0): where it is, or the empty one where it goes."""
        cdef uint64_t mask = <uint64_t>self.capacity - 1
        cdef uint64_t i = mix64(key) & mask
        while self.slot_keys[i] != 0 and self.slot_keys[i] != key:
            i = (i + 1) & mask
        return <Py_ssize_t>i

    cdef inline bint find(self, uint64_t key, uint32_t* value) noexcept:
        """Whether ``key`` is held; its value written to ``value`` when it is."""
        cdef Py_ssize_t i
        if key == 0:
            value[0] = self.zero_value
            return self.has_zero
        i = self._slot(key)
        if self.slot_keys[i] == 0:
            return False
        value[0] = self.slot_values[i]  # an empty slot's value is never set: not read
        return True

    cdef inline bint has(self, uint64_t key) noexcept:
        cdef uint32_t value
        return self.find(key, &value)

    cdef inline void prefetch(self, uint64_t key) noexcept:
        """Start loading the slot where ``find`` starts probing for ``key``."""
        prefetch(&self.slot_keys[mix64(key) & (<uint64_t>self.capacity - 1)])

    cdef int put(self, uint64_t key, uint32_t value, bint replace) except -1:
        """Add ``key`` with ``value``: 1, or 0 when it is held already (its value then
        replaced if ``replace``)."""
        cdef Py_ssize_t i
        if key == 0:
            if not self.has_zero:
                self.has_zero, self.zero_value = True, value
                self.count += 1
                return 1
            if replace:
                self.zero_value = value
            return 0
        i = self._slot(key)
        if self.slot_keys[i] != 0:
            if replace:
                self.slot_values[i] = value
            return 0
        if 2 * (self.count + 1) > self.capacity:
            self._grow()
            i = self._slot(key)
        self.slot_keys[i], self.slot_values[i] = key, value
        self.count += 1
        return 1

    cdef int _grow(self) except -1:
        cdef uint64_t* old_keys = self.slot_keys
        cdef uint32_t* old_values = self.slot_values
        cdef Py_ssize_t old_capacity = self.capacity, j, i
        self.slot_keys, self.slot_values = NULL, NULL  # kept by _allocate's failure, freed below
        try:
            self._allocate(2 * old_capacity)
        except MemoryError:
            self.slot_keys, self.slot_values = old_keys, old_values
            raise
        for j in range(old_capacity):
            if old_keys[j] != 0:
                i = self._slot(old_keys[j])
                self.slot_keys[i], self.slot_values[i] = old_keys[j], old_values[j]
        free(old_keys)
        free(old_values)
        return 0

    def __len__(self):
        return self.count

    def __contains__(self, key):
        return self.has(<uint64_t>key)

    def __getitem__(self, key):
        cdef uint32_t value
        if not self.find(<uint64_t>key, &value):
            raise KeyError(key)
        return value

    def __setitem__(self, key, value):
        self.put(key, value, True)

    def get(self, key, default=None):
        cdef uint32_t value
        return value if self.find(<uint64_t>key, &value) else default

    def keys(self):
        """The keys, in table order (``dict(table)`` reads them, then each value)."""
        return [key for key, _ in self.items()]

    def items(self):
        cdef Py_ssize_t i
        cdef list out = [(0, self.zero_value)] if self.has_zero else []
        for i in range(self.capacity):
            if self.slot_keys[i] != 0:
                out.append((self.slot_keys[i], self.slot_values[i]))
        return out

    def __iter__(self):
        return iter(self.keys())

    def clear(self, bint keep_slots=False):
        """Empty, and back to the smallest table (an idle index's memory goes); or, with
        ``keep_slots``, the same slots emptied (a table that will fill again: regrown
        from the smallest, it rehashed each key about twice on the way)."""
        if keep_slots:
            memset(self.slot_keys, 0, self.capacity * sizeof(uint64_t))
        else:
            self._allocate(HOT_MIN_SLOTS)
        self.count, self.has_zero = 0, False

    def absent(self, fingerprints):
        """The fingerprints (any iterable of ints) this table does not hold, in order."""
        return [fp for fp in fingerprints if not self.has(<uint64_t>fp)]

    def add_new(self, list fingerprints, uint32_t value):
        """Each of ``fingerprints`` not held yet, added with ``value``; how many were."""
        cdef Py_ssize_t added = 0
        for fp in fingerprints:
            added += self.put(<uint64_t>fp, value, False)
        return added

    def add_fresh(self, list fingerprints, uint32_t value, Py_ssize_t room):
        """Each of ``fingerprints`` this table does not hold, added with ``value`` while
        fewer than ``room`` were. Returns how many were added, and the keys left for the
        caller, once each and in order: those held with another value, and the new ones
        after the room ran out. A key held with ``value`` (added here, or before) needs
        nothing more."""
        cdef Py_ssize_t i, n = len(fingerprints), added = 0
        cdef uint32_t held
        cdef uint64_t key
        cdef list rest = []
        cdef set left = None
        for i in range(n):
            if i + AHEAD < n:
                self.prefetch(<uint64_t>fingerprints[i + AHEAD])
            fp = fingerprints[i]
            key = <uint64_t>fp
            if self.find(key, &held):
                if held == value:
                    continue
            elif added < room:
                added += self.put(key, value, False)
                continue
            if left is None:
                left = set()
            if fp not in left:
                left.add(fp)
                rest.append(fp)
        return added, rest

    def add_keys(self, const uint64_t[::1] keys, uint32_t value):
        """``add_new`` of a uint64 array's keys, read in place: a prompt's units, with no
        int object made for each (a frozenset of them took ~30 us a prompt)."""
        cdef Py_ssize_t i, added = 0
        for i in range(keys.shape[0]):
            added += self.put(keys[i], value, False)
        return added

    def values_into(self, fingerprints, dict more, list result):
        """``result[i]`` = the values of ``fingerprints[i]``, when this table holds it:
        ``more``'s tuple for a key with several, else a tuple of its one value. Returns
        ``result`` (the lookup goes on in the frozen generations)."""
        cdef Py_ssize_t i, n = len(fingerprints)
        cdef uint32_t value
        if len(result) != n:
            raise ValueError("values_into: result and fingerprints differ in length")
        for i in range(n):
            if i + AHEAD < n:
                self.prefetch(<uint64_t>fingerprints[i + AHEAD])
            fp = fingerprints[i]
            if self.find(<uint64_t>fp, &value):
                result[i] = self.values_of(fp, value, more)
        return result

    cdef inline tuple values_of(self, fp, uint32_t value, dict more):
        """The values of ``fp``, held here with ``value`` first: ``more``'s tuple for a
        key with several (keyed by int), else a tuple of ``value``."""
        return (more.get(fp) if more else None) or (value,)

    def columns(self, uint64_t[::1] keys, uint32_t[::1] values):
        """The keys and their values into ``keys`` and ``values`` (as long as the table),
        in table order: a generation about to be sorted."""
        if keys.shape[0] != self.count or values.shape[0] != self.count:
            raise ValueError("HotTable.columns: the columns do not fit the table")
        cdef Py_ssize_t i, n = 0
        if self.has_zero:
            keys[0], values[0] = 0, self.zero_value
            n = 1
        for i in range(self.capacity):
            if self.slot_keys[i] != 0:
                keys[n], values[n] = self.slot_keys[i], self.slot_values[i]
                n += 1

    def __reduce__(self):
        return HotTable, (self.items(),)


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
cdef class Column:
    """A growable array of unsigned 64-bit ints that reads like a list of ints: a
    choice's unit hashes, offsets, weights and running sums. The compiled step appends
    to it without making an int object per value (three of them per word, as lists);
    Python indexes, slices (a list), iterates and extends it as a list, and numpy reads
    it through the buffer protocol (``np.array(column, dtype=...)`` copies it at once).
    It holds no objects, so the garbage collector never sees it. While a buffer of it is
    exported it cannot grow (``BufferError``, as ``bytearray``)."""

    cdef uint64_t* data
    cdef Py_ssize_t size, capacity
    cdef Py_ssize_t exports
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __cinit__(self, values=None):
        self.data = NULL
        self.size = self.capacity = self.exports = 0
        if values is not None:
            self.extend(values)

    def __dealloc__(self):
        free(self.data)

    cdef int grow(self, Py_ssize_t needed) except -1:
        if self.exports:
            raise BufferError("Column: cannot grow while a buffer of it is exported")
        # From 64: a choice's columns grow with its units, ~150 in a typical answer.
        cdef Py_ssize_t capacity = max(64, self.capacity * 2, needed)
        cdef uint64_t* data = <uint64_t*>realloc(self.data, capacity * sizeof(uint64_t))
        if data == NULL:
            raise MemoryError()
        self.data, self.capacity = data, capacity
        return 0

    cdef inline int push(self, uint64_t value) except -1:
        if self.size == self.capacity:
            self.grow(self.size + 1)
        self.data[self.size] = value
        self.size += 1
        return 0

    cdef inline uint64_t last(self) noexcept:
        """The newest value; 0 when empty."""
        return self.data[self.size - 1] if self.size else 0

    cdef Py_ssize_t position(self, Py_ssize_t i) except -1:
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError("Column index out of range")
        return i

    cdef int resizable(self) except -1:
        if self.exports:
            raise BufferError("Column: cannot resize while a buffer of it is exported")
        return 0

    def append(self, value):
        self.resizable()
        self.push(<uint64_t>value)

    def extend(self, values):
        """Append ``values`` (ints that fit 64 unsigned bits): all of them, or none when
        one does not fit or a buffer of the column is exported."""
        self.resizable()
        self.extend_from(values)

    cdef int extend_from(self, values) except -1:
        cdef Column other
        cdef Py_ssize_t i, n
        if isinstance(values, Column):
            other = values
            n = other.size
            if n == 0:
                return 0  # memcpy may not take the NULL of an empty column, even for 0 bytes
            if self.size + n > self.capacity:
                self.grow(self.size + n)
            memcpy(self.data + self.size, other.data, n * sizeof(uint64_t))
            self.size += n
            return 0
        if not isinstance(values, (list, tuple)):
            values = list(values)
        n = len(values)
        if self.size + n > self.capacity:
            self.grow(self.size + n)
        for i in range(n):
            # Written past the size, which moves only once all fit: an OverflowError
            # leaves the column as it was.
            self.data[self.size + i] = <uint64_t>values[i]
        self.size += n
        return 0

    def pop(self):
        cdef Py_ssize_t i = self.position(-1)
        self.resizable()
        self.size = i
        return self.data[i]

    def tolist(self):
        return self.slice(0, self.size)

    cdef list slice(self, Py_ssize_t start, Py_ssize_t stop):
        cdef list out = []
        cdef Py_ssize_t i
        for i in range(start, stop):
            out.append(self.data[i])
        return out

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        cdef Py_ssize_t start, stop, step
        if isinstance(index, slice):
            start, stop, step = index.indices(self.size)
            if step == 1:
                return self.slice(start, stop) if start < stop else []
            return [self.data[i] for i in range(start, stop, step)]
        return self.data[self.position(index)]

    def __iter__(self):
        cdef Py_ssize_t i = 0
        while i < self.size:  # reads the size each time: safe while it grows
            yield self.data[i]
            i += 1

    def __repr__(self):
        return f"Column({self.tolist()!r})"

    def __eq__(self, other):
        """Equal to a Column, list or tuple of the same ints in the same order."""
        if not isinstance(other, (Column, list, tuple)):
            return NotImplemented
        return self.tolist() == list(other)

    __hash__ = None  # mutable, as a list

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("Column: a read-only buffer")
        self.shape[0] = self.size
        self.strides[0] = sizeof(uint64_t)
        buffer.buf = <void*>self.data
        buffer.obj = self
        buffer.len = self.size * sizeof(uint64_t)
        buffer.itemsize = sizeof(uint64_t)
        buffer.readonly = 1
        buffer.ndim = 1
        buffer.format = NULL
        if flags & PyBUF_FORMAT:
            buffer.format = b"Q"
        buffer.shape = self.shape if flags & PyBUF_ND else NULL
        buffer.strides = self.strides if flags & PyBUF_STRIDES else NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer* buffer):
        self.exports -= 1


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
    the steps of ``scan_kgrams``), the others are done here as ``_learn_from`` does
    them (the private k-grams indexed as this output's, the uses queued for the
    sketch). ``step`` returns the delta's findings. The only written copy of the scan:
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
    # What the slow path (scan_kgrams) reads of the engine: its window of requests, the
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
    cdef Py_ssize_t grams_capacity
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
        the columns (``StreamTokenizer.flush`` and ``ResponseScan.add_batch``). Returns ``(first, k-grams)``:
        the new k-grams and the index of the first, for ``scan_kgrams`` to finish."""
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
        cdef Py_ssize_t first = max(0, before - self.k + 1)
        return first, kgrams_from(columns.hashes.data, columns.hashes.size, first, self.k)

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
        return self._classify(response, columns, choice, first, n)

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
                        Py_ssize_t first, Py_ssize_t n):
        """The classification of the ``n`` k-grams in ``grams``, the first at unit
        ``first``, and what the output learns from them; the findings, or None. Owned
        but common k-grams (shared system prompts, popular questions) and k-grams only
        this tenant holds (its prompt echoed, its earlier answers) are no evidence of a
        leak: handled here as ``scan_kgrams`` would handle them. One that
        is not common and has an owner other than this tenant's requests of the window
        may be foreign: those take the slow path (``_scan_held``)."""
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
            return self._scan_held(response, state, choice, first, n, held, tenant_owned)
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
                         Py_ssize_t first, Py_ssize_t n, Py_ssize_t held, set tenant_owned):
        """``_classify`` of a delta with ``held`` k-grams another request may hold (at
        ``held_at``): those are classified and matched as ``scan_kgrams`` would, the
        others as ``_classify`` does, and the delta is learned in its order, by the calls
        ``scan_kgrams`` on all of them makes. Like it, all is read before anything is
        written: the sketch and the index change only once every k-gram is classified.
        A whole response with one such k-gram no longer takes the slow path for all."""
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
        return self._fragment_findings(response, state, choice, matched.touched)

    def classify(self, dict requests, str tenant, list fps):
        """``Engine._classify``: per k-gram, whether it is still private (not common,
        held by fewer than 64 values, in neither the baseline nor its corpus) and its
        owners in the index; and the k-grams whose use by ``tenant`` the sketch must
        count (not common, and held by none of the tenant's requests in ``requests``)."""
        return self._classify_all(requests, tenant, fps)

    def classify_prompt(self, dict requests, str tenant, list fps, Py_ssize_t start,
                        Py_ssize_t stop):
        """``Engine._classify_prompt``: of ``fps[start:stop]``, the private k-grams and
        the ones whose use by ``tenant`` the sketch must count, in order (``classify``'s
        answers, without the owners a prompt does not need). Only a k-gram that is not
        common and that the index holds is looked up, all of a call's at once."""
        stop = min(stop, len(fps))
        cdef IndexFields index = self.index
        cdef HotTable hot = index._hot
        cdef FrozenGenerations frozen = index._frozen
        if frozen is None:
            frozen = self.index.frozen()
        cdef const unsigned short* flat = &self.flat[0]
        cdef Py_ssize_t i, n = stop - start
        cdef uint64_t fp
        cdef list held = []
        # 0: common; 1: not held; 2: held (its owners decide)
        cdef bytearray kinds = bytearray(max(n, 0))
        for i in range(start, stop):
            if i + AHEAD < stop:
                fp = <uint64_t>fps[i + AHEAD]
                prefetch(flat + sketch_cell(self.seeds, 0, self.mask, self.width, fp))
                hot.prefetch(fp)
            fp = <uint64_t>fps[i]
            if not sketch_below(flat, self.seeds, self.depth, self.mask, self.width, fp,
                                self.common_tenants):
                continue
            if hot.has(fp) or (frozen is not None and frozen.holds(fp)):
                kinds[i - start] = 2
                held.append(fps[i])
            else:
                kinds[i - start] = 1
        cdef list owners = self.index.lookup(held) if held else held
        cdef list private = [], unowned = []
        cdef Py_ssize_t j = 0
        cdef bint keep
        for i in range(start, stop):
            kind = kinds[i - start]
            if not kind:
                continue
            item = fps[i]
            keep = True
            if kind == 2:
                values = owners[j]
                j += 1
                keep = distinct_holders(requests, values)
                if not (values and owned_by(requests, tenant, values)):
                    unowned.append(item)
            else:
                unowned.append(item)
            if keep and not self._public(<uint64_t>item):
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

    cpdef list scan_kgrams(self, ScanFields response, ChoiceColumns state, choice,
                           Py_ssize_t first, list fps, bint final=False):
        """The fragment scan proper: classify and match the k-grams the newest units
        completed (the first at unit ``first``), then learn from them. Returns the
        findings. Beside the index's own methods (``lookup``, ``add_many``), Python runs
        only to count uses of text in the sketch (``Engine._count_use``) and to report a
        run that is evidence (``ResponseScan._fragment_finding``)."""
        if not fps:
            if not final:
                return []
            state.complete = True  # candidates that waited for a next unit decide now
            return self._fragment_findings(response, state, choice, set(state.runs))
        cdef Matched matched = self._match(response, state, first, fps, NULL)
        state.private_kgrams += matched.kept
        self._learn_from(response, matched.unowned, matched.holders,
                         [fp for fp in fps if fp in matched.private])
        if final:
            # Every unit has arrived: candidates that waited for their next unit decide.
            state.complete = True
            matched.touched.update(state.runs)
        return self._fragment_findings(response, state, choice, matched.touched)

    cdef Matched _match(self, ScanFields response, ChoiceColumns state, Py_ssize_t first,
                        list fps, const Py_ssize_t* at):
        """The slow path's reading of ``fps`` (``at[i]`` the place of ``fps[i]`` among
        the new k-grams, the first at unit ``first``; NULL: one after the other):
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
                state._cover(value, first + (i if at == NULL else at[i]), self.k, fps[i],
                             self._specific_units(value))
                matched.touched.add(value)
            if foreign:
                # Another tenant's text in this output is not this tenant's text: it must
                # not make a later leak of it to the same tenant look like its own.
                matched.private.discard(fps[i])
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
        if matches:  # most deltas meet no entity
            found += response._met_entities(state, choice, matches)
    state.batches.push(state.hashes.size)
    clock.sequence += 1
    state.seqs.push(clock.sequence)
    return found


#: Values of one k-gram (requests that hold it) past which it is text many share, unless
#: they are all one tenant's.
cdef Py_ssize_t FULL_VALUES = 64


cpdef bint distinct_holders(dict requests, values) except -1:
    """Whether a k-gram held by ``values`` can still be private: fewer than
    ``FULL_VALUES``, or all of them one tenant's (a sentence that tenant sends in every
    request is still its own, however many of its requests hold it; text that many
    requests of several tenants hold is shared). Expired values are skipped."""
    if len(values) < FULL_VALUES:
        return True
    tenant = None
    for value in values:
        record = requests.get(value >> 1)
        if record is None:
            continue
        if tenant is None:
            tenant = (<RequestRecord>record).tenant
        elif (<RequestRecord>record).tenant != tenant:
            return False
    return True


cdef bint owned_by(dict requests, str tenant, values) except -1:
    """One of the requests ``values`` name (slot << 1 | output bit) is ``tenant``'s."""
    for value in values:
        record = requests.get(value >> 1)
        if record is not None and (<RequestRecord>record).tenant == tenant:
            return True
    return False


# --- what a text needs for an entity pattern to match ----------------------------------
# One pass over a text says which of ``entities._PATTERNS`` can match in it at all: each
# condition is implied by its pattern (a text that fails it cannot match), and prose fails
# nearly all. The regex tests these replace took ~40 us a kilobyte; iban and national_id
# had none and ran their patterns at every position (~25 us).

cdef enum:
    NEEDS_EMAIL = 1  # "@"
    NEEDS_URL = 2  # "://"
    NEEDS_API_KEY = 4  # sk-, gh[pousr]_, AKIA, AIza, xox[abpr]-, eyJ
    NEEDS_IBAN = 8  # two capitals, two digits
    NEEDS_CARD = 16  # 13 digits, one space or hyphen at most between two
    NEEDS_NATIONAL_ID = 32  # d-dd-d, or two capitals and six digits
    NEEDS_PHONE = 64  # + and a digit of any script, or (ddd) in any script
    NEEDS_DIGIT_ID = 128  # seven digits
    NEEDS_TOKEN = 256  # 24 of [A-Za-z0-9_-]

ENTITY_NEEDS = {
    "email": NEEDS_EMAIL, "url_secret": NEEDS_URL, "api_key": NEEDS_API_KEY,
    "iban": NEEDS_IBAN, "card": NEEDS_CARD, "national_id": NEEDS_NATIONAL_ID,
    "phone": NEEDS_PHONE, "digit_id": NEEDS_DIGIT_ID, "token": NEEDS_TOKEN,
}


# A text's characters as stored: one, two or four bytes each. The prefilter's loop is
# made once per width, so that reading a character is a load, not a switch on the width.
ctypedef fused stored_char:
    uint8_t
    uint16_t
    uint32_t


cdef inline bint has_at(const stored_char* data, Py_ssize_t n, Py_ssize_t i,
                        const char* literal) noexcept:
    """``text[i:]`` starts with the ASCII ``literal`` ('?' matches any character)."""
    cdef Py_ssize_t j = 0
    while literal[j]:
        if i + j >= n:
            return False
        if literal[j] != b'?' and <Py_UCS4>data[i + j] != <Py_UCS4>literal[j]:
            return False
        j += 1
    return True


cdef inline bint is_ascii_digit(Py_UCS4 c) noexcept:
    return 48 <= c <= 57


cdef inline bint is_decimal_at(const stored_char* data, Py_ssize_t n, Py_ssize_t i) noexcept:
    return i < n and Py_UNICODE_ISDECIMAL(data[i])


def entity_needs(str text):
    """The ``NEEDS_*`` bits (``ENTITY_NEEDS``, by kind) of what ``text`` contains: a
    kind whose bit is clear cannot match in it."""
    cdef int kind = PyUnicode_KIND(text)
    cdef const void* data = PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    if kind == PyUnicode_1BYTE_KIND:
        return needs_of(<const uint8_t*>data, n)
    if kind == PyUnicode_2BYTE_KIND:
        return needs_of(<const uint16_t*>data, n)
    return needs_of(<const uint32_t*>data, n)


cdef unsigned int needs_of(const stored_char* data, Py_ssize_t n) noexcept:
    """``entity_needs`` of the ``n`` characters at ``data``."""
    cdef Py_ssize_t i
    cdef unsigned int found = 0
    cdef Py_UCS4 c, nxt
    # Runs ending at the character before: ASCII digits, [A-Za-z0-9_-], capitals, the
    # capitals before the current run of digits, and the card's digits (state: 0 other,
    # 1 after a digit, 2 after one separator that followed a digit).
    cdef Py_ssize_t digits = 0, word = 0, upper = 0, upper_before = 0, card = 0
    cdef int card_state = 0
    for i in range(n):
        c = data[i]
        if c == 64:  # @
            found |= NEEDS_EMAIL
        elif c == 58:  # :
            if has_at(data, n, i, b"://"):
                found |= NEEDS_URL
        elif c == 43:  # +
            if is_decimal_at(data, n, i + 1):
                found |= NEEDS_PHONE
        elif c == 40:  # (
            if (is_decimal_at(data, n, i + 1) and is_decimal_at(data, n, i + 2)
                    and is_decimal_at(data, n, i + 3) and has_at(data, n, i + 4, b")")):
                found |= NEEDS_PHONE
        # An API key's prefix, asked only of the character it starts with ("s" and "e"
        # are a sixth of English text).
        elif c == 115:  # s
            if has_at(data, n, i, b"sk-"):
                found |= NEEDS_API_KEY
        elif c == 101:  # e
            if has_at(data, n, i, b"eyJ"):
                found |= NEEDS_API_KEY
        elif c == 65:  # A
            if has_at(data, n, i, b"AKIA") or has_at(data, n, i, b"AIza"):
                found |= NEEDS_API_KEY
        elif c == 103:  # g
            if has_at(data, n, i, b"gh?_"):
                nxt = data[i + 2]
                if nxt == 112 or nxt == 111 or nxt == 117 or nxt == 115 or nxt == 114:  # pousr
                    found |= NEEDS_API_KEY
        elif c == 120:  # x
            if has_at(data, n, i, b"xox?-"):
                nxt = data[i + 3]
                if nxt == 97 or nxt == 98 or nxt == 112 or nxt == 114:  # abpr
                    found |= NEEDS_API_KEY
        if is_ascii_digit(c):
            if digits == 0:
                upper_before = upper
            digits += 1
            if digits >= 7:
                found |= NEEDS_DIGIT_ID
            if upper_before >= 2:
                if digits >= 2:
                    found |= NEEDS_IBAN
                if digits >= 6:
                    found |= NEEDS_NATIONAL_ID
            if (i >= 5 and data[i - 1] == 45 and is_ascii_digit(data[i - 2])
                    and is_ascii_digit(data[i - 3]) and data[i - 4] == 45
                    and is_ascii_digit(data[i - 5])):
                found |= NEEDS_NATIONAL_ID
            card = card + 1 if card_state else 1
            card_state = 1
            if card >= 13:
                found |= NEEDS_CARD
        else:
            digits = 0
            if (c == 32 or c == 45) and card_state == 1:
                card_state = 2
            else:
                card_state, card = 0, 0
        upper = upper + 1 if 65 <= c <= 90 else 0
        if (48 <= c <= 57) or (65 <= c <= 90) or (97 <= c <= 122) or c == 95 or c == 45:
            word += 1
            if word >= 24:
                found |= NEEDS_TOKEN
        else:
            word = 0
    return found


# --- the entity scan's per-delta step --------------------------------------------------


cdef uint64_t GRAM_BASE = 0x100003ULL  # the final gram's polynomial base

cdef enum:
    FINAL_GRAM = 6  # characters of a key's end that the prefilter hashes (MIN_ENTITY_CHARS)
    FINAL_BITS = 22  # a 512 KiB bitmap, two bits a key: 10,000 keys pass ~1 delta in 10,000
    GRAMS_AHEAD = 8  # a power of two: grams whose bitmap bytes are asked for at once


cdef inline uint64_t final_gram(int kind, const void* data, Py_ssize_t end) noexcept:
    """The polynomial hash of the ``FINAL_GRAM`` characters that end at ``end``
    (``final_bits`` makes the bitmap's two bits of it)."""
    cdef uint64_t h = 0
    cdef Py_ssize_t i
    for i in range(end - FINAL_GRAM + 1, end + 1):
        h = h * GRAM_BASE + <uint64_t>PyUnicode_READ(kind, <void*>data, i)
    return h


cdef inline void final_bits(uint64_t gram, uint64_t* a, uint64_t* b) noexcept:
    """A gram's two bits in the prefilter's bitmap: the top ``FINAL_BITS`` bits of one
    multiplication, and the next ``FINAL_BITS`` (multiplicative hashing: one multiply a
    character, where ``mix64`` took five operations)."""
    cdef uint64_t h = gram * PRIME
    a[0] = h >> (64 - FINAL_BITS)
    b[0] = (h >> (64 - 2 * FINAL_BITS)) & ((<uint64_t>1 << FINAL_BITS) - 1)


cdef inline uint64_t char_at(const Py_UCS4* history, Py_ssize_t h, int kind, const void* data,
                             Py_ssize_t i) noexcept:
    """Character ``i`` of ``history[:h]`` followed by the string at ``data``."""
    if i < h:
        return <uint64_t>history[i]
    return <uint64_t>PyUnicode_READ(kind, <void*>data, i - h)


cdef inline bint final_marked(const unsigned char* finals, uint64_t gram) noexcept:
    # The second bit is read only when the first is set: most grams of a delta end no
    # key, and each read of the 512 KiB bitmap is a likely cache miss.
    cdef uint64_t a, b
    final_bits(gram, &a, &b)
    if not (finals[a >> 3] >> (a & 7)) & 1:
        return False
    return (finals[b >> 3] >> (b & 7)) & 1


cdef inline void final_mark(unsigned char* finals, uint64_t gram) noexcept:
    cdef uint64_t a, b
    final_bits(gram, &a, &b)
    finals[a >> 3] |= <unsigned char>(1 << (a & 7))
    finals[b >> 3] |= <unsigned char>(1 << (b & 7))


cdef class EntityIndexFields:
    """What every delta's entity step reads of ``entities.EntityIndex``, as fields: the
    automata's generation, the keys not in an automaton yet, the longest key, and when
    the automata may be rebuilt next (``maybe_rebuild``: at most every
    ``rebuild_interval`` seconds of ``time.monotonic()``, or at 256 pending keys).

    Also a prefilter of the keys: a Bloom filter (two bits) of the last ``FINAL_GRAM``
    characters of every key the automata hold or that is pending (``add_finals``;
    ``clear_finals`` when the automata are rebuilt whole). A delta in which no such tail
    ends meets no key, and most deltas are such: they skip the automata and the pending
    keys' search. With one bit a key, 1,700 keys passed 1% of the engine bench's deltas,
    which then paid for every automaton (its p99)."""

    cdef public long generation
    cdef public list pending
    cdef public Py_ssize_t longest
    cdef public double _last_rebuild
    cdef public double rebuild_interval
    cdef unsigned char* finals
    cdef bint short_keys  # a key shorter than FINAL_GRAM: no prefilter

    def __cinit__(self, *args, **kwargs):
        self.finals = <unsigned char*>calloc(1 << (FINAL_BITS - 3), 1)
        if self.finals == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.finals)

    def add_finals(self, texts):
        """Mark the ends of ``texts``, keys that go into an automaton."""
        cdef str text
        cdef Py_ssize_t n
        for text in texts:
            n = len(text)
            if n < FINAL_GRAM:
                self.short_keys = True
                continue
            final_mark(self.finals, final_gram(PyUnicode_KIND(text), PyUnicode_DATA(text), n - 1))

    def clear_finals(self):
        """Forget every mark: the automata are being rebuilt from ``add_finals``' keys."""
        memset(self.finals, 0, 1 << (FINAL_BITS - 3))
        self.short_keys = False

    def may_end_in(self, str window, Py_ssize_t start):
        """A key of the automata may end at ``window[start:]``: some ``FINAL_GRAM``
        characters that end there end a key (or a key is too short to tell)."""
        cdef Py_UCS4 history[FINAL_GRAM - 1]
        cdef Py_ssize_t h = min(start, FINAL_GRAM - 1), i
        for i in range(h):
            history[i] = window[start - h + i]
        return self._may_end_after(history, h, window[start:])

    cdef bint _may_end_after(self, const Py_UCS4* history, Py_ssize_t h, str delta) noexcept:
        """``may_end_in(history[:h] + delta, h)`` (``h`` < ``FINAL_GRAM``: the characters
        before the delta that a final gram ending in it can reach), with no window
        string made: a rolling hash of the grams, the same as
        ``final_gram``'s (a polynomial modulo 2**64 drops its oldest term exactly).
        In a text of more than ``2 * GRAMS_AHEAD`` grams a gram's bitmap byte is asked
        for ``GRAMS_AHEAD`` characters before it is read, so that the cache misses
        overlap; a short delta's grams are read as they are made (``lag`` 1)."""
        if self.short_keys:
            return True
        cdef int kind = PyUnicode_KIND(delta)
        cdef const void* data = PyUnicode_DATA(delta)
        cdef Py_ssize_t total = h + PyUnicode_GET_LENGTH(delta), end, i, read
        cdef Py_ssize_t lag = GRAMS_AHEAD if total - FINAL_GRAM + 1 > 2 * GRAMS_AHEAD else 1
        cdef uint64_t gram = 0, top = 1, a, b
        cdef uint64_t ahead[GRAMS_AHEAD]  # the grams asked for, not read yet
        if total < FINAL_GRAM:
            return False
        for i in range(FINAL_GRAM - 1):
            top *= GRAM_BASE  # the oldest character's multiplier
        for i in range(FINAL_GRAM - 1):
            gram = gram * GRAM_BASE + char_at(history, h, kind, data, i)
        for end in range(FINAL_GRAM - 1, total + lag - 1):
            if end < total:
                gram = gram * GRAM_BASE + <uint64_t>PyUnicode_READ(kind, <void*>data, end - h)
                if lag > 1:
                    final_bits(gram, &a, &b)
                    prefetch(self.finals + (a >> 3))
                ahead[end & (GRAMS_AHEAD - 1)] = gram
                # the oldest character of this gram leaves it
                gram -= top * char_at(history, h, kind, data, end - FINAL_GRAM + 1)
            read = end - lag + 1  # the gram that ends there, asked for earlier
            if read >= FINAL_GRAM - 1 and final_marked(self.finals,
                                                       ahead[read & (GRAMS_AHEAD - 1)]):
                return True
        return False

    def __init__(self, Py_ssize_t longest, double rebuild_interval):
        self.generation = 0
        self.pending = []  # (id, text) not in an automaton yet
        self.longest = longest
        self._last_rebuild = 0.0
        self.rebuild_interval = rebuild_interval

    cdef bint rebuild_due(self) noexcept:
        """``maybe_rebuild`` would rebuild now. Asked on every delta while keys are
        pending (most deltas, under load): a Python call each was a tenth of a delta."""
        cdef timespec now
        if len(self.pending) >= 256:
            return True
        clock_gettime(CLOCK_MONOTONIC, &now)
        return now.tv_sec + now.tv_nsec * 1e-9 - self._last_rebuild >= self.rebuild_interval


cdef class EntityFeed:
    """``entities.EntityScanner``'s state and its ``feed``, compiled: every delta of every
    stream takes this step, and most meet no entity. The subclass adds what runs when one
    is met (``_confirm``) and at the end. ``fold`` and ``astral_sub`` are the entities
    module's (lowercasing that keeps offsets; the replacement of characters pyahocorasick
    cannot take), given so that this module imports nothing of the engine's."""

    cdef public EntityIndexFields _index
    cdef public list _text
    cdef public list _raw
    cdef public Py_ssize_t _length
    cdef public list _undecided
    cdef public set _seen
    cdef object _fold
    cdef object _astral_sub
    # The tail, the text's last ``longest - 1`` characters (as ``longest`` was at the
    # last delta) in which a key that ends in the next delta may begin, is made from
    # ``_text`` only when a delta needs it; its last ``FINAL_GRAM - 1`` characters are
    # kept for the prefilter.
    cdef Py_ssize_t tail_length
    cdef Py_UCS4 last[FINAL_GRAM - 1]

    def __init__(self, index, fold, astral_sub):
        self._index = index
        self._text, self._raw, self._length, self.tail_length = [], [], 0, 0
        # Strings only (ChoiceColumns says why): out of the collector's sight.
        PyObject_GC_UnTrack(<void*>self._text)
        PyObject_GC_UnTrack(<void*>self._raw)
        self._undecided, self._seen = [], set()
        self._fold, self._astral_sub = fold, astral_sub

    def feed(self, str delta):
        """Returns confirmed ``(start, end, entity id)`` matches, offsets into the stream."""
        found = self._feed(delta)
        return [] if found is None else found

    @property
    def _tail(self):
        """The tail after the last delta (``reference.entity_feed`` keeps it as a string)."""
        return self.tail_text(0)

    cdef str tail_text(self, Py_ssize_t skip):
        """The tail: the last ``tail_length`` characters of ``_text`` less its last
        ``skip`` deltas."""
        cdef Py_ssize_t need = self.tail_length, have = 0, i = len(self._text) - skip
        if need <= 0:
            return ""
        cdef list parts = []
        while have < need and i > 0:
            i -= 1
            parts.append(self._text[i])
            have += len(<str>self._text[i])
        parts.reverse()
        cdef str joined = "".join(parts)
        return joined[len(joined) - need:]

    cdef void keep_last(self, str delta, Py_ssize_t n) noexcept:
        """Shift ``delta``'s characters into ``last``, the text's ``FINAL_GRAM - 1``
        last (zeros before the text's start: the prefilter never reads them)."""
        cdef int kind = PyUnicode_KIND(delta)
        cdef const void* data = PyUnicode_DATA(delta)
        cdef Py_ssize_t keep = FINAL_GRAM - 1, i, take = min(n, keep)
        for i in range(keep - take):
            self.last[i] = self.last[i + take]
        for i in range(take):
            self.last[keep - take + i] = PyUnicode_READ(kind, <void*>data, n - take + i)

    cdef list _feed(self, str delta):
        """``feed``, or None when it confirms nothing (most deltas: no list to make).
        Not ``cpdef``: a Python subclass makes every cpdef call look the method up."""
        self._raw.append(delta)
        if PyUnicode_IS_ASCII(delta):
            if has_ascii_upper(delta):  # most deltas have no capital: no copy
                delta = delta.lower()
        else:
            delta = self._astral_sub("\ufffd", self._fold(delta))
        if not delta:
            return None
        cdef Py_ssize_t base = self._length, end, longest, start
        cdef Py_ssize_t n = PyUnicode_GET_LENGTH(delta), tail = self.tail_length
        self._text.append(delta)
        self._length += n
        cdef list candidates = None
        cdef EntityIndexFields index = self._index
        cdef Py_ssize_t h = min(tail, FINAL_GRAM - 1)
        cdef Py_ssize_t window_base = base - tail
        cdef str window = None
        if index._may_end_after(&self.last[FINAL_GRAM - 1 - h], h, delta):
            # A key that ends in this delta starts in the window: the tail keeps the
            # last ``longest - 1`` characters. Matches that end before it were found.
            window = self.tail_text(1) + delta
            for automaton in index.automata():
                for end_obj, (entity_id, text) in automaton.iter(window):
                    end = window_base + <Py_ssize_t>end_obj + 1
                    if end > base:
                        if candidates is None:
                            candidates = []
                        candidates.append((end, entity_id, text))
        cdef list pending = index.pending
        # The prefilter holds the pending keys' ends too (``EntityIndex.add``): a delta
        # it passed over (no window made) meets no key, in an automaton or not.
        if pending and window is not None:
            for entity_id, key in pending:
                start = window.find(key)
                while start != -1:
                    end = window_base + start + len(key)
                    if end > base:
                        if candidates is None:
                            candidates = []
                        candidates.append((end, entity_id, key))
                    start = window.find(key, start + 1)
        longest = index.longest
        self.tail_length = min(longest - 1, tail + n) if longest > 1 else 0
        self.keep_last(delta, n)
        if candidates is None and not self._undecided:
            return None  # most deltas: nothing to confirm
        return self._confirm([] if candidates is None else candidates, final=False)


# --- records of the window, out of the garbage collector's sight --------------------------
# The engine keeps one of each per request and per entity of its window: tens of
# thousands of objects that every full collection of the detector would walk, all of
# which hold only strings, numbers, arrays and containers of those, so none can be part
# of a reference cycle. ``no_gc`` leaves them untracked (their dicts and sets are still
# tracked, and untracked by the collector itself when they hold only atoms).


@cython.no_gc
@cython.final
cdef class RequestRecord:
    """A prompt of the window: who sent it, when, its bottom-k signature of private
    fingerprints, its digest, and the sorted unit hashes of its non-plain words and
    numbers (``detector.PROMPT_UNITS_KEPT`` at most). Immutable, but for ``carries``:
    the tenants whose answers its output was found to hold (None: none so far), to
    whom that output's text is no evidence of a leak (``ResponseScan._carried``).
    ``turns_known``: its text is its user's words, the model's turns set apart (a chat,
    a rendered conversation whose template was read), not one string that may quote
    a model unmarked."""

    cdef readonly str tenant
    cdef readonly str request_id
    cdef readonly double time
    cdef readonly object signature
    cdef readonly bytes prompt_digest
    cdef readonly object prompt_units
    cdef readonly bint turns_known
    cdef public set carries

    def __init__(self, str tenant, str request_id, double time, signature,
                 bytes prompt_digest, prompt_units, bint turns_known=False):
        self.tenant = tenant
        self.request_id = request_id
        self.time = time
        self.signature = signature
        self.prompt_digest = prompt_digest
        self.prompt_units = prompt_units
        self.turns_known = turns_known


@cython.no_gc
@cython.final
cdef class EntityOwner:
    """Who used an entity: ``tenants`` maps tenant -> (the caller's value for its latest
    use, time); ``echoes`` (None until the first) are other tenants whose outputs wrote
    it while no prompt held it, since a string the model writes for everyone is its habit
    once ``common_tenants`` tenants have seen it; ``prompted``: some prompt held it (an
    index value without the output bit); ``pinned``: a canary, which never expires."""

    cdef public str kind
    cdef public dict tenants
    cdef public bint pinned
    cdef public object echoes
    cdef public bint prompted

    def __init__(self, str kind):
        self.kind = kind
        self.tenants = {}
        self.pinned = False
        self.echoes = None
        self.prompted = False

    def model_born(self):
        """No prompt ever held it: only models wrote it."""
        return not self.prompted

    def users(self):
        """Tenants that used it, echoes included."""
        echoed = len(self.echoes - self.tenants.keys()) if self.echoes else 0
        return len(self.tenants) + echoed


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
