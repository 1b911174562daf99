# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The entity scan's compiled state: the index's prefilter of key ends and the per-stream
feed (``entities.EntityIndex``, ``entities.EntityScanner``)."""

cimport cython
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t


cdef enum:
    FINAL_GRAM = 6  # characters of a key's end that the prefilter hashes (MIN_ENTITY_CHARS)
    FINAL_BITS = 22  # a 512 KiB bitmap, two bits a key: 10,000 keys pass ~1 delta in 10,000
    GRAMS_AHEAD = 8  # a power of two: grams whose bitmap bytes are asked for at once
    ID_STRIDE = 8  # units (words, CJK characters) between two by-id scans (match_ids)



cdef class EntityIndexFields:
    cdef public long generation
    cdef public list pending
    cdef public Py_ssize_t longest
    cdef public double _last_rebuild
    cdef public double rebuild_interval
    cdef public Py_ssize_t id_only  # live keys known by id only (EntityScanner.match_ids)
    cdef unsigned char* finals
    cdef bint short_keys  # a key shorter than FINAL_GRAM: no prefilter
    cdef bint _may_end_after(self, const Py_UCS4* history, Py_ssize_t h, str delta) noexcept
    cdef bint rebuild_due(self) noexcept


cdef class EntityFeed:
    cdef public EntityIndexFields _index
    cdef public list _text
    cdef public list _raw
    cdef public Py_ssize_t _length
    cdef public list _undecided
    cdef public set _seen
    cdef public Py_ssize_t ids_done  # stream offset the by-id scan has read to
    cdef public Py_ssize_t ids_units  # the choice's units at the last by-id scan
    cdef object _fold
    cdef object _astral_sub
    cdef Py_ssize_t tail_length
    cdef Py_UCS4 last[FINAL_GRAM - 1]
    cdef str tail_text(self, Py_ssize_t skip)
    cdef void keep_last(self, str delta, Py_ssize_t n) noexcept
    cdef list _feed(self, str delta)
