# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The engine's tables and the loops over them, compiled: the commonness sketch's counts
and increments (``index.CommonnessSketch``), the pair filter (``index.PairFilter``),
sorted-column membership, merging and sorting (``index.FingerprintIndex``'s
generations), the index's hot generation (``HotTable``), its frozen generations'
lookups (``FrozenGenerations``), and ``Column``, the growable array of 64-bit ints that
a stream's state is made of. ``proxy.engine.reference`` holds the Python the sketch,
the pair filter and the frozen lookups replaced; ``tests/test_core_parity.py`` holds
them to it."""


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


cdef uint64_t PAIR_MULTIPLIER = 0x9E3779B97F4A7C15ULL


def pair_first_seen(unsigned char[::1] current, const unsigned char[::1] previous,
                    uint64_t tenant_key, fingerprints, int shift):
    """``PairFilter.first_seen``'s loop: each (tenant, fingerprint) pair is three bits,
    the top ``64 - shift`` bits of ``x + i * d`` for i = 0, 1, 2, where ``x = pair *
    MULTIPLIER`` and ``d = mix64(pair) | 1`` (``pair = tenant_key ^ fp``): double
    hashing, in two Bloom generations of equal size. The step is the pair's own: with
    one step for all, two pairs that shared their first bit shared all three, and the
    filter answered "seen" as often as a one-bit filter (~1e-3 of new pairs at 100,000
    held, not ~1e-6), which made what turned common depend on the key. A pair in
    neither is recorded in ``current`` and its fingerprint returned, in order; a
    fingerprint given twice is new at most once. ``fingerprints``: a list of ints or a
    ``Column`` (an output's, read in place). The new ones: a ``Column``."""
    if not 0 < shift < 64 or previous.shape[0] != current.shape[0]:
        raise ValueError("pair_first_seen: generations differ or the shift is out of range")
    if ((<uint64_t>-1) >> shift) >> 3 >= <uint64_t>current.shape[0]:
        raise ValueError("pair_first_seen: the generations are too short for the shift")
    cdef uint64_t fp, pair, a, b, c, x, d
    cdef unsigned char am, bm, cm
    cdef Column new = Column()
    cdef Column column = as_column(fingerprints)
    cdef const uint64_t* fps = column.data
    cdef Py_ssize_t n = column.size, i
    for i in range(n):
        if i + AHEAD < n:  # a new pair reads its first bit in both, then writes three
            pair = tenant_key ^ fps[i + AHEAD]
            x = pair * PAIR_MULTIPLIER
            d = mix64(pair) | 1
            prefetch(&previous[(x >> shift) >> 3])
            prefetch_w(&current[(x >> shift) >> 3])
            prefetch_w(&current[((x + d) >> shift) >> 3])
            prefetch_w(&current[((x + 2 * d) >> shift) >> 3])
        fp = fps[i]
        pair = tenant_key ^ fp
        x = pair * PAIR_MULTIPLIER
        d = mix64(pair) | 1
        a = x >> shift
        b = (x + d) >> shift
        c = (x + 2 * d) >> shift
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


cdef class HotTable:
    """The hot generation of a ``FingerprintIndex``: each fingerprint's first value, in
    an open-addressing table of 64-bit keys and 32-bit values (12 bytes a slot, at most
    half of them full), where a dict took ~100 bytes an entry: an int object for each
    key and value, and a hash of each on every probe. Reads as a mapping of ints (``in``,
    ``[]``, ``get``, ``keys``, ``items``, ``len``); the compiled step probes it with no
    object made. Empty slots hold key 0, so fingerprint 0 is kept beside the table. It
    holds no objects: the garbage collector never sees it. A key out of the 64-bit
    range raises ``OverflowError``, as the frozen generations' columns would."""


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

    def add_values(self, list fingerprints, Py_ssize_t start, uint32_t value, dict more,
                   Py_ssize_t cap, Py_ssize_t room):
        """``FingerprintIndex.add_many``'s loop over the keys ``add_fresh`` left, from
        ``fingerprints[start]`` on: a key not held is added with ``value``; a key held
        with other values gets ``value`` too, in ``more`` (key -> its values, oldest
        first, an untracked tuple of at most ``cap``: the oldest goes). Stops before the
        next key once ``room`` entries were added, where the caller freezes the table.
        Returns the entries added (net of the oldest dropped), how many keys changed,
        and the index of the first key not handled. ``reference.add_values`` is the
        Python loop it replaced."""
        cdef Py_ssize_t i, n = len(fingerprints), added = 0, changed = 0
        cdef uint32_t held
        cdef uint64_t key
        cdef tuple values
        for i in range(start, n):
            if added >= room:
                return added, changed, i
            fp = fingerprints[i]
            key = <uint64_t>fp
            if not self.find(key, &held):
                self.put(key, value, False)
            else:
                values = more.get(fp)
                if values is None:
                    if held == value:
                        continue
                    more[fp] = untracked((held, value))
                else:
                    if value in values:
                        continue
                    values = values + (value,)
                    if len(values) > cap:
                        values = values[1:]
                        added -= 1
                    more[fp] = untracked(values)
            added += 1
            changed += 1
        return added, changed, n

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

    def take_more(self, dict more, uint64_t[::1] keys, uint32_t[::1] values):
        """A freeze's keys with several values (``more``: key -> its values, oldest
        first, as ``add_values`` keeps them): each key's first value into this table
        (the oldest may have been dropped since it came), and the others into ``keys``
        and ``values``, as long as all of them, in ``more``'s order (a key's values
        together, oldest first); ``ValueError``, before any change, when they are not.
        One pass: the Python loops and the inserts it replaced took ~9 ms a freeze of
        65,536 keys with ~7,800 such keys (bench/ingest.py's workload)."""
        cdef Py_ssize_t k = 0, j
        cdef tuple vs
        cdef uint64_t key
        for vs in more.values():
            k += len(vs) - 1
        if keys.shape[0] != k or values.shape[0] != k:
            raise ValueError("HotTable.take_more: the columns do not fit the values")
        k = 0
        for fp, vs in more.items():
            key = <uint64_t>fp
            self.put(key, <uint32_t>vs[0], True)
            for j in range(1, len(vs)):
                keys[k], values[k] = key, <uint32_t>vs[j]
                k += 1

    def __reduce__(self):
        return HotTable, (self.items(),)


cdef class Column:
    """A growable array of unsigned 64-bit ints that reads like a list of ints: a
    choice's unit hashes, offsets, weights and running sums. The compiled step appends
    to it without making an int object per value (three of them per word, as lists);
    Python indexes, slices (a list), iterates and extends it as a list, and numpy reads
    it through the buffer protocol (``np.array(column, dtype=...)`` copies it at once).
    It holds no objects, so the garbage collector never sees it. While a buffer of it is
    exported it cannot grow (``BufferError``, as ``bytearray``)."""


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
