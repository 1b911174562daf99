"""mitmproxy's certificate authority, created once however many proxies start at once.

mitmproxy creates its CA (``mitmproxy-ca.pem`` and the rest, in ``confdir``) the first
time it starts, and neither locks nor writes atomically: replicas started together on a
fresh host each find no CA, each write one, and one of them can read another's file
half written ("Unable to load PEM file ... MalformedFraming", seen with five
``crosstalk run`` processes of bench/scaleout.py). ``ensure_ca`` creates it under an
exclusive lock before mitmproxy looks, so mitmproxy finds it whole.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from mitmproxy.certs import CertStore
from mitmproxy.options import CONF_BASENAME

LOCK_NAME = ".crosstalk-ca.lock"


def ca_file(confdir: str | os.PathLike[str]) -> Path:
    """The CA file mitmproxy reads from ``confdir`` (``~`` expanded, as mitmproxy does)."""
    return Path(os.path.expanduser(confdir)) / f"{CONF_BASENAME}-ca.pem"


def ensure_ca(confdir: str | os.PathLike[str], key_size: int) -> bool:
    """Create mitmproxy's CA in ``confdir`` unless it is there; True when this call
    created it. Concurrent calls, in any processes, wait for each other: one creates,
    the others find it. A CA file that exists is left as it is (an operator's own)."""
    path = ca_file(confdir)
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return False
        CertStore.create_store(path.parent, CONF_BASENAME, key_size)
        return True
