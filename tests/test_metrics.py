"""Prometheus metrics (proxy/mitm/metrics.py): the real proxy, real clients, a real scrape.

``crosstalk run --metrics-port`` in front of the simulator; traffic from the openai SDK
(clean, degenerate, a malformed upstream answer, a canary leaked by a mis-route);
``/metrics`` scraped over HTTP and parsed with prometheus_client's own text parser; the
numbers must match the traffic sent and the proxy's event log.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import openai
from conftest import ROOT, TEST_KEY, free_port, read_events, run_mitmdump, stop, wait_for_port
from prometheus_client.parser import text_string_to_metric_families

SECRET_HEX = "a1" * 16


def scrape(port: int) -> dict[str, list]:
    """name -> [(labels, value)] of every sample."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


def send(url: str, tenant: str, rid: str, *, stream: bool, parts: int = 0, **headers: str) -> None:
    """One chat completion; with ``parts``, its user message is that many text parts."""
    c = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=30,
        default_headers={"X-Tenant-ID": tenant, "X-Request-ID": rid, **headers},
    )
    text = f"Tell me about order {rid} please."
    content = [{"type": "text", "text": f"{text} ({i})"} for i in range(parts)] if parts else text
    messages = [{"role": "user", "content": content}]
    try:
        if stream:
            for _ in c.chat.completions.create(model="m", messages=messages, stream=True):
                pass
        else:
            c.chat.completions.create(model="m", messages=messages)
    except openai.APIError:
        pass  # the malformed answer: the SDK cannot parse it; the proxy still counts it


