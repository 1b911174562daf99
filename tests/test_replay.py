"""Forensic replay (``crosstalk replay``) and capture (``crosstalk run --capture``).

The reference: a real ``crosstalk run --capture`` (shadow mode) in front of the
simulator with fault injection, driven by the real ``openai`` SDK as 12 tenants. Its
live ``leak.detected`` events and the simulator's truth file are what every replay of
that capture (flow file, mitmproxy's own HAR export of it, the JSON-lines form of it,
split over two files) must reproduce. Corrupt and truncated inputs are skipped with
their position; exit status 0/1/2/3.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson
import pytest
from conftest import (
    ROOT,
    TEST_KEY,
    free_port,
    read_events,
    run_mitmdump,
    run_sim,
    stop,
    wait_for_events,
    wait_for_port,
)
from mitmproxy import http
from mitmproxy.addons.savehar import SaveHar
from mitmproxy.io import FlowReader, FlowWriter
from mitmproxy.test import tflow
from traffic import Result, judge, load_truth, run_workload

from proxy.cli import main as cli_main
from proxy.engine import Engine
from proxy.forensics.readers import open_input, read_records
from proxy.forensics.report import GDPR_HOURS
from proxy.mitm.capture import CHUNKS_KEY, OBSERVED_KEY

TENANTS, REQUESTS = 12, 240
SIM_ARGS = ("--token-delay", "0.001", "--split-words", "--leak-rate", "0.15", "--seed", "5")


def leak_keys(events: list[dict]) -> set[tuple[str, str, str, str, str]]:
    """What a finding is: victim request and tenant, source tenant and request, kind."""
    return {
        (e["request_id"], e["tenant"], e["source_tenant"], e["source_request_id"], e["kind"])
        for e in events
        if e["event"] == "leak.detected"
    }


@dataclass
class Captured:
    """One live shadow-mode run with ``--capture``, and what it saw."""

    root: Path
    config: Path
    flows: Path
    journal: Path
    live_log: Path
    truth: list[dict]
    results: list[Result]
    sent: dict[str, bytes]
    answers: dict[str, str]

    def replay(self, *files: Path | str, name: str, extra: tuple[str, ...] = ()):
        """``crosstalk replay`` in this process (the CLI's ``main``): exit status and
        the events it logged."""
        log = self.root / f"{name}.jsonl"
        log.unlink(missing_ok=True)
        argv = ["replay", *map(str, files), "--config", str(self.config), "--log-file", str(log)]
        status = cli_main([*argv, *extra])
        return status, read_events(log)


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Captured:
    root = tmp_path_factory.mktemp("replay")
    config = root / "crosstalk.toml"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    flows, live_log, journal = root / "capture.flows", root / "live.jsonl", root / "journal"
    with run_sim(root, *SIM_ARGS) as sim:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "run", "--upstream", sim.url,
             "--listen-port", str(port), "--config", str(config),
             "--log-file", str(live_log), "--capture", str(flows), "--journal", str(journal)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_for_port(port, proc)
            results = run_workload(
                f"http://127.0.0.1:{port}",
                tenants=TENANTS,
                requests=REQUESTS,
                seed=3,
                concurrency=8,
            )
            ids = {r.request.request_id for r in results}
            wait_for_events(
                live_log,
                lambda ev: ids <= {e.get("request_id") for e in ev if e["event"] == "exchange"},
                timeout=30,
            )
        finally:
            assert stop(proc) == 0
        sent = {r.request.request_id: sim.sent(r.request.request_id) for r in results}
        answers = {r.request.request_id: sim.answer(r.request.request_id) for r in results}
        truth = load_truth(sim.truth)
    return Captured(root, config, flows, journal, live_log, truth, results, sent, answers)


def test_capture_keeps_streamed_bodies_as_sent_with_chunk_timing(captured):
    with captured.flows.open("rb") as f:
        flows = [fl for fl in FlowReader(f).stream() if isinstance(fl, http.HTTPFlow)]
    assert len(flows) == REQUESTS
    streamed = 0
    for flow in flows:
        rid = flow.request.headers["x-request-id"]
        assert flow.response.raw_content == captured.sent[rid], rid
        assert isinstance(flow.metadata[OBSERVED_KEY], float)
        assert flow.request.timestamp_start <= flow.metadata[OBSERVED_KEY]
        if "event-stream" in flow.response.headers.get("content-type", ""):
            streamed += 1
            timing = flow.metadata[CHUNKS_KEY]
            assert len(timing) % 8 == 0 and len(timing) >= 16
    assert streamed >= REQUESTS // 3


@dataclass
class Replayed:
    status: int
    events: list[dict]
    reports: dict[str, Path]  # suffix -> path


@pytest.fixture(scope="module")
def replayed_flows(captured) -> Replayed:
    """The capture replayed once, with a report in every format."""
    reports = {s: captured.root / f"report{s}" for s in (".json", ".html", ".md")}
    extra = tuple(a for path in reports.values() for a in ("--report", str(path)))
    status, events = captured.replay(captured.flows, name="flows", extra=extra)
    return Replayed(status, events, reports)


def test_replay_of_capture_finds_what_live_shadow_mode_found(captured, replayed_flows):
    events = replayed_flows.events
    live = read_events(captured.live_log)
    live_keys, replay_keys = leak_keys(live), leak_keys(events)
    assert replayed_flows.status == 1
    assert len(live_keys) >= 20
    assert replay_keys == live_keys
    assert {e["action"] for e in events if e["event"] == "leak.detected"} == {"replayed"}
    # Against the simulator's truth: the same target leaks found, with the same sources.
    j_live = judge(captured.results, captured.truth, live, captured.answers.__getitem__)
    j_replay = judge(captured.results, captured.truth, events, captured.answers.__getitem__)
    assert len(j_replay.targets) >= 10
    assert [f["request_id"] for f in j_replay.found] == [f["request_id"] for f in j_live.found]
    # The detector's recall is the e2e tests' business (warm engine, 1,500 requests);
    # here a floor that shows the capture holds the leaks, found again (29/30 measured
    # 2026-12-06): three misses allowed, as meant, whatever the number of targets (a
    # clean-clone CI of 2026-12-07 had 23 of 26, the live run's own, found again whole).
    assert len(j_replay.targets) - len(j_replay.found) <= 3
    assert len(j_replay.right_source) == len(j_live.right_source)
    same = len(set(all_fields(live)) & set(all_fields(events)))
    print(
        f"replay == live: {len(replay_keys)} findings ({len(j_replay.found)}/"
        f"{len(j_replay.targets)} target leaks); every field equal in {same}"
    )
    finished = next(e for e in events if e["event"] == "replay.finished")
    assert finished["records"] == REQUESTS and finished["skipped"] == 0


def test_replay_flags_the_degenerate_outputs_live_mode_flagged(captured, replayed_flows):
    """Garbled answers (the simulator's degenerate faults) are reported by replay as the
    live proxy reported them: the same exchanges, the same reasons."""

    def degenerate(events):
        return {(e["request_id"], e["reason"]) for e in events if e["event"] == "output.degenerate"}

    live = degenerate(read_events(captured.live_log))
    # Garbage is in no clean answer: each one flagged is a degenerate fault, or a leak of
    # such an answer into another (a mis-route or a page of it).
    faulted = {t["request_id"] for t in captured.truth}
    assert len(live) >= 3 and {rid for rid, _ in live} <= faulted
    assert degenerate(replayed_flows.events) == live
    finished = next(e for e in replayed_flows.events if e["event"] == "replay.finished")
    assert finished["degenerate"] == len(live)


def test_replay_of_the_journal_finds_what_live_shadow_mode_found(captured, tmp_path):
    """The fingerprint journal of the same run (keyed records, no text) replays to the
    live findings, every field alike; with another key it is refused (exit 2)."""
    report = tmp_path / "journal.json"
    status, events = captured.replay(
        captured.journal, name="journal", extra=("--report", str(report))
    )
    live = read_events(captured.live_log)
    assert status == 1
    assert leak_keys(events) == leak_keys(live) and len(leak_keys(live)) >= 20
    assert set(all_fields(events)) == set(all_fields(live))
    finished = next(e for e in events if e["event"] == "replay.finished")
    assert finished["exchanges"] == REQUESTS and finished["skipped"] == 0
    assert json.loads(report.read_text())["incidents"]
    other = tmp_path / "other.toml"
    other.write_text(f'[detection]\nkey = "{"ab" * 32}"\n')
    argv = [
        "replay",
        str(captured.journal),
        "--config",
        str(other),
        "--log-file",
        str(tmp_path / "o.jsonl"),
    ]
    assert cli_main(argv) == 2


def test_journal_and_capture_are_replayed_separately(captured, tmp_path):
    argv = ["replay", str(captured.journal), str(captured.flows), "--log-file", str(tmp_path / "x")]
    assert cli_main(argv) == 2


def all_fields(events: list[dict]) -> list[tuple]:
    """A finding with every field but action, timestamps and capture position."""
    fields = ("request_id", "source_request_id", "kind", "score", "foreign_units")
    rest = ("output_offset", "detected_at", "choice", "evidence")
    return [
        tuple(str(e[k]) for k in fields + rest) for e in events if e["event"] == "leak.detected"
    ]


def test_report_groups_findings_by_source_and_victim(replayed_flows):
    report = json.loads(replayed_flows.reports[".json"].read_text())
    leaks = [e for e in replayed_flows.events if e["event"] == "leak.detected"]
    pairs = {(e["source_tenant"], e["tenant"]) for e in leaks}
    incidents = report["incidents"]
    assert {(i["source_tenant"], i["victim_tenant"]) for i in incidents} == pairs
    assert sum(i["findings"] for i in incidents) == len(leaks) == report["findings"]
    for i in incidents:
        pair = (i["source_tenant"], i["victim_tenant"])
        mine = [e for e in leaks if (e["source_tenant"], e["tenant"]) == pair]
        assert i["victim_requests"] == len({e["request_id"] for e in mine})
        assert set(i["victim_request_ids"]) == {e["request_id"] for e in mine}
        assert set(i["evidence"]) <= {e["evidence"] for e in mine}
        assert i["kinds"] == dict(Counter(e["kind"] for e in mine))
        first, last = parse(i["first_seen"]), parse(i["last_seen"])
        recorded = sorted(parse(e["recorded_at"]) for e in mine)
        assert abs(first - recorded[0]) < 1 and abs(last - recorded[-1]) < 1
        assert parse(i["gdpr_notify_by"]) - first == GDPR_HOURS * 3600
        assert sum(n for _, n in i["timeline"]["points"]) == i["findings"]
    assert report["first_detection"] == min(i["first_seen"] for i in incidents)


def parse(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def test_reports_and_log_hold_no_text(captured, replayed_flows):
    """Ids, counts and keyed hashes only: no leaked text, no prompt, in any format."""
    outputs = [path.read_text() for path in replayed_flows.reports.values()]
    outputs.append((captured.root / "flows.jsonl").read_text())
    secrets = [t["leaked_text"] for t in captured.truth if len(t["leaked_text"].split()) >= 4]
    secrets += [e for t in captured.truth for e in t.get("entities", [])]
    secrets += [r.request.prompt_text()[-60:] for r in captured.results[:50]]
    assert len(secrets) > 50
    for text in outputs:
        for secret in secrets:
            assert secret not in text


def test_html_and_markdown_reports_have_the_incident_table_and_timeline(replayed_flows):
    pairs = {
        (e["source_tenant"], e["tenant"])
        for e in replayed_flows.events
        if e["event"] == "leak.detected"
    }
    page = replayed_flows.reports[".html"].read_text()
    assert '<table id="incidents">' in page and '<svg id="timeline"' in page
    assert page.count("<tr><td class=n>") == len(pairs)
    assert page.count('<rect class="cell"') >= len(pairs)
    assert "<script" not in page and "GDPR Art. 33" in page
    md = replayed_flows.reports[".md"].read_text().splitlines()
    assert len([line for line in md if re.match(r"\| \d+ \| ", line)]) == len(pairs)
    timeline = md[md.index("```") + 1 : md.index("```", md.index("```") + 1)]
    assert len(timeline) == len(pairs)


def test_har_and_jsonl_forms_of_the_capture_replay_to_the_same_leaks(captured):
    """Without the chunk timing of a crosstalk capture, a stream is paced evenly between
    its first and last byte: the injected leaks are found as live, with their sources,
    but a finding that depends on the exact interleaving of concurrent streams may
    differ (measured in 7 runs: 0-2 findings of ~60; in one run, on a loaded machine,
    one target leak; since shadow mode scans 64 characters at a time, where a stream is
    cut into scans depends on its chunks too: 3 of 57 in one run, all cold-start
    findings between two concurrent outputs; two target leaks of ~30 in one CI run;
    4 of 57 in one CI run after outputs' new text began to be counted as common at
    their end, whose paced time is not the live one, likely the cause: all four between
    the first requests of concurrent tenants)."""
    with captured.flows.open("rb") as f:
        flows = list(FlowReader(f).stream())
    har = captured.root / "capture.har"
    har.write_text(json.dumps(SaveHar().make_har(flows), indent=2))  # mitmproxy's exporter
    jsonl = captured.root / "capture.jsonl"
    with jsonl.open("w") as out:
        for flow in flows:
            out.write(json.dumps(jsonl_line(flow)) + "\n")
    live_events = read_events(captured.live_log)
    live = tenant_keys(live_events)
    j_live = judge(captured.results, captured.truth, live_events, captured.answers.__getitem__)
    for path in (har, jsonl):
        status, events = captured.replay(path, name=path.suffix[1:])
        j = judge(captured.results, captured.truth, events, captured.answers.__getitem__)
        replayed = tenant_keys(events)
        differ = replayed ^ live
        print(f"{path.name}: {len(replayed)} findings, {len(differ)} differ from live")
        assert status == 1
        found, found_live = ({f["request_id"] for f in x.found} for x in (j, j_live))
        print(f"{path.name}: target leaks found {len(found)}, live {len(found_live)}")
        assert len(found ^ found_live) <= 2, (path.name, found ^ found_live)
        assert abs(len(j.right_source) - len(j_live.right_source)) <= 1
        # Two tenants' first requests, streaming at once and leaking into each other, can
        # swap who was first: up to 4 differing findings a pair (kind x direction); one
        # clean-clone run of 2026-12-01 had 4 of 30-odd live findings, over the old 3,
        # and one CI run beside a sanitized test run and valgrind (2026-12-02) two such
        # pairs, 8 of ~40. Whatever their number, a difference is only ever between
        # streams that ran at once: the paced replay cannot know their live order. Or it
        # is such a pair's text passed on: two tenants whose first answers leaked into
        # each other both hold it, and a later victim's leak of it names the one that
        # held it first, which their order decides (one CI run of 2026-12-03: a victim
        # that began 80 ms after both ended named one live and the other in the replay).
        assert all(
            concurrent(flows, victim, source)
            or any(v == victim and k == kind and s != source and tenants_overlapped(flows, s, source)
                   for v, s, k in replayed | live)
            for victim, source, kind in differ
        ), (path.name, sorted(differ))  # fmt: skip
        assert len(differ) <= max(8, len(live) // 5), (path.name, sorted(differ))


def concurrent(flows: list[http.HTTPFlow], victim: str, source_tenant: str) -> bool:
    """Request ``victim`` streamed while some request of ``source_tenant`` did."""
    answered = [f for f in flows if f.response is not None]
    spans = {
        f.request.headers["X-Request-ID"]: (f.request.timestamp_start, f.response.timestamp_end)
        for f in answered
    }
    start, end = spans[victim]
    return any(
        f.request.headers["X-Tenant-ID"] == source_tenant
        and f.request.timestamp_start < end
        and f.response.timestamp_end > start
        for f in answered
    )


def tenants_overlapped(flows: list[http.HTTPFlow], a: str, b: str) -> bool:
    """Some request of tenant ``a`` streamed while some request of tenant ``b`` did."""
    return any(
        concurrent(flows, f.request.headers["X-Request-ID"], b)
        for f in flows
        if f.response is not None and f.request.headers["X-Tenant-ID"] == a
    )


def tenant_keys(events: list[dict]) -> set[tuple[str, str, str]]:
    """Victim request, source tenant, kind."""
    return {(r, s, k) for r, _, s, _, k in leak_keys(events)}


def jsonl_line(flow: http.HTTPFlow) -> dict:
    """The crosstalk JSON-lines form of a flow (the format's documented fields)."""
    line = {
        "time": flow.metadata[OBSERVED_KEY],
        "response_time": flow.response.timestamp_start,
        "end_time": flow.response.timestamp_end,
        "headers": dict(flow.request.headers),
        "path": flow.request.path,
        "request": json.loads(flow.request.get_text()),
    }
    if "event-stream" in flow.response.headers.get("content-type", ""):
        line["sse"] = flow.response.get_text()
    else:
        line["response"] = json.loads(flow.response.get_text())
    return line


def test_plain_mitmdump_w_capture_replays_to_the_live_findings(tmp_path):
    """``mitmdump -s addons/crosstalk.py -w FILE`` (streamed bodies kept by mitmproxy's
    ``store_streamed_bodies``): no chunk timing, so streams are paced evenly; the
    injected leaks are found as live shadow mode found them."""
    config = tmp_path / "crosstalk.toml"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    flows = tmp_path / "plain.flows"
    with (
        run_sim(tmp_path, *SIM_ARGS) as sim,
        run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={config}", f"save_stream_file={flows}",
            "store_streamed_bodies=true",
        ) as proxy,
    ):  # fmt: skip
        results = run_workload(proxy.url, tenants=TENANTS, requests=120, seed=7, concurrency=8)
        ids = {r.request.request_id for r in results}
        live_events = wait_for_events(
            proxy.log,
            lambda ev: ids <= {e.get("request_id") for e in ev if e["event"] == "exchange"},
            timeout=30,
        )
        answers = {rid: sim.answer(rid) for rid in ids}
        truth = load_truth(sim.truth)
    log = tmp_path / "replay.jsonl"
    status = cli_main(["replay", str(flows), "--config", str(config), "--log-file", str(log)])
    events = read_events(log)
    j_live = judge(results, truth, live_events, answers.__getitem__)
    j = judge(results, truth, events, answers.__getitem__)
    live, replay = tenant_keys(live_events), tenant_keys(events)
    print(f"mitmdump -w: live {len(live)}, replay {len(replay)}, differ {len(live ^ replay)}")
    assert status == 1 and len(j.targets) >= 5
    found, found_live = ({f["request_id"] for f in x.found} for x in (j, j_live))
    assert len(found ^ found_live) <= 1, found ^ found_live
    # Without chunk timing the replay paces each stream evenly, so which source a
    # borderline finding names can differ from live: 0-2 of ~30 in most runs, 3 in about
    # one run of fifteen (measured after shadow work moved to the idle queue, which
    # makes the live order of engine calls depend on when the event loop was idle).
    assert len(live ^ replay) <= max(3, len(live) // 10), sorted(live ^ replay)


def test_two_files_are_merged_in_time_order(captured):
    with captured.flows.open("rb") as f:
        flows = list(FlowReader(f).stream())
    parts = [captured.root / "part-a.flows", captured.root / "part-b.flows"]
    with parts[0].open("wb") as a, parts[1].open("wb") as b:
        for n, flow in enumerate(flows):
            FlowWriter(a if n % 3 else b).add(flow)
    status, events = captured.replay(*parts, name="parts")
    assert status == 1
    assert leak_keys(events) == leak_keys(read_events(captured.live_log))


def chat_flow(tenant: str, prompt: str, answer: str, arrived: float, observed: float):
    """A buffered chat exchange as ``crosstalk run --capture`` saves it: the request
    complete at ``arrived``, observed by the addon at ``observed``."""
    flow = tflow.tflow(resp=True)
    flow.request.method, flow.request.path = "POST", "/v1/chat/completions"
    flow.request.headers["x-tenant-id"] = tenant
    flow.request.headers["x-request-id"] = f"{tenant}-{arrived:g}"
    flow.request.content = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": prompt}]}
    ).encode()
    flow.request.timestamp_start = flow.request.timestamp_end = arrived
    flow.metadata[OBSERVED_KEY] = observed
    flow.response.headers["content-type"] = "application/json"
    flow.response.content = json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
    ).encode()
    flow.response.timestamp_start = flow.response.timestamp_end = observed + 0.5
    return flow


def test_the_prompt_clock_is_when_the_request_arrived_not_when_it_was_scanned(captured):
    """A detector that falls behind observes a prompt late; the window is counted from
    the request's arrival at the proxy (live and in replay alike), so a source still in
    the window when the victim's request arrived is found, however late the scan."""
    private = (
        "Escrow release for Ingrid Vasquez-Olmstead: wire 48,913 NOK from account "
        "NO93 8601 1117 947 to the Tromsø depot before the ninth, reference KX-0193-ALPHA."
    )
    source = chat_flow("tenant-a", f"Please check this: {private}", "Done.", 1000.0, 1000.1)
    window = 60.0
    victim = chat_flow(
        "tenant-b", "What is on my agenda?", f"Here it is. {private}",
        arrived=1000.0 + window - 2, observed=1000.0 + window + 5,
    )  # fmt: skip
    path = captured.root / "late-scan.flows"
    with path.open("wb") as f:
        for flow in (source, victim):
            FlowWriter(f).add(flow)
    status, events = captured.replay(path, name="late-scan", extra=("--window", f"{window:g}"))
    found = [e for e in events if e["event"] == "leak.detected"]
    assert status == 1, found
    assert {(e["tenant"], e["source_tenant"]) for e in found} == {("tenant-b", "tenant-a")}


def test_a_body_no_decoder_reads_is_a_detector_error_that_quotes_none_of_it(captured):
    """A buffered answer labelled with an encoding it is not in (UTF-16, an odd number of
    bytes) cannot be scanned: a ``detector.error`` that names the failure, not the
    codec's message, which quotes the whole body."""
    answer = "Ingrid's escrow reference is KX-0193-ALPHA, account NO93 8601 1117 947."
    flow = chat_flow("tenant-u", "Anything for me?", answer, 2000.0, 2000.1)
    body = flow.response.content + b" " * (1 - len(flow.response.content) % 2)
    flow.response.headers["content-encoding"] = "utf-16"
    flow.response.raw_content = body
    path = captured.root / "mislabelled.flows"
    with path.open("wb") as f:
        FlowWriter(f).add(flow)
    _, events = captured.replay(path, name="mislabelled")
    (error,) = [e for e in events if e["event"] == "detector.error"]
    assert error["reason"].startswith(
        "body not decodable (content-encoding 'utf-16'): ValueError at "
    ), error
    logged = json.dumps(events)
    assert "escrow" not in logged and "KX-0193" not in logged and "NO93" not in logged


def test_an_engine_that_raises_on_a_prompt_fails_open_without_quoting_it(captured, monkeypatch):
    """The replay fails open on an engine error, as live, and logs the error's type and
    line: the engine's message may quote the prompt."""

    def observe(self, tenant, request_id, prompt, **kwargs):
        raise ValueError(f"cannot read {prompt!r}")

    monkeypatch.setattr(Engine, "observe_prompt", observe)
    flow = chat_flow("tenant-v", "Quote the Okonkwo settlement for me.", "Done.", 3000.0, 3000.1)
    path = captured.root / "engine-raises.flows"
    with path.open("wb") as f:
        FlowWriter(f).add(flow)
    _, events = captured.replay(path, name="engine-raises")
    (error,) = [e for e in events if e["event"] == "detector.error"]
    assert error["reason"].startswith("ValueError at "), error
    assert "Okonkwo" not in json.dumps(events)


# -- corrupt input -----------------------------------------------------------------------------


def first_flows(captured: Captured, n: int) -> list[bytes]:
    """The raw bytes of the capture's first ``n`` records."""
    records = []
    with captured.flows.open("rb") as f:
        reader = FlowReader(f).stream()
        start = 0
        for _ in range(n):
            next(reader)
            end = f.tell()
            f.seek(start)
            records.append(f.read(end - start))
            start = end
    return records


def skipped(events: list[dict]) -> list[tuple[int, int | None]]:
    return [(e["record"], e["offset"]) for e in events if e["event"] == "replay.skipped"]


def replayed(events: list[dict]) -> int:
    return next(e for e in events if e["event"] == "replay.finished")["records"]


def test_corrupt_flow_record_is_skipped_with_its_position(captured, capsys):
    one, two, three, four = first_flows(captured, 4)
    broken = two[:-1] + b"X"  # the record's closing type tag
    path = captured.root / "corrupt.flows"
    path.write_bytes(one + broken + three + four[: len(four) // 2])  # and the last cut short
    status, events = captured.replay(path, name="corrupt-flows")
    assert status in (1, 3)  # a finding, or else not clean: two records went unread
    assert skipped(events) == [(2, len(one)), (4, len(one) + len(two) + len(three))]
    assert replayed(events) == 2  # records 1 and 3
    err = capsys.readouterr().err
    assert f"record 2 (byte {len(one)})" in err and "corrupt flow record" in err


def test_flow_record_with_a_damaged_field_name_is_skipped(captured, capsys):
    """mitmproxy checks a flow's fields with ``assert``: a record whose field name lost a
    byte (as the fuzz test once made one) is a corrupt record, skipped with its
    position, and the next one is read."""
    one, two, three = first_flows(captured, 3)
    assert two.count(b"6:backup") == 1
    path = captured.root / "damaged-field.flows"
    path.write_bytes(one + two.replace(b"6:backup", b"6:\x00ackup") + three)
    status, events = captured.replay(path, name="damaged-field")
    assert status in (1, 3)
    assert skipped(events) == [(2, len(one))]
    assert replayed(events) == 2  # records 1 and 3
    assert "corrupt flow record: fields mitmproxy refused" in capsys.readouterr().err


def test_bad_and_truncated_jsonl_lines_are_skipped_with_their_line(captured, capsys):
    good = [
        {"time": 1000.0 + i, "tenant": f"t{i}", "path": "/v1/chat/completions",
         "request": {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]},
         "response": {"choices": [{"index": 0, "message": {"content": f"hi number {i}"}}]}}
        for i in range(3)
    ]  # fmt: skip
    lines = [json.dumps(good[0]), "{not json", json.dumps({"time": "yesterday", "path": "/v1"})]
    lines += [json.dumps(good[1]), "", json.dumps(good[2])[:40]]
    path = captured.root / "bad.jsonl"
    path.write_text("\n".join(lines))
    status, events = captured.replay(path, name="bad-jsonl")
    assert status == 3  # no leak in what was read, but three lines were not
    offsets = [sum(len(x) + 1 for x in lines[: n - 1]) for n in (2, 3, 6)]
    assert skipped(events) == list(zip((2, 3, 6), offsets, strict=True))
    assert replayed(events) == 2
    err = capsys.readouterr().err
    assert "record 6" in err and "cut short" in err and "record 3" in err and "time must be" in err


def test_bad_and_truncated_har_entries_are_skipped(captured):
    with captured.flows.open("rb") as f:
        flows = list(FlowReader(f).stream())[:3]
    har = SaveHar().make_har(flows)
    har["log"]["entries"][1]["startedDateTime"] = "not a date"
    text = json.dumps(har, indent=1)
    path = captured.root / "bad.har"
    path.write_text(text)
    status, events = captured.replay(path, name="bad-har")
    assert [r for r, _ in skipped(events)] == [2]
    assert replayed(events) == 2 and status in (1, 3)
    cut = captured.root / "cut.har"
    cut.write_text(text[: len(text) * 5 // 6])
    status, events = captured.replay(cut, name="cut-har")
    assert [r for r, _ in skipped(events)] == [2, 3]  # the bad one, then the cut one
    assert replayed(events) == 1


# -- time order, window, exit status ------------------------------------------------------------

SECRET = (
    "Invoice reference QZX-4471 for Margarethe Oyelaran-Brecht covers the quarterly "
    "maintenance of pump station seven near the old harbour gate"
)


def chat(time_: float, tenant: str, content: str, *, end: float | None = None, sse: str = ""):
    line = {
        "time": time_, "tenant": tenant, "path": "/v1/chat/completions",
        "request_id": f"{tenant}-{time_:g}",
        "request": {"model": "m", "stream": bool(sse),
                    "messages": [{"role": "user", "content": content}]},
    }  # fmt: skip
    if end is not None:
        line["end_time"] = end
    if sse:
        line["sse"] = sse
    else:
        line["response"] = {"choices": [{"index": 0, "message": {"content": "Noted, thanks."}}]}
    return line


def sse_of(words: list[str]) -> str:
    events = [
        "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": w + " "}}]}) + "\n\n"
        for w in words
    ]
    return "".join(events) + "data: [DONE]\n\n"


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


