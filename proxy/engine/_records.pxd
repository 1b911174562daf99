# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The records of the engine's window (per request, per entity), out of the garbage
collector's sight, and the questions the scan asks of them."""

cimport cython

@cython.no_gc
@cython.final
cdef class RequestRecord:
    cdef readonly str tenant
    cdef readonly str request_id
    cdef readonly double time
    cdef readonly object signature
    cdef readonly bytes prompt_digest
    cdef readonly object prompt_units
    cdef readonly bint turns_known
    cdef public set carries


@cython.no_gc
@cython.final
cdef class EntityOwner:
    cdef public str kind
    cdef public dict tenants
    cdef public bint pinned
    cdef public object echoes
    cdef public bint prompted


cpdef bint similar_prompts(dict requests, a, b, double similarity) except -1
cpdef dict holders_by_tenant(dict requests, str tenant, list fps, dict holders)
cpdef bint distinct_holders(dict requests, values) except -1
cdef bint owned_by(dict requests, str tenant, values) except -1
