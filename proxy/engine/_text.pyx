# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Text into units and units into k-grams, compiled: the ASCII word cutter
(``tokens.ascii_units``'s loop) and the rolling k-gram fingerprints
(``fingerprint.Hasher.kgrams_of_hashes``). ``proxy.engine.reference`` holds the Python
each returns exactly what of, and ``tests/test_core_parity.py`` holds them to it."""

from proxy.engine._tables cimport Column


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