PLAIN = ("the answer to your question is as follows and " * 5).split()


def victim_stream(start: float, *, secret_first: bool = False) -> dict:
    """Tenant ``victim`` streams 45 plain words and the secret (after them, or before
    them) over 10 seconds."""
    words = SECRET.split() + PLAIN if secret_first else PLAIN + SECRET.split()
    return chat(start, "victim", "Tell me about pumps.", end=start + 10, sse=sse_of(words))


def test_prompts_are_observed_at_their_time_within_streams(tmp_path, captured):
    """Live, a prompt that reaches the proxy while another response streams is known to
    the rest of that stream, and only to the rest of it."""
    # The secret streams in the last third of the response (from about 6.5 s): a prompt
    # observed at 4 s is its source.
    during = [victim_stream(100.0), chat(104.0, "source", SECRET)]
    status, events = captured.replay(write_jsonl(tmp_path / "d.jsonl", during), name="during")
    assert status == 1
    assert {(e["tenant"], e["source_tenant"]) for e in events if e["event"] == "leak.detected"} == {
        ("victim", "source")
    }
    # The secret streamed in the first 3.5 s: the same prompt at 7 s, still during the
    # response, came too late to be its source (scanning the whole response at its end
    # would say otherwise); so did one after the response ended.
    for name, lines in [
        ("late", [victim_stream(100.0, secret_first=True), chat(107.0, "source", SECRET)]),
        ("after", [victim_stream(100.0), chat(111.0, "source", SECRET)]),
    ]:
        status, events = captured.replay(write_jsonl(tmp_path / f"{name}.jsonl", lines), name=name)
        assert status == 0 and not leak_keys(events), name


