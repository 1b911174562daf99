# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The text loops' shared parts: ASCII words and numbers, k-gram counts (inline), and the
functions that cut units and roll k-grams (``_text.pyx``)."""

cimport cython
from cpython.unicode cimport (
    Py_UNICODE_ISDECIMAL, Py_UNICODE_ISDIGIT, Py_UNICODE_ISSPACE, PyUnicode_DecodeASCII,
    PyUnicode_1BYTE_KIND, PyUnicode_2BYTE_KIND, PyUnicode_KIND, PyUnicode_READ,
    PyUnicode_READ_CHAR, PyUnicode_Substring,
)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from proxy.engine._bits cimport PRIME, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_IS_ASCII, is_alnum, mix64


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


cdef inline Py_ssize_t kgram_count(Py_ssize_t size, Py_ssize_t first, int k) noexcept:
    """How many k-grams start in ``hashes[first:size]`` (0 for none)."""
    return size - first - k + 1 if k >= 1 and size - first - k + 1 > 0 else 0



cdef int append_ascii_units(str text, Py_ssize_t offset, list texts, list starts,
                            list ends) except -1
cdef void roll_kgrams(const uint64_t* hashes, Py_ssize_t first, Py_ssize_t n, int k,
                      uint64_t* out) noexcept
cdef list list_of(const uint64_t* values, Py_ssize_t n)
cdef list list_at(const uint64_t* values, const Py_ssize_t* at, Py_ssize_t n)
cdef list kgrams_from(const uint64_t* hashes, Py_ssize_t size, Py_ssize_t first, int k)
