"""Cache domains of the shared index: which upstreams share a KV cache, and so whose
records a replica needs (``[index.domains]``, docs/operations.md, "Cache domains").
Pure functions, read by the configuration's checks and by ``redis_index``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def normal_url(url: str) -> str:
    """``url`` as cache domains match upstreams: lower case, no trailing slash, no
    default port."""
    url = url.strip().lower().rstrip("/")
    for scheme, port in (("http://", ":80"), ("https://", ":443")):
        if url.startswith(scheme) and url.endswith(port):
            url = url.removesuffix(port)
    return url


def domain_of(section: Any, upstreams: Sequence[str]) -> str:
    """The cache domain of a replica: ``index.domain`` when set, else the domain of
    ``index.domains`` that lists its upstream ("" when none does: the default domain,
    every replica in one, as without domains). Raises ValueError when its upstreams lie
    in two domains (one replica, one domain: it would have to read both)."""
    if section.domain:
        return str(section.domain)
    by_url = {normal_url(u): name for name, urls in section.domains.items() for u in urls}
    found = {by_url[normal_url(u)] for u in upstreams if normal_url(u) in by_url}
    if len(found) > 1:
        raise ValueError(
            f"index.domains: this replica's upstreams are in {len(found)} cache domains "
            f"({', '.join(sorted(found))}): run one replica per domain"
        )
    return found.pop() if found else ""