def test_window_can_be_widened_for_replay(tmp_path, captured):
    lines = [chat(1000.0, "source", SECRET), victim_stream(1000.0 + 2 * 3600)]
    path = write_jsonl(tmp_path / "window.jsonl", lines)
    status, events = captured.replay(path, name="window-default")
    assert status == 0 and not leak_keys(events)  # 10-minute window: the source expired
    status, events = captured.replay(path, name="window-3h", extra=("--window", "3h"))
    assert status == 1 and leak_keys(events)
    started = next(e for e in events if e["event"] == "replay.started")
    assert started["window_seconds"] == 3 * 3600


def test_sort_buffer_orders_a_file_that_is_out_of_order(tmp_path, captured):
    # In file order: two later requests, then the stream that started before them.
    lines = [chat(104.0, "source", SECRET), chat(104.5, "other", "Hi."), victim_stream(100.0)]
    path = write_jsonl(tmp_path / "order.jsonl", lines)
    status, events = captured.replay(path, name="sorted")
    finished = next(e for e in events if e["event"] == "replay.finished")
    assert status == 1 and finished["late"] == 0
    assert finished["traffic_from"] == "1970-01-01T00:01:40Z"
    # A buffer of one record corrects a record one place out of order, not two.
    status, events = captured.replay(path, name="unsorted", extra=("--sort-buffer", "1"))
    assert next(e for e in events if e["event"] == "replay.finished")["late"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.flows"], "cannot open"),
        (["{tmp}/junk.bin"], "not a flow file, HAR, JSON-lines capture, LiteLLM log"),
        (["{tmp}/ok.jsonl", "--report", "{tmp}/r.pdf"], "--report must end in"),
        (["{tmp}/ok.jsonl", "--window", "two hours"], "window must be"),
        (["{tmp}/ok.jsonl", "--window", "0h"], "window must be > 0"),
        (["{tmp}/ok.jsonl", "--config", "{tmp}/nope.toml"], "cannot read config"),
        (["{tmp}/ok.jsonl", "--state", "{tmp}/nope.npz"], "no such file"),
    ],
)
def test_unusable_arguments_or_input_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "junk.bin").write_bytes(os.urandom(2048).replace(b"{", b"(").lstrip(b"0123456789"))
    write_jsonl(tmp_path / "ok.jsonl", [chat(1.0, "a", "hello")])
    argv = ["replay", *(a.format(tmp=tmp_path) for a in args), "--log-file", str(tmp_path / "l")]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_exit_0_when_clean_and_1_on_a_leak(tmp_path, captured):
    clean = write_jsonl(tmp_path / "clean.jsonl", [chat(1.0, "a", SECRET), chat(2.0, "b", "Hi.")])
    assert captured.replay(clean, name="clean")[0] == 0
    leak = write_jsonl(
        tmp_path / "leak.jsonl", [chat(100.0, "source", SECRET), victim_stream(101.0)]
    )
    assert captured.replay(leak, name="leak")[0] == 1


