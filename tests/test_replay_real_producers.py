"""``crosstalk replay`` on logs written by the producers' own logging code (vLLM 0.33.0,
SGLang 0.5.23, LiteLLM, pinned in ``bench/producer_logs.py``), against the same
exchanges replayed from crosstalk's own capture (issue 43).

Ground truth is the workload's record of its injected leaks; the reference is what the
replay of crosstalk's JSON-lines capture of the same exchanges flags. A log that keeps
all the text must let the replay flag every one of those; a log that does not (vLLM at
INFO or without --enable-log-outputs, SGLang below level 2, a length limit) must never
end clean (exit 0) nor count its exchanges complete.
"""

from __future__ import annotations

import argparse

import pytest
from conftest import bench_module

producer_replay = bench_module("producer_replay")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    args = argparse.Namespace(exchanges=160, seed=11, tenants=6, leak_rate=0.15)
    return {r.variant: r for r in producer_replay.run(args, tmp_path_factory.mktemp("producers"))}


def test_the_reference_replay_finds_leaks(rows):
    assert all(r.reference > 0 for r in rows.values())


@pytest.mark.parametrize("variant", [v.name for v in producer_replay.VARIANTS if v.replayable])
def test_a_log_that_keeps_the_text_finds_what_the_capture_finds(rows, variant):
    r = rows[variant]
    assert r.returncode == 1, r
    assert r.found_of_reference == r.reference, r
    assert r.complete == r.exchanges, r
    assert r.clean_flagged <= r.reference_clean_flagged, r


@pytest.mark.parametrize("variant", [v.name for v in producer_replay.VARIANTS if not v.replayable])
def test_a_log_that_lacks_text_never_ends_clean(rows, variant):
    r = rows[variant]
    assert r.returncode in (1, 3), r
    assert r.complete < r.exchanges, r
    if r.returncode == 3:
        assert r.reason, r


def test_vllm_info_outputs_are_scanned_without_their_prompts(tmp_path):
    """vLLM's default level logs no prompt, only outputs: a leak of one tenant's answer
    into another's is still found, and the replay says the prompts were not there."""
    producer_logs = producer_replay.producers
    secret = (
        "The Halvorsen merger closes on 14 March; wire 4,218,730.55 to account NO93 8601 1117 "
        "947 and copy ingrid.halvorsen@krenner-logistics.no before the audit is complete."
    )
    t0 = 1_764_930_000.0
    xs = [
        producer_logs.Exchange("acme", "req-a", "completions", "Summarise the deal memo.", secret,
                               False, t0, t0 + 2),
        producer_logs.Exchange("globex", "req-g", "completions", "What is a heap?",
                               f"A heap is a tree. {secret}", False, t0 + 5, t0 + 7),
    ]  # fmt: skip
    files = producer_logs.vllm_log(xs, tmp_path / "vllm.log", level="INFO")
    code, summary, events, stderr = producer_replay.replay(
        files, tmp_path, "info", tuple(producer_replay.VLLM_TENANT)
    )
    leaks = [e for e in events if e.get("event") == "leak.detected"]
    assert code == 1
    assert {(e["tenant"], e["source_tenant"]) for e in leaks} == {("globex", "acme")}
    assert summary["unrecorded"] == 2
    assert all("no prompt" in " ".join(e["partial_text"]) for e in leaks)
    assert any(
        "DEBUG" in str(e.get("reason")) for e in events if e.get("event") == "replay.not_scannable"
    )


def test_openllmetry_completions_replay_as_completions(tmp_path):
    """OpenLLMetry logs a completions call's prompt as one user message: replayed on the
    chat route, a prompt holding a rendered chat template would be read as one user
    turn, not as the conversation the proxy reads live (seed 7 flagged two answers to
    the same question that way)."""
    import json

    from proxy.forensics.otel import span_exchange

    producer_logs = producer_replay.producers
    prompt = "<|im_start|>user\nWhat is a heap?<|im_end|>\n<|im_start|>assistant\n"
    xs = [producer_logs.Exchange("acme", "req-a", "completions", prompt, "A tree.", False,
                                 1_764_930_000.0, 1_764_930_001.0)]  # fmt: skip
    (path,) = producer_logs.otel_log(xs, tmp_path / "otel.jsonl")
    spans = [
        (span, rs.get("resource", {}))
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    exchanges = [x for s, _ in spans if (x := span_exchange(s, {})) is not None]
    assert [(x.path, x.request, x.response["choices"][0]["text"]) for x in exchanges] == [
        ("/v1/completions", {"prompt": prompt}, "A tree.")
    ]


def test_sglang_lines_without_a_time_keep_their_order_and_say_so(tmp_path):
    """SGLang's received_time is the host's perf_counter: with the lines' own times cut
    off (a log shipper that keeps only the message), it still orders the file's
    requests, the leak is found, and every exchange says its time is approximate."""
    import re

    producer_logs = producer_replay.producers
    secret = (
        "Wire 4,218,730.55 to NO93 8601 1117 947 and copy ingrid.halvorsen@krenner-logistics.no."
    )
    t0 = 1_764_930_000.0
    xs = [
        producer_logs.Exchange("acme", "req-a", "completions", f"Note: {secret}", "Noted.",
                               False, t0, t0 + 2),
        producer_logs.Exchange("globex", "req-g", "completions", "What is a heap?",
                               f"A heap is a tree. {secret}", False, t0 + 5, t0 + 7),
    ]  # fmt: skip
    (path,) = producer_logs.sglang_log(xs, tmp_path / "sglang.log", level=3)
    stripped = tmp_path / "stripped.log"
    stripped.write_text(re.sub(r"(?m)^\[[^\]]+\] ", "", path.read_text()))
    code, summary, events, stderr = producer_replay.replay([stripped], tmp_path, "stripped", ())
    leaks = [e for e in events if e.get("event") == "leak.detected"]
    assert code == 1, stderr[-1500:]
    assert {(e["tenant"], e["source_tenant"]) for e in leaks} == {("globex", "acme")}
    assert summary["skipped"] == 0 and summary["partial"] == 2
    assert all("time approximate" in " ".join(e["partial_text"]) for e in leaks)
