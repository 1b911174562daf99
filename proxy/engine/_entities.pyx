# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The entity scan, compiled: which entity patterns a text can match at all (one pass),
the index's prefilter of the last characters of every key, and a stream's per-delta
step (``EntityFeed``), whose Python is ``reference.entity_feed``."""

from cpython.unicode cimport (
    Py_UNICODE_ISDECIMAL, Py_UNICODE_ISDIGIT, Py_UNICODE_ISSPACE, PyUnicode_DecodeASCII,
    PyUnicode_1BYTE_KIND, PyUnicode_2BYTE_KIND, PyUnicode_KIND, PyUnicode_READ,
    PyUnicode_READ_CHAR, PyUnicode_Substring,
)
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
from proxy.engine._bits cimport (
    PRIME, PyObject_GC_UnTrack, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_IS_ASCII,
    prefetch,
)
from proxy.engine._text cimport has_ascii_upper

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
    # The case keys' groups of patterns (entities.iter_case_keys), by what all of a
    # group's patterns need.
    NEEDS_DIGITS3 = 512  # three ASCII digits in a row: a reference
    NEEDS_CURRENCY = 1024  # $ € £ ¥ USD EUR GBP CHF JPY: an amount
    NEEDS_NAME = 2048  # [A-Z][a-z'’]+ then ", " "-" " " " and " " & " then [A-Z]: a name

ENTITY_NEEDS = {
    "email": NEEDS_EMAIL, "url_secret": NEEDS_URL, "api_key": NEEDS_API_KEY,
    "iban": NEEDS_IBAN, "card": NEEDS_CARD, "national_id": NEEDS_NATIONAL_ID,
    "phone": NEEDS_PHONE, "digit_id": NEEDS_DIGIT_ID, "token": NEEDS_TOKEN,
}
CASE_NEEDS = {"reference": NEEDS_DIGITS3, "amount": NEEDS_CURRENCY, "name": NEEDS_NAME}


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


cdef inline bint is_upper_at(const stored_char* data, Py_ssize_t n, Py_ssize_t i) noexcept:
    return i < n and 65 <= data[i] <= 90


cdef inline bint name_goes_on(const stored_char* data, Py_ssize_t n, Py_ssize_t i) noexcept:
    """Whether the separator at ``i``, after a capitalised word, leads to a capital:
    "-X", ", X", " X", " and X", " & X"."""
    cdef Py_UCS4 c = data[i]
    if c == 45:  # -
        return is_upper_at(data, n, i + 1)
    if c == 44:  # ,
        return i + 1 < n and data[i + 1] == 32 and is_upper_at(data, n, i + 2)
    if c != 32:
        return False
    return (is_upper_at(data, n, i + 1)
            or (has_at(data, n, i + 1, b"and ") and is_upper_at(data, n, i + 5))
            or (has_at(data, n, i + 1, b"& ") and is_upper_at(data, n, i + 3)))


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
    cdef Py_ssize_t capitalised = 0  # the run of [A-Z][a-z'’]* ending here
    cdef int card_state = 0
    for i in range(n):
        c = data[i]
        if 65 <= c <= 90:
            capitalised = 1
        elif capitalised and ((97 <= c <= 122) or c == 39 or c == 0x2019):
            capitalised += 1
        else:
            if capitalised >= 2 and name_goes_on(data, n, i):
                found |= NEEDS_NAME
            capitalised = 0
        if c == 36 or c == 0x20AC or c == 0xA3 or c == 0xA5:  # $ € £ ¥
            found |= NEEDS_CURRENCY
        elif c == 85 or c == 69 or c == 71 or c == 67 or c == 74:  # U E G C J
            if (has_at(data, n, i, b"USD") or has_at(data, n, i, b"EUR")
                    or has_at(data, n, i, b"GBP") or has_at(data, n, i, b"CHF")
                    or has_at(data, n, i, b"JPY")):
                found |= NEEDS_CURRENCY
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
            if digits >= 3:
                found |= NEEDS_DIGITS3
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

    # The tail, the text's last ``longest - 1`` characters (as ``longest`` was at the
    # last delta) in which a key that ends in the next delta may begin, is made from
    # ``_text`` only when a delta needs it; its last ``FINAL_GRAM - 1`` characters are
    # kept for the prefilter.

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
