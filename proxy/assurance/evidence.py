"""Evidence records of audits and probes: a JSON record, a readable HTML page and a
``SHA256SUMS`` file, written once into their own directory and checked later.

An operator keeps these as evidence of control (GDPR Art. 32: testing the effectiveness
of technical measures). Integrity is by SHA-256:

* the record carries ``sha256``, the SHA-256 of its canonical JSON form (sorted keys,
  compact, UTF-8) without that field;
* ``evidence.json`` is the record in one deterministic layout (sorted keys, indent 2), so
  a changed byte anywhere, whitespace included, is detected;
* the HTML page shows the record's hash;
* ``SHA256SUMS`` lists both files in ``sha256sum`` format (``sha256sum -c SHA256SUMS``
  works too) and must be exactly what the files hash to.

A hash proves nothing against someone who rewrites all files and recomputes it: keep the
printed record hash somewhere else as well (a ticket, a change log) and compare it with
``crosstalk verify-evidence DIR --expect HASH``.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import platform
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxy import __version__

SCHEMA = "crosstalk.evidence/1"
RECORD, PAGE, SUMS = "evidence.json", "evidence.html", "SHA256SUMS"


class EvidenceError(OSError):
    """Evidence cannot be written (directory already holds a record, not writable)."""


def canonical(obj: Any) -> bytes:
    """The canonical bytes a record hash is computed over."""
    return json.dumps(
        obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    ).encode()


def layout(record: dict) -> bytes:
    """The exact bytes of ``evidence.json`` for ``record`` (readable, deterministic)."""
    return (json.dumps(record, sort_keys=True, ensure_ascii=False, indent=2) + "\n").encode()


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def config_hash(config: Any) -> str:
    """SHA-256 of a configuration's canonical JSON: names the exact settings a run used."""
    return sha256(canonical(config))


def new_record(kind: str, target: str, body: dict, config: dict) -> dict:
    """A record's content (not yet sealed): the common header plus ``body`` under ``kind``."""
    return {
        "schema": SCHEMA,
        "kind": kind,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "target": target,
        "crosstalk_version": __version__,
        "python": platform.python_version(),
        "config": config,
        "config_hash": config_hash(config),
        kind: body,
    }


def seal(content: dict) -> dict:
    """``content`` plus its ``sha256``."""
    body = {k: v for k, v in content.items() if k != "sha256"}
    return {**body, "sha256": sha256(canonical(body))}


def sums_text(files: dict[str, bytes]) -> bytes:
    """``SHA256SUMS`` content for the named files, in name order."""
    return "".join(f"{sha256(data)}  {name}\n" for name, data in sorted(files.items())).encode()


@dataclass(frozen=True, slots=True)
class Written:
    """Where a record was written and its hash (to note somewhere else)."""

    directory: Path
    record_sha256: str


def write_evidence(directory: str | Path, content: dict) -> Written:
    """Seal ``content`` and write the three files into ``directory`` (created if needed).

    Refuses a directory that already holds a record: evidence is written once."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EvidenceError(f"cannot create {directory}: {e}") from e
    if any((directory / name).exists() for name in (RECORD, PAGE, SUMS)):
        raise EvidenceError(f"{directory} already holds an evidence record; use a new directory")
    record = seal(content)
    record_bytes = layout(record)
    page_bytes = render_html(record).encode()
    files = {RECORD: record_bytes, PAGE: page_bytes}
    files[SUMS] = sums_text(files)
    for name, data in files.items():
        tmp = directory / f".{name}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, directory / name)
        except OSError as e:
            raise EvidenceError(f"cannot write {directory / name}: {e}") from e
    return Written(directory, record["sha256"])


@dataclass(slots=True)
class Verification:
    """The outcome of checking one evidence directory."""

    directory: Path
    record_sha256: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(directory: str | Path, expect: str | None = None) -> Verification:
    """Check one evidence directory; every problem found is listed."""
    directory = Path(directory)
    result = Verification(directory)
    files: dict[str, bytes] = {}
    for name in (RECORD, PAGE, SUMS):
        try:
            files[name] = (directory / name).read_bytes()
        except OSError as e:
            result.problems.append(f"{name}: cannot read ({e.strerror or e})")
    if RECORD in files:
        _check_record(files[RECORD], result)
    if RECORD in files and PAGE in files and SUMS in files:
        expected = sums_text({RECORD: files[RECORD], PAGE: files[PAGE]})
        if files[SUMS] != expected:
            result.problems.append(f"{SUMS}: does not match the files' SHA-256")
    if PAGE in files and result.record_sha256 and result.record_sha256.encode() not in files[PAGE]:
        result.problems.append(f"{PAGE}: does not show the record's hash")
    if expect and result.record_sha256 and expect.strip().lower() != result.record_sha256:
        result.problems.append(f"record hash {result.record_sha256} is not the expected {expect}")
    return result


def _check_record(data: bytes, result: Verification) -> None:
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        result.problems.append(f"{RECORD}: not valid JSON ({e})")
        return
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        result.problems.append(f"{RECORD}: no sha256 field")
        return
    result.record_sha256 = record["sha256"]
    if record.get("schema") != SCHEMA:
        result.problems.append(f"{RECORD}: unknown schema {record.get('schema')!r}")
    body = {k: v for k, v in record.items() if k != "sha256"}
    try:
        actual = sha256(canonical(body))
    except ValueError as e:
        result.problems.append(f"{RECORD}: cannot be hashed ({e})")
        return
    if actual != record["sha256"]:
        result.problems.append(f"{RECORD}: content hash {actual} != recorded {record['sha256']}")
    if data != layout(record):
        result.problems.append(f"{RECORD}: bytes differ from the record's written layout")


def find_records(root: str | Path) -> list[Path]:
    """Directories under ``root`` (``root`` included) that hold an evidence record or part
    of one, sorted."""
    root = Path(root)
    found = {
        p.parent
        for name in (RECORD, PAGE, SUMS)
        for p in ([root / name] if (root / name).exists() else []) + list(root.rglob(name))
    }
    return sorted(found)


# --- HTML -------------------------------------------------------------------------------

_STYLE = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top}th{background:#f4f4f4}code{font-size:.9em}
.applies{color:#a00;font-weight:bold}.check{color:#a60}.ok{color:#070}
"""


