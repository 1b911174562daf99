"""Evidence records: complete, verifiable, and any changed byte is detected."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_sim

from proxy.assurance.evidence import (
    PAGE,
    RECORD,
    SUMS,
    EvidenceError,
    find_records,
    new_record,
    verify,
    write_evidence,
)


def crosstalk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "proxy", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def sample_record() -> dict:
    body = {
        "identification": {
            "engine": "vllm",
            "version": "0.9.1",
            "evidence": ["Server: <script>x</script>"],
        },
        "verdict": "no advisory applies",
        "exit_status": 0,
        "assessments": [],
        "note": 'ünïcödé & <html> "quotes"',
    }
    return new_record("audit", "http://127.0.0.1:8000", body, {"timeout": 5.0})


def test_write_and_verify(tmp_path: Path) -> None:
    written = write_evidence(tmp_path / "ev", sample_record())
    assert sorted(p.name for p in (tmp_path / "ev").iterdir()) == sorted([RECORD, PAGE, SUMS])
    result = verify(tmp_path / "ev")
    assert result.ok, result.problems
    assert result.record_sha256 == written.record_sha256
    assert verify(tmp_path / "ev", expect=written.record_sha256.upper()).ok
    assert not verify(tmp_path / "ev", expect="0" * 64).ok
    page = (tmp_path / "ev" / PAGE).read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page  # shown, escaped
    assert written.record_sha256 in page
    # Written once: a second record never overwrites the first.
    with pytest.raises(EvidenceError, match="already holds"):
        write_evidence(tmp_path / "ev", sample_record())


@pytest.mark.parametrize("name", [RECORD, PAGE, SUMS])
def test_any_changed_byte_is_detected(tmp_path: Path, name: str) -> None:
    write_evidence(tmp_path / "orig", sample_record())
    size = (tmp_path / "orig" / name).stat().st_size
    rng = random.Random(name)
    positions = sorted({0, size - 1, *rng.sample(range(size), min(size, 40))})
    for pos in positions:
        work = tmp_path / f"t{pos}"
        shutil.copytree(tmp_path / "orig", work)
        data = bytearray((work / name).read_bytes())
        data[pos] ^= 0x01  # the smallest change: one bit of one byte
        (work / name).write_bytes(bytes(data))
        result = verify(work)
        assert not result.ok, (name, pos)
        shutil.rmtree(work)


def test_missing_appended_and_removed(tmp_path: Path) -> None:
    write_evidence(tmp_path / "a", sample_record())
    with (tmp_path / "a" / RECORD).open("ab") as fh:
        fh.write(b" ")
    assert not verify(tmp_path / "a").ok
    write_evidence(tmp_path / "b", sample_record())
    (tmp_path / "b" / PAGE).unlink()
    problems = verify(tmp_path / "b").problems
    assert any(PAGE in p for p in problems)
    assert find_records(tmp_path) == [tmp_path / "a", tmp_path / "b"]


def test_audit_and_probe_evidence_end_to_end(tmp_path: Path) -> None:
    ev = tmp_path / "evidence"
    with run_sim(tmp_path, "--engine-version", "0.8.5", "--leak-rate", "0.3") as sim:
        audit = crosstalk("audit", "--target", sim.url, "--evidence", str(ev / "audit"))
        probe = crosstalk(
            "probe", "--target", sim.url, "--requests", "80", "--tenants", "4",
            "--evidence", str(ev / "probe"),
        )  # fmt: skip
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert probe.returncode == 1, probe.stdout + probe.stderr
    for kind in ("audit", "probe"):
        record = json.loads((ev / kind / RECORD).read_text())
        page = (ev / kind / PAGE).read_text()
        # When, target, engine and version, crosstalk version, config hash, record hash.
        assert record["kind"] == kind and record["created_at"].endswith("Z")
        assert record["target"] == sim.url and sim.url in page
        ident = record[kind]["identification"]
        assert (ident["engine"], ident["version"]) == ("vllm", "0.8.5")
        assert "vllm 0.8.5" in page
        assert record["crosstalk_version"] and len(record["config_hash"]) == 64
        assert record["config_hash"] in page and record["sha256"] in page
        # Advisories matched, in both records.
        applies = {a["id"] for a in record[kind]["assessments"] if a["status"] == "applies"}
        assert "GHSA-4qjh-9fv9-r85r" in applies
        assert "GHSA-4qjh-9fv9-r85r" in page
        assert record[kind]["exit_status"] == 1
    probe_body = json.loads((ev / "probe" / RECORD).read_text())["probe"]
    assert probe_body["parameters"]["requests"] == 80 and probe_body["parameters"]["tenants"] == 4
    results = probe_body["results"]
    assert results["requests_sent"] == 80 and results["contaminated_responses"] > 0
    assert probe_body["findings"] and "Contamination found" in (ev / "probe" / PAGE).read_text()
    assert json.loads((ev / "probe" / RECORD).read_text())["config"]["detection"]["k"] == 4

    # verify-evidence: both records pass, from the parent directory.
    ok = crosstalk("verify-evidence", str(ev))
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.count("OK ") == 2
    # sha256sum agrees with the SHA256SUMS file.
    if shutil.which("sha256sum"):
        check = subprocess.run(
            ["sha256sum", "-c", SUMS], cwd=ev / "probe", capture_output=True, text=True
        )
        assert check.returncode == 0, check.stdout
    # One changed byte in the probe's HTML: the command fails and names the record.
    page_path = ev / "probe" / PAGE
    data = bytearray(page_path.read_bytes())
    data[len(data) // 2] ^= 0x20
    page_path.write_bytes(bytes(data))
    bad = crosstalk("verify-evidence", str(ev))
    assert bad.returncode == 1
    assert "FAILED" in bad.stdout and str(ev / "probe") in bad.stdout
    assert f"OK      {ev / 'audit'}" in bad.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    assert crosstalk("verify-evidence", str(empty)).returncode == 2
