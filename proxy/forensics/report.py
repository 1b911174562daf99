"""Incident report of a forensic replay: who leaked to whom, since when, how much.

Findings are grouped into incidents by (source tenant -> victim tenant). Each incident
keeps first and last seen (recorded times), counts, kinds, a sample of victim request
ids and evidence hashes, and a timeline; all bounded in memory whatever the number of
findings. The report never holds prompt or output text: ids, counts and keyed hashes.

GDPR Art. 33(1): a personal data breach is notified to the supervisory authority
without undue delay and, where feasible, not later than 72 hours after becoming aware
of it. The report counts the 72 hours from each incident's first detection (the
recorded time of its first finding, when live shadow mode logged it or would have),
and also from the replay itself, for breaches that this replay is the first to reveal.

Rendered as JSON, Markdown or HTML (``render``, by the file's extension). The HTML is
one self-contained page: a table and an inline SVG timeline, no scripts.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

GDPR_HOURS = 72
SAMPLE = 20  # request ids and evidence hashes listed per incident
DISTINCT_CAP = 100_000  # distinct ids counted exactly up to this many per incident
MAX_BINS = 4096  # timeline bins kept per incident (coarsened beyond)
CHART_COLUMNS = 60
REPORT_SUFFIXES = (".json", ".md", ".html", ".htm")


def iso(ts: float | None, timespec: str = "seconds") -> str | None:
    """ISO 8601 UTC (None stays None)."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


