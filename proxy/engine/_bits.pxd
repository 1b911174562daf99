# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""C declarations and the inline helpers the compiled modules share: CPython and libc
functions Cython does not declare, the prefetch hint, a 64-bit mixer, and binary search
over a sorted key column. Declarations only: cimported, never imported."""

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t

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

cdef extern from *:
    """
    #define CROSSTALK_PRIME 0x9E3779B97F4A7C15ULL
    """
    const uint64_t PRIME "CROSSTALK_PRIME"


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    """splitmix64's finaliser (``fingerprint._mix64``)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline bint is_alnum(unsigned char c) noexcept nogil:
    return (c >= 48 and c <= 57) or (c >= 65 and c <= 90) or (c >= 97 and c <= 122)



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


