# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The per-unit part of decoding a choice's columns (``proxy.store.codec``): a replica
decodes every other replica's outputs, and the numpy calls that rebuilt these four
columns were half of what decoding one cost."""

from libc.stdint cimport uint8_t, uint32_t, uint64_t

import numpy as np


cdef inline uint64_t _read(const uint8_t* p, int width, Py_ssize_t i) noexcept:
    """Little-endian number ``i`` of ``width`` bytes at ``p``."""
    if width == 1:
        return p[i]
    if width == 2:
        return p[2 * i] | (<uint64_t>p[2 * i + 1] << 8)
    return (p[4 * i] | (<uint64_t>p[4 * i + 1] << 8) | (<uint64_t>p[4 * i + 2] << 16)
            | (<uint64_t>p[4 * i + 3] << 24))


cdef int _mark(uint8_t[::1] column, list positions, uint8_t mark) except -1:
    """``column[i] = mark`` for each ``i`` of ``positions``: ints in ``[0, len(column))``."""
    cdef Py_ssize_t n = column.shape[0], i
    for position in positions:
        if type(position) is not int:
            raise ValueError("positions out of range")
        i = position
        if i < 0 or i >= n:
            raise ValueError("positions out of range")
        column[i] = mark
    return 0


def unit_columns(Py_ssize_t n, const uint8_t[::1] gaps, int gaps_width,
                 const uint8_t[::1] lengths, int lengths_width, one_char, specific):
    """The weights, numbers, starts and ends of a choice's ``n`` units from what a record
    carries: ``gaps`` (each unit's start after the previous one's) and ``lengths``,
    ``n`` little-endian numbers of 1, 2 or 4 bytes each; ``one_char``, the positions of
    the units that weigh 1 (the others weigh 2); ``specific``, those of the specific
    numbers. ``ValueError`` when the columns are short, a width unknown, a position not
    an int in range, or an offset past 32 bits."""
    for width in (gaps_width, lengths_width):
        if width not in (1, 2, 4):
            raise ValueError("packed record: offsets of an unknown width")
    if gaps.shape[0] != n * gaps_width or lengths.shape[0] != n * lengths_width:
        raise ValueError("unit columns of different lengths")
    if type(one_char) is not list or type(specific) is not list:
        raise ValueError("positions out of range")
    weights = np.empty(n, dtype=np.uint8)
    weights.fill(2)  # not np.full: a Python function, ~1 us more a choice
    numbers = np.zeros(n, dtype=np.uint8)
    starts = np.empty(n, dtype=np.uint32)
    ends = np.empty(n, dtype=np.uint32)
    _mark(weights, one_char, 1)
    _mark(numbers, specific, 1)
    cdef uint32_t[::1] s = starts, e = ends
    cdef uint64_t start = 0, end
    cdef Py_ssize_t i
    for i in range(n):
        start += _read(&gaps[0], gaps_width, i)
        end = start + _read(&lengths[0], lengths_width, i)
        if end > 0xFFFFFFFF:
            raise ValueError("offsets past 32 bits")
        s[i] = <uint32_t>start
        e[i] = <uint32_t>end
    return weights, numbers.view(bool), starts, ends
