# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Which tenants used each word that is not plain yet (``detector.Vocabulary``), in C
memory: tenants as bitsets, names past the bitset's width."""

cimport cython
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from proxy.engine._bits cimport AHEAD, mix64, prefetch
from proxy.engine._tables cimport Column, HotTable, as_column

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


