# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The engine's per-word loops, compiled (issue 16's first slice).

Each function here replaces a Python loop of ``proxy.engine.tokens`` or
``proxy.engine.fingerprint`` and returns exactly what that loop returned: the Python
versions stay in ``proxy.engine.reference`` and ``tests/test_core_parity.py`` holds the
two to the same output over the quality workload and random text.
"""

from cpython.unicode cimport PyUnicode_Substring
from libc.stdint cimport uint64_t

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object)
    void* PyUnicode_DATA(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)

cdef uint64_t PRIME = 0x9E3779B97F4A7C15ULL


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    """splitmix64's finaliser (``fingerprint._mix64``)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline bint is_alnum(unsigned char c) noexcept nogil:
    return (c >= 48 and c <= 57) or (c >= 65 and c <= 90) or (c >= 97 and c <= 122)


def ascii_units(str text, Py_ssize_t offset=0):
    """The units of an ASCII ``text`` (runs of ``[A-Za-z0-9]``, lowercased) as three
    columns: texts, start offsets, end offsets (shifted by ``offset``). The caller has
    checked ``text.isascii()``; anything else is a ValueError."""
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("ascii_units needs an ASCII string")
    cdef const unsigned char* data = <const unsigned char*>PyUnicode_DATA(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t i = 0, start
    cdef bint upper
    cdef unsigned char c
    cdef list texts = [], starts = [], ends = []
    while i < n:
        if not is_alnum(data[i]):
            i += 1
            continue
        start = i
        upper = False
        while i < n:
            c = data[i]
            if not is_alnum(c):
                break
            upper |= c >= 65 and c <= 90
            i += 1
        unit = PyUnicode_Substring(text, start, i)
        texts.append(unit.lower() if upper else unit)  # most words have no capital
        starts.append(start + offset)
        ends.append(i + offset)
    return texts, starts, ends


def kgrams(list hashes, int k):
    """The fingerprint of every k-gram of ``hashes`` (unit hashes, 64-bit ints), in
    order: ``Hasher.kgram`` of each window, rolled from the one before."""
    cdef Py_ssize_t n = len(hashes) - k + 1, i
    if n <= 0 or k < 1:
        return []
    cdef uint64_t h = 0, top = 1
    cdef int j
    for j in range(k - 1):
        top *= PRIME  # the oldest unit's multiplier, PRIME ** (k - 1) mod 2**64
    for j in range(k):
        h = h * PRIME + <uint64_t>hashes[j]
    cdef list out = [mix64(h)]
    for i in range(1, n):
        h = (h - <uint64_t>hashes[i - 1] * top) * PRIME + <uint64_t>hashes[i + k - 1]
        out.append(mix64(h))
    return out