# -- bounded memory, progress -----------------------------------------------------------------


def write_big(path: Path, fmt: str, n: int) -> None:
    """``n`` chat exchanges with a 200 KB prompt each, in ``fmt``."""
    body = "x" * 200_000
    if fmt == "jsonl":
        with path.open("w") as f:
            for i in range(n):
                f.write(json.dumps(chat(float(i), "t", body)) + "\n")
        return
    flows = []
    for i in range(n):
        flow = tflow.tflow(resp=True)
        flow.request.method, flow.request.path = "POST", "/v1/chat/completions"
        flow.request.content = body.encode()
        flow.request.timestamp_start = flow.request.timestamp_end = float(i)
        flows.append(flow)
    if fmt == "har":
        with path.open("w") as f:  # written entry by entry
            f.write('{"log": {"version": "1.2", "entries": [\n')
            f.write(",\n".join(json.dumps(e) for e in SaveHar().make_har(flows)["log"]["entries"]))
            f.write("]}}\n")
    else:
        with path.open("wb") as f:
            for flow in flows:
                FlowWriter(f).add(flow)


def reader_peak(path: Path, fmt: str) -> tuple[int, int]:
    """(records read, peak bytes allocated while reading them all)."""
    warm_up = open_input(path)  # the modules a first record imports are not the input
    next(read_records(warm_up, lambda s: pytest.fail(s.reason)))
    warm_up.close()
    source = open_input(path)
    assert source.format == fmt
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_records(source, lambda s: pytest.fail(s.reason)))
        return count, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        source.close()


