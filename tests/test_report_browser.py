"""The HTML incident report of ``crosstalk replay``, rendered by a real browser.

A small capture of the simulator's workload with injected leaks (JSON lines, answers
and SSE bodies as the simulator makes them) is replayed through ``crosstalk replay
--report r.html --report r.json``. Headless Chromium then loads the page twice:

- ``--dump-dom``: the DOM the browser built from the page as written (no scripts in
  it): the incident table has one row per incident of the JSON report, in order, with
  its tenants and counts, and the timeline SVG is an SVG element with every cell;
- ``--dump-dom`` of a copy with one measuring script added at the end: standards mode,
  UTF-8, the table and chart laid out with a real size, every chart cell inside the
  chart, the stylesheet applied (a passed GDPR deadline is bold and red).

Chromium comes from the distribution's packages (``make test`` runs
``scripts/ensure-chromium.sh``). Without it the test skips, except under CI=true, where
it fails.
"""

from __future__ import annotations

import html
import json
import random
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import TEST_KEY, missing_tool, read_events

from proxy.cli import main as cli_main
from proxy.sim.answers import answer_for
from proxy.sim.faults import FaultInjector
from proxy.sim.server import _Exchange, full_body, stream_events, stream_pieces
from proxy.sim.workload import Workload

BROWSER_TIMEOUT = 60.0  # seconds for one headless page load


@pytest.fixture(scope="module")
def chromium() -> str:
    """The Chromium binary; skipped without one, failed under CI."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    message = (
        "chromium is not installed (Debian/Ubuntu: apt-get install chromium; "
        "make test installs it with scripts/ensure-chromium.sh)"
    )
    missing_tool(message)


def write_capture(path: Path, n: int = 60) -> None:
    """``n`` exchanges of 8 tenants, ten days ago (the 72-hour deadlines have passed),
    a third of them carrying a 32- or 64-word page or a whole answer of another tenant."""
    rng = random.Random(7)
    injector = FaultInjector(0.35, seed=7, kinds=("prompt_page", "misroute"), page_words=(32, 64))
    now = time.time() - 10 * 86400
    with path.open("w") as out:
        for req in Workload(tenants=8, seed=7).requests(n):
            now += rng.uniform(0.5, 3.0)
            prompt = req.prompt_text()
            answer, _ = injector.apply(req.tenant, req.request_id, prompt, answer_for(prompt))
            injector.remember(req.tenant, req.request_id, prompt, answer)
            kind = "chat" if req.endpoint == "chat" else "completions"
            ex = _Exchange(
                kind, req.tenant, req.request_id, prompt, "", req.stream, False, [answer],
                ["stop"], frozenset(),
            )  # fmt: skip
            line: dict = {
                "time": now, "end_time": now + 2.0, "tenant": req.tenant,
                "request_id": req.request_id, "path": req.path(), "request": req.body(),
            }  # fmt: skip
            if req.stream:
                events = stream_events(
                    ex, "r", int(now), "m", [stream_pieces(answer, 1, True, rng)]
                )
                line["sse"] = b"".join(events).decode()
            else:
                line["response"] = full_body(ex, "r", int(now), "m")
            out.write(json.dumps(line) + "\n")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The capture replayed once: paths of the reports and the findings logged."""
    root = tmp_path_factory.mktemp("report-browser")
    config, capture, log = root / "crosstalk.toml", root / "capture.jsonl", root / "replay.jsonl"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    write_capture(capture)
    html, data = root / "report.html", root / "report.json"
    argv = ["replay", str(capture), "--config", str(config), "--log-file", str(log)]
    status = cli_main([*argv, "--report", str(html), "--report", str(data)])
    assert status == 1  # leaks found
    return {
        "root": root,
        "html": html,
        "json": json.loads(data.read_text()),
        "events": [e for e in read_events(log) if e["event"] == "leak.detected"],
    }


def render(chromium: str, page: Path, profile: Path) -> str:
    """The DOM headless Chromium built from ``page``, serialised."""
    argv = [
        chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
        f"--user-data-dir={profile}", "--dump-dom", page.resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BROWSER_TIMEOUT)
    assert done.returncode == 0 and "</html>" in done.stdout, (
        f"chromium exited with {done.returncode}:\n{done.stderr[-2000:]}"
    )
    return done.stdout