@dataclass
class Timeline:
    """Findings over time, in bins that double in width when there are too many."""

    resolution: float = 1.0  # seconds per bin
    bins: Counter[int] = field(default_factory=Counter)

    def add(self, when: float) -> None:
        self.bins[int(when // self.resolution)] += 1
        while len(self.bins) > MAX_BINS:
            self.resolution *= 2
            coarser: Counter[int] = Counter()
            for key, count in self.bins.items():
                coarser[key // 2] += count
            self.bins = coarser

    def points(self) -> list[tuple[float, int]]:
        """(bin start, findings), in time order."""
        return [(key * self.resolution, self.bins[key]) for key in sorted(self.bins)]


@dataclass
class Incident:
    """All findings of one source tenant's data in one victim tenant's responses."""

    source_tenant: str
    victim_tenant: str
    first_seen: float
    last_seen: float
    findings: int = 0
    on_partial_text: int = 0  # findings in or from text that its input had cut
    kinds: Counter[str] = field(default_factory=Counter)
    victim_requests: set[str] = field(default_factory=set)
    source_requests: set[str] = field(default_factory=set)
    evidence: set[str] = field(default_factory=set)
    victim_sample: list[str] = field(default_factory=list)
    evidence_sample: list[str] = field(default_factory=list)
    foreign_words: float = 0.0
    timeline: Timeline = field(default_factory=Timeline)

    def add(self, event: dict[str, Any], when: float) -> None:
        self.findings += 1
        self.on_partial_text += bool(event.get("partial_text"))
        self.first_seen = min(self.first_seen, when)
        self.last_seen = max(self.last_seen, when)
        self.kinds[str(event.get("kind"))] += 1
        self.foreign_words += float(event.get("foreign_units") or 0)
        self.timeline.add(when)
        _note(self.victim_requests, self.victim_sample, event.get("request_id"))
        _note(self.source_requests, None, event.get("source_request_id"))
        _note(self.evidence, self.evidence_sample, event.get("evidence"))

    @property
    def notify_by(self) -> float:
        return self.first_seen + GDPR_HOURS * 3600

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "source_tenant": self.source_tenant,
            "victim_tenant": self.victim_tenant,
            "first_seen": iso(self.first_seen),
            "last_seen": iso(self.last_seen),
            "findings": self.findings,
            "findings_on_partial_text": self.on_partial_text,
            "victim_requests": _count(self.victim_requests),
            "source_requests": _count(self.source_requests),
            "kinds": dict(sorted(self.kinds.items())),
            "foreign_words": round(self.foreign_words, 1),
            "victim_request_ids": list(self.victim_sample),
            "evidence": list(self.evidence_sample),
            "evidence_distinct": _count(self.evidence),
            "gdpr_notify_by": iso(self.notify_by),
            "gdpr_deadline_passed": self.notify_by < now,
            "timeline": {
                "resolution_seconds": self.timeline.resolution,
                "points": [[iso(t), n] for t, n in self.timeline.points()],
            },
        }


def _note(distinct: set[str], sample: list[str] | None, value: Any) -> None:
    if not isinstance(value, str) or not value or value in distinct:
        return
    if len(distinct) < DISTINCT_CAP:
        distinct.add(value)
    if sample is not None and len(sample) < SAMPLE:
        sample.append(value)


def _count(distinct: set[str]) -> int | str:
    return f"{DISTINCT_CAP}+" if len(distinct) >= DISTINCT_CAP else len(distinct)


class IncidentBook:
    """Collects ``leak.detected`` events into incidents (source -> victim)."""

    def __init__(self) -> None:
        self.incidents: dict[tuple[str, str], Incident] = {}

    def add(self, event: dict[str, Any], when: float) -> None:
        """``event``: the fields of a ``leak.detected`` event; ``when``: its recorded time."""
        key = (str(event.get("source_tenant")), str(event.get("tenant")))
        incident = self.incidents.get(key)
        if incident is None:
            incident = self.incidents[key] = Incident(key[0], key[1], when, when)
        incident.add(event, when)

    def ordered(self) -> list[Incident]:
        """Incidents by first detection, then by size."""
        return sorted(self.incidents.values(), key=lambda i: (i.first_seen, -i.findings))


def build_report(
    book: IncidentBook, summary: dict[str, Any], now: float | None = None
) -> dict[str, Any]:
    """The report as plain data (what the JSON file holds; the other formats render it).

    ``summary``: what was replayed (inputs, counts, skipped records, settings)."""
    now = time.time() if now is None else now
    incidents = book.ordered()
    first = min((i.first_seen for i in incidents), default=None)
    return {
        "title": "crosstalk forensic replay: cross-tenant leaks",
        "generated_at": iso(now),
        "summary": summary,
        "findings": sum(i.findings for i in incidents),
        "first_detection": iso(first),
        "last_detection": iso(max((i.last_seen for i in incidents), default=None)),
        "gdpr": {
            "article": "GDPR Art. 33(1)",
            "hours": GDPR_HOURS,
            "notify_by_from_first_detection": iso(first + GDPR_HOURS * 3600) if first else None,
            "notify_by_from_this_replay": iso(now + GDPR_HOURS * 3600) if incidents else None,
        },
        "incidents": [i.to_dict(now) for i in incidents],
        "_chart": _chart_rows(incidents),
    }


def _chart_rows(incidents: list[Incident]) -> dict[str, Any]:
    """Each incident's findings in ``CHART_COLUMNS`` columns over the whole span."""
    if not incidents:
        return {"start": None, "end": None, "rows": []}
    start = min(i.first_seen for i in incidents)
    end = max(i.last_seen for i in incidents)
    width = max(end - start, 1e-9) / CHART_COLUMNS
    rows = []
    for incident in incidents:
        columns = [0] * CHART_COLUMNS
        for t, n in incident.timeline.points():
            columns[min(CHART_COLUMNS - 1, max(0, int((t - start) / width)))] += n
        rows.append(
            {"label": f"{incident.source_tenant} -> {incident.victim_tenant}", "columns": columns}
        )
    return {"start": start, "end": end, "rows": rows}


# -- rendering -------------------------------------------------------------------------------


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` as JSON, Markdown or HTML (by extension)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".json":
        data = {k: v for k, v in report.items() if not k.startswith("_")}
        p.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    elif suffix == ".md":
        p.write_text(render_markdown(report))
    elif suffix in (".html", ".htm"):
        p.write_text(render_html(report))
    else:
        raise ValueError(f"report must end in one of {', '.join(REPORT_SUFFIXES)}: {p}")


def _kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in kinds.items())


def _gdpr_lines(report: dict[str, Any]) -> list[str]:
    g = report["gdpr"]
    if not report["incidents"]:
        return ["No cross-tenant leak found: nothing to notify."]
    return [
        f"{g['article']}: notify the supervisory authority without undue delay and, where "
        f"feasible, within {g['hours']} hours of becoming aware of a personal data breach.",
        f"Counted from the first detection ({report['first_detection']}): "
        f"by {g['notify_by_from_first_detection']}.",
        f"If this replay is how the breach became known: by {g['notify_by_from_this_replay']}.",
    ]


def _summary_lines(report: dict[str, Any]) -> list[tuple[str, str]]:
    s = report["summary"]
    rows = [
        ("Inputs", ", ".join(s.get("inputs", []))),
        ("Traffic", f"{s.get('traffic_from') or '-'} to {s.get('traffic_to') or '-'}"),
        ("Records read", str(s.get("records", 0))),
        ("LLM exchanges scanned", str(s.get("exchanges", 0))),
        ("Findings", str(report["findings"])),
        ("Incidents (source -> victim)", str(len(report["incidents"]))),
        ("Records skipped (unreadable)", str(s.get("skipped", 0))),
        ("Exchanges not scannable (detector errors)", str(s.get("detector_errors", 0))),
        ("Exchanges not scannable (no body in the capture)", str(s.get("unrecorded", 0))),
        ("Exchanges with text cut by the input (partly scanned)", str(s.get("partial", 0))),
        ("Exchanges without a tenant in the input", str(s.get("untenanted", 0))),
        ("Degenerate outputs (garbage, not a leak)", str(s.get("degenerate", 0))),
        ("Detection window", f"{s.get('window_seconds', 0):g} s"),
        ("Key id", str(s.get("key_id", ""))),
    ]
    return rows


#: The per-input table: what each input let the replay see.
INPUT_COLUMNS = (
    ("input", "input"),
    ("format", "format"),
    ("exchanges", "LLM exchanges"),
    ("complete", "scanned whole"),
    ("partial", "text cut by the input"),
    ("unrecorded", "body not in the input"),
    ("untenanted", "no tenant"),
    ("detector_errors", "detector errors"),
)


def _input_rows(report: dict[str, Any]) -> list[list[str]]:
    return [
        [str(row.get(k, "")) for k, _ in INPUT_COLUMNS]
        for row in report["summary"].get("per_input", [])
    ]


def _sparkline(columns: list[int]) -> str:
    blocks = " ▁▂▃▄▅▆▇█"
    top = max(columns) or 1
    return "".join(blocks[0 if n == 0 else max(1, round(8 * n / top))] for n in columns)


def render_markdown(report: dict[str, Any]) -> str:
    md = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = [f"# {report['title']}", "", f"Generated {report['generated_at']}.", ""]
    out += ["| | |", "|---|---|"] + [f"| {k} | {md(v)} |" for k, v in _summary_lines(report)]
    if rows := _input_rows(report):
        out += ["", "## What each input let the replay see", ""]
        out += ["| " + " | ".join(h for _, h in INPUT_COLUMNS) + " |"]
        out += ["|---|---|" + "---:|" * (len(INPUT_COLUMNS) - 2)]
        out += ["| " + " | ".join(md(v) for v in row) + " |" for row in rows]
    out += ["", "## GDPR Art. 33", ""] + [f"- {line}" for line in _gdpr_lines(report)]
    out += ["", "## Incidents", ""]
    if report["incidents"]:
        out += [
            "| # | source -> victim | first seen | last seen | findings | on partial text "
            "| victim requests | kinds | 72 h deadline | evidence (keyed hashes) |",
            "|---:|---|---|---|---:|---:|---:|---|---|---|",
        ]
        for n, i in enumerate(report["incidents"], 1):
            deadline = i["gdpr_notify_by"] + (" (passed)" if i["gdpr_deadline_passed"] else "")
            evidence = ", ".join(i["evidence"][:3]) + (" ..." if len(i["evidence"]) > 3 else "")
            out.append(
                f"| {n} | {md(i['source_tenant'])} -> {md(i['victim_tenant'])} "
                f"| {i['first_seen']} | {i['last_seen']} | {i['findings']} "
                f"| {i['findings_on_partial_text']} | {i['victim_requests']} | {md(_kinds(i['kinds']))} | {deadline} "
                f"| {md(evidence)} |"
            )
        chart = report["_chart"]
        out += ["", "## Timeline", "", f"From {iso(chart['start'])} to {iso(chart['end'])}:", ""]
        out += ["```"]
        width = max(len(r["label"]) for r in chart["rows"])
        out += [f"{r['label']:<{width}} |{_sparkline(r['columns'])}|" for r in chart["rows"]]
        out += ["```", ""]
        out += ["Victim request ids (first of each incident):", ""]
        for n, i in enumerate(report["incidents"], 1):
            out.append(f"{n}. {md(', '.join(i['victim_request_ids']))}")
    else:
        out.append("No cross-tenant leak found.")
    out += _skipped_markdown(report)
    return "\n".join(out) + "\n"


def _skipped_markdown(report: dict[str, Any]) -> list[str]:
    skipped = report["summary"].get("skipped_records", [])
    if not skipped:
        return []
    out = ["", "## Records skipped", ""]
    out += [f"- {s['position']}: {s['reason']}" for s in skipped]
    more = report["summary"].get("skipped", 0) - len(skipped)
    if more > 0:
        out.append(f"- ... and {more} more (see the event log)")
    return out


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top;font-size:14px}th{background:#f3f3f3}
td.n{text-align:right}code{font-size:12px}.passed{color:#b00;font-weight:bold}
.gdpr{background:#fff6e0;border:1px solid #e0b040;padding:.5em 1em}
"""


def render_html(report: dict[str, Any]) -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(report['title'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(report['title'])}</h1><p>Generated {e(report['generated_at'])}.</p>",
        '<table id="summary">',
    ]
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in _summary_lines(report)]
    parts.append("</table>")
    if rows := _input_rows(report):
        parts.append('<h2>What each input let the replay see</h2><table id="inputs"><tr>')
        parts += [f"<th>{e(h)}</th>" for _, h in INPUT_COLUMNS]
        parts.append("</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(v)}</td>" for v in row) + "</tr>" for row in rows]
        parts.append("</table>")
    parts += ['<div class="gdpr"><h2>GDPR Art. 33</h2>']
    parts += [f"<p>{e(line)}</p>" for line in _gdpr_lines(report)]
    parts += ["</div>", "<h2>Incidents</h2>"]
    if report["incidents"]:
        parts.append(
            '<table id="incidents"><thead><tr><th>#</th><th>source tenant</th><th>victim '
            "tenant</th><th>first seen</th><th>last seen</th><th>findings</th>"
            "<th>on partial text</th><th>victim "
            "requests</th><th>source requests</th><th>kinds</th><th>72 h deadline</th>"
            "<th>victim request ids</th><th>evidence (keyed hashes)</th></tr></thead><tbody>"
        )
        for n, i in enumerate(report["incidents"], 1):
            passed = ' class="passed"' if i["gdpr_deadline_passed"] else ""
            parts.append(
                f"<tr><td class=n>{n}</td><td>{e(i['source_tenant'])}</td>"
                f"<td>{e(i['victim_tenant'])}</td><td>{e(i['first_seen'])}</td>"
                f"<td>{e(i['last_seen'])}</td><td class=n>{i['findings']}</td>"
                f"<td class=n>{i['findings_on_partial_text']}</td>"
                f"<td class=n>{e(str(i['victim_requests']))}</td>"
                f"<td class=n>{e(str(i['source_requests']))}</td>"
                f"<td>{e(_kinds(i['kinds']))}</td><td{passed}>{e(i['gdpr_notify_by'])}</td>"
                f"<td><code>{'<br>'.join(e(x) for x in i['victim_request_ids'])}</code></td>"
                f"<td><code>{'<br>'.join(e(x) for x in i['evidence'])}</code></td></tr>"
            )
        parts.append("</tbody></table><h2>Timeline</h2>")
        parts.append(timeline_svg(report["_chart"]))
    else:
        parts.append("<p>No cross-tenant leak found.</p>")
    skipped = report["summary"].get("skipped_records", [])
    if skipped:
        parts.append('<h2>Records skipped</h2><ul id="skipped">')
        parts += [f"<li>{e(s['position'])}: {e(s['reason'])}</li>" for s in skipped]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def timeline_svg(chart: dict[str, Any]) -> str:
    """One row per incident, one cell per time column, darker for more findings; each
    cell's tooltip (``<title>``) gives its time and count. No scripts."""
    e = html.escape
    rows = chart["rows"]
    label_w, cell_w, row_h, top = 260, 14, 22, 24
    width = label_w + cell_w * CHART_COLUMNS + 20
    height = top + row_h * len(rows) + 30
    step = (chart["end"] - chart["start"]) / CHART_COLUMNS
    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" role="img" aria-label="findings over time per incident">',
        f'<text x="{label_w}" y="14" font-size="12">{e(iso(chart["start"]) or "")}</text>',
        f'<text x="{width - 20}" y="14" font-size="12" text-anchor="end">'
        f"{e(iso(chart['end']) or '')}</text>",
    ]
    top_count = max((max(r["columns"]) for r in rows), default=1) or 1
    for n, row in enumerate(rows):
        y = top + n * row_h
        out.append(
            f'<text x="{label_w - 8}" y="{y + 15}" font-size="12" text-anchor="end">'
            f"{e(row['label'])}</text>"
        )
        out.append(
            f'<rect x="{label_w}" y="{y + 2}" width="{cell_w * CHART_COLUMNS}" '
            f'height="{row_h - 4}" fill="#f4f4f4"/>'
        )
        for c, count in enumerate(row["columns"]):
            if not count:
                continue
            opacity = 0.25 + 0.75 * count / top_count
            when = iso(chart["start"] + c * step)
            out.append(
                f'<rect class="cell" x="{label_w + c * cell_w}" y="{y + 2}" width="{cell_w - 1}" '
                f'height="{row_h - 4}" fill="#c0392b" fill-opacity="{opacity:.2f}">'
                f"<title>{e(row['label'])}: {count} finding(s) from {e(when or '')}</title></rect>"
            )
    out.append(
        f'<text x="{label_w}" y="{height - 8}" font-size="11" fill="#666">'
        f"each column {step:.3g} s; darker = more findings</text></svg>"
    )
    return "\n".join(out)