@pytest.mark.parametrize("fmt", ["flows", "har", "jsonl"])
def test_readers_stream_in_bounded_memory(tmp_path, fmt):
    """20 MB and 80 MB of exchanges (200 KB each): reading the larger file takes no more
    memory than reading the smaller one (a read block and a record or two). Both sizes
    are past the first hundred records, over which Python 3.13's caches still grow (a
    few MB, then flat: measured up to 120 MB)."""
    peaks = []
    for n in (100, 400):
        path = tmp_path / f"big-{n}.{fmt}"
        write_big(path, fmt, n)
        assert path.stat().st_size > n * 200_000
        count, peak = reader_peak(path, fmt)
        assert count == n
        peaks.append(peak)
        path.unlink()
    small, large = peaks
    print(f"{fmt}: peak {small / 1e6:.1f} MB for 20 MB, {large / 1e6:.1f} MB for 80 MB")
    assert large < 1.15 * small + 1_000_000, peaks
    assert large < 400 * 200_000 / 3, peaks


def test_progress_line_on_a_terminal(tmp_path, captured):
    path = write_jsonl(
        tmp_path / "p.jsonl", [chat(float(i), f"t{i % 3}", "hello") for i in range(200)]
    )
    main_fd, child_fd = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "replay", str(path), "--config", str(captured.config),
         "--log-file", str(tmp_path / "p.log")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=child_fd,
    )  # fmt: skip
    os.close(child_fd)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main_fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(main_fd)
    assert proc.wait(10) == 0
    assert b"\r\x1b[K[" in out and b"200 records" in out and b"100.0%" in out
    assert orjson.loads((tmp_path / "p.log").read_bytes().splitlines()[-1])["records"] == 200