def test_scrape_matches_the_traffic(tmp_path: Path):
    cfg = tmp_path / "crosstalk.toml"
    cfg.write_text(
        f'[detection]\nkey = "{TEST_KEY}"\n'
        f'[prevention]\ncache_salt_secret = "{SECRET_HEX}"\ninject_canary = true\n'
        "[metrics]\nmax_tenant_labels = 3\n"
    )
    sim_port, port, metrics_port = free_port(), free_port(), free_port()
    log = tmp_path / "events.jsonl"
    sim = subprocess.Popen(
        [sys.executable, "-m", "proxy", "sim", "--port", str(sim_port), "--token-delay", "0.001"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    proxy = None
    try:
        wait_for_port(sim_port, sim)
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "proxy",
                "run",
                "--upstream",
                f"http://127.0.0.1:{sim_port}",
                "--listen-port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--config",
                str(cfg),
                "--log-file",
                str(log),
            ],  # fmt: skip
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        wait_for_port(port, proxy)
        wait_for_port(metrics_port, proxy)
        before = scrape(metrics_port)
        assert value(before, "crosstalk_requests_total") == 0
        url = f"http://127.0.0.1:{port}"
        sent: list[str] = []  # tenants, in order

        def go(tenant: str, stream: bool, parts: int = 0, **headers: str) -> None:
            send(url, tenant, f"m{len(sent)}", stream=stream, parts=parts, **headers)
            sent.append(tenant)

        # First (the simulator mis-routes one of the latest other tenants' answers):
        go("t0", stream=False, **{"x-sim-echo": "system"})  # t0's canary, echoed (removed)
        go("t1", stream=True, **{"x-sim-fault": "misroute"})  # ... and leaked to t1
        for tenant in ("t0", "t1", "t2", "t3", "t4"):
            go(tenant, stream=True)
            go(tenant, stream=False)
        go("t0", stream=True, **{"x-sim-fault": "degenerate"})
        go("t3", stream=False, **{"x-sim-fault": "degenerate"})
        go("t2", stream=False, **{"x-sim-misbehave": "nonjson"})  # detector fails open
        # Parsing 3,000 parts makes more objects at once than the young generation
        # holds: the proxy collects after start-up, whatever the engine allocates (it
        # allocates few objects since 77931c4-96c2c2b: this traffic alone ran none).
        go("t1", stream=False, parts=3000)

        deadline = time.monotonic() + 15
        while True:
            samples = scrape(metrics_port)
            if (
                value(samples, "crosstalk_requests_total") >= len(sent)
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.1)
        events = read_events(log)
    finally:
        if proxy is not None:
            stop(proxy)
        stop(sim)

    # Requests by tenant (first 3 tenants named, then "other") and verdict, as logged.
    assert value(samples, "crosstalk_requests_total") == len(sent)
    exchanges = [e for e in events if e["event"] == "exchange"]
    assert len(exchanges) == len(sent)
    labels = {"t0": "t0", "t1": "t1", "t2": "t2", "t3": "other", "t4": "other"}
    expected = Counter((labels[e["tenant"]], e["verdict"]) for e in exchanges)
    scraped = {(lab["tenant"], lab["verdict"]): v for lab, v in samples["crosstalk_requests_total"]}
    assert scraped == expected
    assert Counter(labels[t] for t in sent) == Counter(
        {t: sum(v for (lt, _), v in scraped.items() if lt == t) for t, _ in scraped}
    )
    assert value(samples, "crosstalk_tenant_labels") == 3
    assert value(samples, "crosstalk_requests_total", verdict="leak") >= 1

    # Findings by kind and action, as logged; the canary leak among them.
    leaks = [e for e in events if e["event"] == "leak.detected"]
    assert Counter((e["kind"], e["action"]) for e in leaks) == {
        (lab["kind"], lab["action"]): v for lab, v in samples["crosstalk_findings_total"]
    }
    assert value(samples, "crosstalk_findings_total", kind="canary", action="logged") == 1
    assert [e["source_tenant"] for e in leaks if e["kind"] == "canary"] == ["t0"]

    # Degenerate outputs: the two forced faults, per upstream; the rate over the window.
    upstream = f"127.0.0.1:{sim_port}"
    degenerate = [e for e in events if e["event"] == "output.degenerate"]
    assert len(degenerate) == 2
    assert value(samples, "crosstalk_degenerate_outputs_total", upstream=upstream) == 2
    assert value(samples, "crosstalk_degenerate_window_exchanges", upstream=upstream) == len(sent)
    assert value(samples, "crosstalk_degenerate_rate", upstream=upstream) == 2 / len(sent)

    # Detector errors and fail-opens, journal errors, prevention counters.
    errors = [e for e in events if e["event"] == "detector.error"]
    assert len(errors) >= 1
    assert value(samples, "crosstalk_detector_errors_total") == len(errors)
    assert value(samples, "crosstalk_failed_open_total") == len(errors)
    assert value(samples, "crosstalk_failed_closed_total") == 0
    assert value(samples, "crosstalk_journal_errors_total") == 0
    assert value(samples, "crosstalk_canary_injected_total") == len(sent)
    assert value(samples, "crosstalk_canary_echoes_removed_total") == 1

    # Scan time per call, fingerprints held, evictions.
    assert value(samples, "crosstalk_scan_seconds_count") > len(sent)
    assert value(samples, "crosstalk_scan_seconds_bucket", le="+Inf") == value(
        samples, "crosstalk_scan_seconds_count"
    )
    assert value(samples, "crosstalk_fingerprints") > 0
    assert value(samples, "crosstalk_fingerprints_evicted_total") == 0
    # The collector's pauses: the process has run collections; the longest is one of them.
    assert value(samples, "crosstalk_gc_collections_total", generation="0") > 0
    longest = [
        value(samples, "crosstalk_gc_pause_longest_seconds", generation=str(g)) for g in range(3)
    ]
    assert 0 < max(longest) <= value(samples, "crosstalk_gc_pause_seconds_total")
    # The collector's own CPU time within each pause: never more than the pause itself.
    for g in range(3):
        cpu = value(samples, "crosstalk_gc_pause_longest_cpu_seconds", generation=str(g))
        assert 0 <= cpu <= longest[g] + 0.001
    # The shadow queue: drained (every exchange was logged), nothing failed. How many
    # ran late depends on the machine's load: counted, at most once an exchange.
    assert value(samples, "crosstalk_shadow_queue_items") == 0
    assert value(samples, "crosstalk_shadow_queue_errors_total") == 0
    assert 0 <= value(samples, "crosstalk_shadow_queue_overdue_total") <= len(sent)

    # Every metric the example alert rules use is exposed (index_*: with Redis only).
    rules = (ROOT / "config" / "prometheus-alerts.yml").read_text()
    used = {
        n for n in re.findall(r"\bcrosstalk_[a-z_]+", rules) if not n.startswith("crosstalk_index_")
    }
    assert used and used <= set(samples), used - set(samples)

    # The Grafana dashboard: every query names metrics this scrape has, and every
    # panel shows a series on this traffic (the shared index's panel: with Redis only).
    assert_dashboard_shows(samples)

    # No text of any prompt or output in any label.
    assert not any(
        "order" in str(lab) or "Tell me" in str(lab)
        for series in samples.values()
        for lab, _ in series
    )


_SELECTOR = re.compile(r"\b(crosstalk_[a-z_]+)(?:\{([^}]*)\})?")
_MATCHER = re.compile(r'(\w+)\s*(=~|=)\s*"([^"]*)"')


def series_for(samples: dict, selector: re.Match) -> list[dict]:
    """The scraped series a PromQL selector (``name{label="v"}``, ``=~``) selects."""
    name, matchers = selector.group(1), _MATCHER.findall(selector.group(2) or "")
    return [
        labels
        for labels, _ in samples.get(name, [])
        if all(
            re.fullmatch(v, labels.get(k, "")) if op == "=~" else labels.get(k) == v
            for k, op, v in matchers
        )
    ]


def assert_dashboard_shows(samples: dict) -> None:
    dashboard = json.loads((ROOT / "config" / "grafana" / "crosstalk.json").read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        selectors = [m for t in panel["targets"] for m in _SELECTOR.finditer(t["expr"])]
        names = {m.group(1) for m in selectors}
        assert names, panel["title"]
        if all(n.startswith("crosstalk_index_") for n in names):
            continue  # with [index] (Redis) only: tests/test_scaleout.py
        assert names <= set(samples), (panel["title"], names - set(samples))
        assert any(series_for(samples, m) for m in selectors), f"empty: {panel['title']}"


def test_mitmdump_script_option(tmp_path, sim):
    metrics_port = free_port()
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_metrics_port={metrics_port}") as proxy:
        wait_for_port(metrics_port, proxy.proc)
        send(proxy.url, "acme", "script-1", stream=True)
        deadline = time.monotonic() + 10
        while value(scrape(metrics_port), "crosstalk_requests_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert value(scrape(metrics_port), "crosstalk_requests_total", tenant="acme") == 1


def test_health_and_readiness_on_the_admin_port(tmp_path: Path, sim):
    """/healthz and /readyz answer on the metrics port (JSON), never on the proxy port:
    there the same paths go upstream like any other, untouched."""
    port, admin = free_port(), free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", "--upstream", sim.url, "--listen-port", str(port),
         "--metrics-port", str(admin), "--log-file", str(tmp_path / "events.jsonl")],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, proxy)
        wait_for_port(admin, proxy)

        def get(p: int, path: str) -> tuple[int, dict]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{p}{path}", timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                body = e.read()
                return e.code, json.loads(body) if body.startswith(b"{") else {"text": body}

        assert get(admin, "/healthz") == (200, {"status": "alive"})
        deadline = time.monotonic() + 30
        while (ready := get(admin, "/readyz"))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready == (200, {"ready": True, "detector": "ready", "index": "off"})
        assert get(admin, "/nowhere")[0] == 404
        assert (
            "crosstalk_requests_total"
            in urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10)
            .read()
            .decode()
        )
        # On the proxy port the same path is the upstream's (the simulator: 404).
        assert get(port, "/healthz")[0] == 404
    finally:
        stop(proxy)
