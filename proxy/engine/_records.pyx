# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The records the engine keeps per request and per entity of its window, as classes the
garbage collector does not walk, and what the scan asks of them: whether two requests
asked the same, who holds a k-gram, whether it can still be private."""

from proxy.engine._tables cimport intersection_size

# --- records of the window, out of the garbage collector's sight --------------------------
# The engine keeps one of each per request and per entity of its window: tens of
# thousands of objects that every full collection of the detector would walk, all of
# which hold only strings, numbers, arrays and containers of those, so none can be part
# of a reference cycle. ``no_gc`` leaves them untracked (their dicts and sets are still
# tracked, and untracked by the collector itself when they hold only atoms).


cdef class RequestRecord:
    """A prompt of the window: who sent it, when, its bottom-k signature of private
    fingerprints, its digest, and the sorted unit hashes of its non-plain words and
    numbers (``detector.PROMPT_UNITS_KEPT`` at most). Immutable, but for ``carries``:
    the tenants whose answers its output was found to hold (None: none so far), to
    whom that output's text is no evidence of a leak (``ResponseScan._carried``).
    ``turns_known``: its text is its user's words, the model's turns set apart (a chat,
    a rendered conversation whose template was read), not one string that may quote
    a model unmarked."""


    def __init__(self, str tenant, str request_id, double time, signature,
                 bytes prompt_digest, prompt_units, bint turns_known=False):
        self.tenant = tenant
        self.request_id = request_id
        self.time = time
        self.signature = signature
        self.prompt_digest = prompt_digest
        self.prompt_units = prompt_units
        self.turns_known = turns_known


cdef class EntityOwner:
    """Who used an entity: ``tenants`` maps tenant -> (the caller's value for its latest
    use, time); ``echoes`` (None until the first) are other tenants whose outputs wrote
    it while no prompt held it, since a string the model writes for everyone is its habit
    once ``common_tenants`` tenants have seen it; ``prompted``: some prompt held it (an
    index value without the output bit); ``pinned``: a canary, which never expires."""


    def __init__(self, str kind):
        self.kind = kind
        self.tenants = {}
        self.pinned = False
        self.echoes = None
        self.prompted = False

    def model_born(self):
        """No prompt ever held it: only models wrote it."""
        return not self.prompted

    def users(self):
        """Tenants that used it, echoes included."""
        echoed = len(self.echoes - self.tenants.keys()) if self.echoes else 0
        return len(self.tenants) + echoed


cpdef bint similar_prompts(dict requests, a, b, double similarity) except -1:
    """``Engine.similar_prompts``: whether requests ``a`` and ``b`` (``RequestRecord``s of
    ``requests``, by slot) asked (nearly) the same thing: the same prompt digest, or
    bottom-k signatures of at least 4 private k-grams each that share ``similarity`` of
    the smaller one. False when either is gone."""
    cdef RequestRecord x = requests.get(a), y = requests.get(b)
    if x is None or y is None:
        return False
    if x.prompt_digest == y.prompt_digest:
        return True
    cdef Py_ssize_t small = min(len(x.signature), len(y.signature))
    if small < 4:
        return False  # too little private text to tell: only identical prompts count
    return intersection_size(x.signature, y.signature) / <double>small >= similarity


cpdef dict holders_by_tenant(dict requests, str tenant, list fps, dict holders):
    """``fps`` by the tenants other than ``tenant`` whose requests (``RequestRecord``s
    of ``requests``, by slot) hold them, in the order met: ``holders`` maps a k-gram to
    its index values (slot << 1 | output bit). A k-gram two requests of one tenant hold
    is listed twice (the pair filter counts it once)."""
    cdef dict by_tenant = {}
    cdef RequestRecord record
    cdef list used
    cdef tuple values
    for fp in fps:
        values = holders[fp]
        for value in values:
            record = requests.get(value >> 1)
            if record is None or record.tenant == tenant:
                continue
            used = by_tenant.get(record.tenant)
            if used is None:
                by_tenant[record.tenant] = [fp]
            else:
                used.append(fp)
    return by_tenant



#: Values of one k-gram (requests that hold it) past which it is text many share, unless
#: they are all one tenant's.
cdef Py_ssize_t FULL_VALUES = 64


cpdef bint distinct_holders(dict requests, values) except -1:
    """Whether a k-gram held by ``values`` can still be private: fewer than
    ``FULL_VALUES``, or all of them one tenant's (a sentence that tenant sends in every
    request is still its own, however many of its requests hold it; text that many
    requests of several tenants hold is shared). Expired values are skipped."""
    if len(values) < FULL_VALUES:
        return True
    tenant = None
    for value in values:
        record = requests.get(value >> 1)
        if record is None:
            continue
        if tenant is None:
            tenant = (<RequestRecord>record).tenant
        elif (<RequestRecord>record).tenant != tenant:
            return False
    return True


cdef bint owned_by(dict requests, str tenant, values) except -1:
    """One of the requests ``values`` name (slot << 1 | output bit) is ``tenant``'s."""
    for value in values:
        record = requests.get(value >> 1)
        if record is not None and (<RequestRecord>record).tenant == tenant:
            return True
    return False