def test_a_capture_without_bodies_is_never_called_clean(tmp_path, capsys):
    """``mitmdump -w`` with ``stream_large_bodies`` set keeps no body of a streamed
    exchange: replay counts those exchanges as not scannable, names them in the summary
    and the report, and exits 3 (not 0) although it found nothing."""
    config = tmp_path / "crosstalk.toml"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    flows = tmp_path / "bodiless.flows"
    with (
        run_sim(tmp_path, "--leak-rate", "0") as sim,
        run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={config}", f"save_stream_file={flows}",
            "stream_large_bodies=1",
        ) as proxy,
    ):  # fmt: skip
        results = run_workload(proxy.url, tenants=4, requests=40, seed=5, concurrency=4)
        ids = {r.request.request_id for r in results}
        wait_for_events(
            proxy.log,
            lambda ev: ids <= {e.get("request_id") for e in ev if e["event"] == "exchange"},
            timeout=30,
        )
    report = tmp_path / "report.json"
    log = tmp_path / "replay.jsonl"
    capsys.readouterr()
    status = cli_main(["replay", str(flows), "--config", str(config), "--log-file", str(log),
                       "--report", str(report)])  # fmt: skip
    err = capsys.readouterr().err
    events = read_events(log)
    not_scannable = [e for e in events if e["event"] == "replay.not_scannable"]
    assert status == 3, err
    assert (
        not_scannable
        and len(not_scannable) == json.loads(report.read_text())["summary"]["unrecorded"]
    )
    assert f"({len(not_scannable)} without bodies in the capture)" in err and "not clean" in err
    assert all("body not in the capture" in e["reason"] for e in not_scannable)


