"""mitmproxy's CA is created once when several proxies start at once on a fresh host
(``proxy.mitm.certstore``): mitmproxy itself neither locks nor writes it atomically, and
one of five ``crosstalk run`` replicas started together read another's half-written
file and exited."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT
from mitmproxy.certs import CertStore
from mitmproxy.options import CONF_BASENAME

from proxy.mitm.certstore import UnreadableCA, ca_file, ensure_ca

# Each child waits for the go file, so that all of them ask at once: without the lock,
# every one would find no CA and write its own.
CHILD = """
import json, sys, time
from pathlib import Path
from proxy.mitm.certstore import ca_file, ensure_ca
confdir, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
deadline = time.time() + 60
while not go.exists() and time.time() < deadline:
    time.sleep(0.005)
created = ensure_ca(confdir, 2048)
print(json.dumps({"created": created, "ca": ca_file(confdir).read_text()}))
"""


def test_processes_that_start_together_create_one_ca_and_all_read_it_whole(tmp_path: Path):
    confdir, go = tmp_path / "conf", tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(confdir), str(flag), str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for flag in ready
    ]
    deadline = time.time() + 60
    while time.time() < deadline and not all(flag.exists() for flag in ready):
        time.sleep(0.01)
    go.touch()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(r["created"] for r in results) == 1
    assert len({r["ca"] for r in results}) == 1  # every one read the same, whole file
    store = CertStore.from_store(confdir, CONF_BASENAME, 2048)  # as mitmproxy loads it
    assert store.default_ca.to_pem() in ca_file(confdir).read_bytes()


def test_an_existing_ca_is_left_as_it_is(tmp_path: Path):
    assert ensure_ca(tmp_path, 2048)
    before = ca_file(tmp_path).read_bytes()
    assert not ensure_ca(tmp_path, 2048)
    assert ca_file(tmp_path).read_bytes() == before


def test_a_ca_being_written_is_not_seen_until_it_is_whole(tmp_path: Path, monkeypatch):
    """Another process checking while the CA is written (mitmproxy writes the key and
    certificate first, the rest after) sees no CA, not part of one."""
    create = CertStore.create_store
    written, go_on = threading.Event(), threading.Event()

    def create_then_pause(*args, **kwargs):
        create(*args, **kwargs)
        written.set()
        assert go_on.wait(30)

    monkeypatch.setattr(CertStore, "create_store", staticmethod(create_then_pause))
    worker = threading.Thread(target=ensure_ca, args=(tmp_path, 2048))
    worker.start()
    try:
        assert written.wait(30)
        assert not ca_file(tmp_path).exists()
        assert not list(tmp_path.glob(f"{CONF_BASENAME}-*"))
    finally:
        go_on.set()
        worker.join(30)
    CertStore.from_store(tmp_path, CONF_BASENAME, 2048)  # whole now
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".crosstalk-ca-")] == []


def test_an_unreadable_ca_is_named_not_replaced(tmp_path: Path):
    ca_file(tmp_path).write_bytes(b"-----BEGIN RSA PRIVATE KEY-----\ncut short")
    with pytest.raises(UnreadableCA, match=str(ca_file(tmp_path))):
        ensure_ca(tmp_path, 2048)
    assert ca_file(tmp_path).read_bytes().endswith(b"cut short")
