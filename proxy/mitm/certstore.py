"""mitmproxy's certificate authority, created once however many proxies start at once.

mitmproxy creates its CA (``mitmproxy-ca.pem`` and the rest, in ``confdir``) the first
time it starts, and neither locks nor writes atomically: replicas started together on a
fresh host each find no CA, each write one, and one of them can read another's file
half written ("Unable to load PEM file ... MalformedFraming", seen with five
``crosstalk run`` processes of bench/scaleout.py). ``ensure_ca`` creates it under an
exclusive lock, in a scratch directory whose files are then renamed into place, the CA
file last: whoever looks (another replica, mitmproxy itself) finds no CA or a whole one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from cryptography import x509
from mitmproxy.certs import CertStore, load_pem_private_key
from mitmproxy.options import CONF_BASENAME

LOCK_NAME = ".crosstalk-ca.lock"


class UnreadableCA(ValueError):
    """A CA file is there but cannot be read (cut short by a crash, say)."""


def ca_file(confdir: str | os.PathLike[str]) -> Path:
    """The CA file mitmproxy reads from ``confdir`` (``~`` expanded, as mitmproxy does)."""
    return Path(os.path.expanduser(confdir)) / f"{CONF_BASENAME}-ca.pem"


def ensure_ca(confdir: str | os.PathLike[str], key_size: int) -> bool:
    """Create mitmproxy's CA in ``confdir`` unless it is there; True when this call
    created it. Concurrent calls, in any processes, wait for each other: one creates,
    the others find it. A CA that exists is left as it is (it may be an operator's
    own), but must be readable: else ``UnreadableCA``, which names the file, where
    mitmproxy would fail later with a traceback that does not."""
    path = ca_file(confdir)
    if path.exists():
        _check_readable(path)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return False
        scratch = Path(tempfile.mkdtemp(prefix=".crosstalk-ca-", dir=path.parent))
        try:
            CertStore.create_store(scratch, CONF_BASENAME, key_size)
            made = sorted(scratch.iterdir(), key=lambda f: f.name == path.name)  # CA last
            for file in made:
                os.replace(file, path.parent / file.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return True


def _check_readable(path: Path) -> None:
    """Read the key and certificate as mitmproxy will (``CertStore.from_files``, whose
    other file it would write if missing: not read here)."""
    try:
        raw = path.read_bytes()
        load_pem_private_key(raw, None)
        x509.load_pem_x509_certificates(raw)
    except (ValueError, TypeError, OSError) as e:
        raise UnreadableCA(
            f"mitmproxy's CA {path} cannot be read ({e}): if it is not your own, delete "
            f"the {CONF_BASENAME}-ca* files there and start again"
        ) from e