def _e(value: Any) -> str:
    if isinstance(value, bool):
        value = str(value).lower()
    elif value is None:
        value = "-"
    elif isinstance(value, (dict, list)):
        value = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return html.escape(str(value))


def _table(
    rows: list[tuple[Any, ...]], header: tuple[str, ...] | None = None, status: bool = False
) -> str:
    """An HTML table; with ``status`` the first cell is styled by its value."""
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = [f"<td>{_e(c)}</td>" for c in row]
        if status and row:
            cells[0] = f"<td class='{_e(row[0])}'>{_e(row[0])}</td>"
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _kv(mapping: dict) -> str:
    return _table([(k, v) for k, v in mapping.items()])


def render_html(record: dict) -> str:
    """A readable page of the record. Generated from the record alone."""
    kind = record.get("kind", "?")
    body = record.get(kind, {}) or {}
    verdict = body.get("verdict", "-")
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>crosstalk {_e(kind)} evidence: {_e(record.get('target'))}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>crosstalk {_e(kind)} evidence</h1>",
        _kv(
            {
                "when (UTC)": record.get("created_at"),
                "target": record.get("target"),
                "engine": _engine_line(body.get("identification") or {}),
                "verdict": verdict,
                "exit status": body.get("exit_status"),
                "crosstalk version": record.get("crosstalk_version"),
                "config hash (SHA-256)": record.get("config_hash"),
                "record hash (SHA-256)": record.get("sha256"),
            }
        ),
    ]
    ident = body.get("identification")
    if ident:
        parts += ["<h2>Engine found</h2>", _kv(ident)]
    assessments = body.get("assessments")
    if assessments is not None:
        parts.append("<h2>Advisories</h2>")
        rows = [
            (a["status"], a["id"], a["title"], a["fixed"] or "-", a["reason"], a["action"],
             a["source"])
            for a in assessments
        ]  # fmt: skip
        header = ("status", "id", "title", "fixed in", "why", "what to do", "source")
        parts.append(
            _table(rows, header, status=True) if rows else "<p>No advisory for this engine.</p>"
        )
    for section, title in (("parameters", "Probe parameters"), ("results", "Probe results")):
        if isinstance(body.get(section), dict):
            parts += [f"<h2>{title}</h2>", _kv(body[section])]
    findings = body.get("findings")
    if findings:
        parts.append("<h2>Contamination found</h2>")
        keys = sorted({k for f in findings for k in f})
        parts.append(_table([tuple(f.get(k) for k in keys) for f in findings], tuple(keys)))
    parts += [
        "<h2>Configuration</h2>",
        _kv(record.get("config") or {}),
        "<h2>Integrity</h2>",
        "<p>The record hash is the SHA-256 of the canonical JSON of <code>evidence.json</code> "
        "without its <code>sha256</code> field. Check it with "
        "<code>crosstalk verify-evidence DIR</code> (also <code>sha256sum -c SHA256SUMS</code>)"
        " and compare it with the hash you noted when the record was made.</p>",
        f"<p>Record hash: <code>{_e(record.get('sha256'))}</code></p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _engine_line(ident: dict) -> str:
    if not ident:
        return "-"
    engine = ident.get("engine") or "not identified"
    return f"{engine} {ident.get('version') or '(version not exposed)'}"