LITELLM = Path(__file__).parent / "data" / "litellm-payloads.jsonl"


def test_litellm_logging_payloads_replay_to_the_planted_leak(tmp_path, capsys):
    """LiteLLM's StandardLoggingPayload lines (a sample written from
    litellm/types/utils.py's definition): found by content, tenants from the keys'
    teams, the leak in globex's answer traced to acme's request."""
    log = tmp_path / "litellm.jsonl"
    status = cli_main(["replay", str(LITELLM), "--log-file", str(log)])
    found = [e for e in read_events(log) if e["event"] == "leak.detected"]
    assert status == 1
    assert [(e["tenant"], e["source_tenant"]) for e in found] == [
        ("globex-support", "acme-finance")
    ]
    assert found[0]["source_request_id"] == "fb710734-986e-46cb-8ab8-ab67a26b7f62"
    # Message logging turned off (LiteLLM writes a placeholder): nothing to scan, never clean.
    redacted = tmp_path / "redacted.jsonl"
    lines = [json.loads(line) for line in LITELLM.read_text().splitlines()]
    for obj in lines:
        for message in obj["messages"]:
            message["content"] = "redacted-by-litellm"
        obj["response"]["choices"][0]["message"]["content"] = "redacted-by-litellm"
    redacted.write_text("".join(json.dumps(o) + "\n" for o in lines))
    capsys.readouterr()
    assert cli_main(["replay", str(redacted), "--log-file", str(tmp_path / "r.jsonl")]) == 3
    assert "(4 without bodies in the capture)" in capsys.readouterr().err