class Dom(HTMLParser):
    """What the test needs from the browser's DOM: the incident table's body rows (the
    text of their cells), the timeline SVG's cells, and every element's ancestry."""

    VOID = {"br", "meta", "link", "img", "input", "hr", "col", "wbr"}

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, dict]] = []
        self.rows: list[list[str]] = []
        self.cells: list[str | None] = []  # title text of each rect.cell in svg#timeline
        self.svgs: list[dict] = []
        self.scripts = 0
        self._cell: list[str] | None = None
        self._title: list[str] | None = None
        self.feed(text)
        self.close()

    def _inside(self, tag: str, id_: str) -> bool:
        return any(t == tag and a.get("id") == id_ for t, a in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "script":
            self.scripts += 1
        if tag == "svg":
            self.svgs.append(a)
        if tag == "tr" and self._in_incident_body():
            self.rows.append([])
        if tag == "td" and self._in_incident_body():
            self._cell = []
        if (
            tag == "rect"
            and "cell" in a.get("class", "").split()
            and self._inside("svg", "timeline")
        ):
            self.cells.append(None)
        if tag == "title" and self.stack and self.stack[-1][0] == "rect":
            self._title = []
        if tag not in self.VOID:
            self.stack.append((tag, a))

    def _in_incident_body(self) -> bool:
        tags = [t for t, _ in self.stack]
        return self._inside("table", "incidents") and "tbody" in tags

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self.rows:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None
        if tag == "title" and self._title is not None:
            if self.cells:
                self.cells[-1] = "".join(self._title)
            self._title = None
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._title is not None:
            self._title.append(data)


def test_incident_table_and_timeline_are_in_the_rendered_dom(chromium, report):
    dom = Dom(render(chromium, report["html"], report["root"] / "profile"))
    incidents = report["json"]["incidents"]
    pairs = {(e["source_tenant"], e["tenant"]) for e in report["events"]}
    assert len(incidents) == len(pairs) >= 3
    assert dom.scripts == 0
    # One row per incident, in the report's order, with its tenants and counts.
    assert len(dom.rows) == len(incidents)
    for n, (row, incident) in enumerate(zip(dom.rows, incidents, strict=True), 1):
        assert row[:3] == [str(n), incident["source_tenant"], incident["victim_tenant"]]
        assert row[5] == str(incident["findings"])
        assert row[6] == str(incident["findings_on_partial_text"]) == "0"  # whole captures
        assert row[10] == incident["gdpr_notify_by"]
        assert incident["victim_request_ids"][0] in row[11]
    assert sum(int(row[5]) for row in dom.rows) == len(report["events"])
    # The chart: an SVG element (the browser's parser took it as one), a cell per busy
    # column of each incident, each with its tooltip.
    assert [s.get("id") for s in dom.svgs] == ["timeline"]
    source = report["html"].read_text()
    assert len(dom.cells) == source.count('<rect class="cell"') >= len(incidents)
    labels = {f"{i['source_tenant']} -> {i['victim_tenant']}" for i in incidents}
    assert all(t and t.split(":")[0] in labels and "finding(s)" in t for t in dom.cells)


MEASURE = """<script>
const box = (el) => { const r = el.getBoundingClientRect();
  return {x: r.x, y: r.y, w: r.width, h: r.height}; };
const table = document.getElementById("incidents");
const svg = document.getElementById("timeline");
const rows = [...table.tBodies[0].rows];
const out = {
  mode: document.compatMode, charset: document.characterSet,
  table: box(table), rows: rows.map((r) => box(r)),
  svg: box(svg), svgNamespace: svg.namespaceURI,
  cells: [...svg.querySelectorAll("rect.cell")].map((c) => box(c)),
  deadline: rows.map((r) => { const s = getComputedStyle(r.cells[10]);
    return {color: s.color, weight: s.fontWeight}; }),
};
const pre = document.createElement("pre");
pre.id = "measured";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def test_report_lays_out_in_the_browser(chromium, report):
    """Rendered, not only parsed: the table and the chart have a size on the page, every
    chart cell is drawn inside the chart, and the stylesheet applies."""
    page = report["html"].read_text()
    instrumented = report["root"] / "measured.html"
    instrumented.write_text(page.replace("</body>", MEASURE + "</body>"))
    dom = render(chromium, instrumented, report["root"] / "profile")
    start = dom.index('<pre id="measured">') + len('<pre id="measured">')
    measured = json.loads(html.unescape(dom[start : dom.index("</pre>", start)]))
    incidents = report["json"]["incidents"]
    assert measured["mode"] == "CSS1Compat" and measured["charset"] == "UTF-8"
    assert measured["table"]["w"] > 300 and measured["table"]["h"] > 0
    assert len(measured["rows"]) == len(incidents)
    assert all(r["h"] > 0 for r in measured["rows"])
    svg = measured["svg"]
    assert measured["svgNamespace"] == "http://www.w3.org/2000/svg"
    assert svg["w"] > 500 and svg["h"] > 0 and svg["y"] > measured["table"]["y"]
    assert len(measured["cells"]) >= len(incidents)
    for c in measured["cells"]:
        assert c["w"] > 0 and c["h"] > 0
        assert svg["x"] <= c["x"] and c["x"] + c["w"] <= svg["x"] + svg["w"] + 0.5
        assert svg["y"] <= c["y"] and c["y"] + c["h"] <= svg["y"] + svg["h"] + 0.5
    # Ten days ago: every 72-hour deadline has passed, shown bold and red (.passed).
    assert all(i["gdpr_deadline_passed"] for i in incidents)
    assert measured["deadline"] == [{"color": "rgb(187, 0, 0)", "weight": "700"}] * len(incidents)
