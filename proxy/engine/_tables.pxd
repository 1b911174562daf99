# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The engine's tables in C memory: the commonness sketch's cells (inline), a growable
column of 64-bit ints, the index's hot generation (an open-addressing table) and its
frozen generations (sorted columns with bucket directories)."""

cimport cython
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_WRITABLE
from proxy.engine._bits cimport (
    AHEAD, PRIME, PyObject_GC_IsTracked, PyObject_GC_UnTrack, PyObject_IS_GC, lower_bound,
    mix64, prefetch, prefetch_w, qsort, sorted_has,
)


cdef enum:
    HOT_MIN_SLOTS = 1024  # a power of two; a table at most half full doubles


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



@cython.final
cdef class Column:
    cdef uint64_t* data
    cdef Py_ssize_t size, capacity
    cdef Py_ssize_t exports
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef int grow(self, Py_ssize_t needed) except -1
    cdef inline int push(self, uint64_t value) except -1:
        if self.size == self.capacity:
            self.grow(self.size + 1)
        self.data[self.size] = value
        self.size += 1
        return 0
    cdef inline uint64_t last(self) noexcept:
        """The newest value; 0 when empty."""
        return self.data[self.size - 1] if self.size else 0
    cdef Py_ssize_t position(self, Py_ssize_t i) except -1
    cdef int resizable(self) except -1
    cdef int extend_from(self, values) except -1
    cdef list slice(self, Py_ssize_t start, Py_ssize_t stop)


@cython.final
cdef class HotTable:
    cdef uint64_t* slot_keys
    cdef uint32_t* slot_values
    cdef Py_ssize_t capacity, count
    cdef bint has_zero
    cdef uint32_t zero_value
    cdef int _allocate(self, Py_ssize_t capacity) except -1
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
    cdef int put(self, uint64_t key, uint32_t value, bint replace) except -1
    cdef int _grow(self) except -1
    cdef inline tuple values_of(self, fp, uint32_t value, dict more):
        """The values of ``fp``, held here with ``value`` first: ``more``'s tuple for a
        key with several (keyed by int), else a tuple of ``value``."""
        return (more.get(fp) if more else None) or (value,)


cdef class FrozenGenerations:
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
    cdef bint holds(self, uint64_t fp) noexcept
    cdef tuple values_after(self, uint64_t fp, tuple before)


cdef Column as_column(values)
cdef Py_ssize_t intersection_size(const uint64_t[::1] a, const uint64_t[::1] b) noexcept
cdef void sort_keys(uint64_t* keys, Py_ssize_t n, int depth=*) noexcept nogil
cdef int copy_ints(list values, uint64_t[::1] out) except -1
