"""``crosstalk replay`` on the logs operators already have: SGLang's and vLLM's request
logs, OpenTelemetry GenAI traces (LiteLLM's payloads are in test_replay.py).

The samples in tests/data were written from each project's own definitions (the sources
named in docs/forensics.md, "Logs as input"); each has the same planted leak: globex's
second answer repeats what acme's first prompt said. The ground truth is read from the
sample text here, never from the readers under test.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_events
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.cli import main as cli_main
from proxy.forensics import pyrepr

DATA = Path(__file__).parent / "data"
SECRET = "Project Bluefin acquisition closes on June 14"


def replay(tmp_path: Path, *args: str) -> tuple[int, list[dict], dict]:
    log, report = tmp_path / "events.jsonl", tmp_path / "report.json"
    status = cli_main(["replay", *args, "--log-file", str(log), "--report", str(report)])
    return status, read_events(log), json.loads(report.read_text()) if report.exists() else {}


def leaks(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "leak.detected"]


def line_with(path: Path, text: str) -> str:
    return next(line for line in path.read_text().splitlines() if text in line)


def test_sglang_text_log_finds_the_leak_and_names_the_cut_prompt(tmp_path):
    """``--log-requests-level 2``, text format: tenants from the logged tenant header,
    the source is acme's request, and the 3,000-character contract prompt that level 2
    cut to its two ends is reported as partial."""
    sample = DATA / "sglang-requests.log"
    source_rid = re.search(r"rid='(\w+)'", line_with(sample, "Draft a two-line status")).group(1)
    victim_rid = re.search(r"rid='(\w+)'", line_with(sample, "Any news I should know")).group(1)
    status, events, report = replay(tmp_path, str(sample))
    found = leaks(events)
    assert status == 1
    assert [(e["tenant"], e["source_tenant"]) for e in found] == [("globex", "acme")]
    assert found[0]["request_id"] == victim_rid and found[0]["source_request_id"] == source_rid
    assert "partial_text" not in found[0]  # both texts were whole
    (seen,) = report["summary"]["per_input"]
    assert seen["format"] == "sglang"
    assert (seen["exchanges"], seen["complete"], seen["partial"]) == (4, 3, 1)
    assert report["summary"]["partial"] == 1


def test_sglang_json_log_behind_a_time_prefix(tmp_path):
    """The JSON format (``request.received`` / ``request.finished`` events), as the newer
    formatter writes it with a ``[time] `` prefix; gzip-compressed, found by content."""
    packed = tmp_path / "sglang.log.gz"
    packed.write_bytes(gzip.compress((DATA / "sglang-requests-json.log").read_bytes()))
    status, events, report = replay(tmp_path, str(packed))
    assert status == 1
    assert [(e["tenant"], e["source_tenant"]) for e in leaks(events)] == [("globex", "acme")]
    assert report["summary"]["per_input"][0]["partial"] == 1  # head + "..." + tail


def test_sglang_levels_without_text_are_never_clean(tmp_path):
    """Levels 0 and 1 log ids and counts, no text: every exchange is not scannable and
    the exit status says so (3), with the setting that would fix it."""
    log = tmp_path / "level1.log"
    lines = []
    for n, (tenant, t) in enumerate([("acme", "10:15:02"), ("globex", "10:15:03")]):
        obj = f"GenerateReqInput(rid='r{n}', session_id=None, sampling_params={{'max_new_tokens': 8}}, stream=False)"
        lines.append(f"[2026-05-04 {t}] Receive: obj={obj}, headers={{'x-tenant-id': '{tenant}'}}")
        out = f"{{'meta_info': {{'id': 'r{n}', 'prompt_tokens': 9, 'completion_tokens': 8, 'e2e_latency': 0.5}}}}"
        lines.append(
            f"[2026-05-04 {t}] Finish: obj={obj}, headers={{'x-tenant-id': '{tenant}'}}, out={out}"
        )
    log.write_text("\n".join(lines) + "\n")
    status, events, report = replay(tmp_path, str(log))
    assert status == 3
    unseen = [e for e in events if e["event"] == "replay.not_scannable"]
    assert len(unseen) == 2 and all("level 3" in e["reason"] for e in unseen)
    assert report["summary"]["per_input"][0]["complete"] == 0


def test_vllm_log_needs_a_tenant_and_then_finds_the_leak(tmp_path, capsys):
    """vLLM logs no tenant: without ``--tenant-from`` the replay says so and exits 3 (all
    four exchanges one tenant: nothing could be found). With the tenant taken from the
    request id the gateway set, the leak is found with its source; the prompt cut by
    ``--max-log-len 400`` (to 400 characters and 400 token ids) is reported partial."""
    sample = DATA / "vllm-requests.log"
    source_id = re.search(r"Received request (\S+):", line_with(sample, "Draft a two-line")).group(
        1
    )
    status, events, report = replay(tmp_path, str(sample))
    err = capsys.readouterr().err
    assert status == 3
    assert "no tenant field" in err and "--tenant-from" in err
    assert [e["input"] for e in events if e["event"] == "replay.no_tenant"] == [str(sample)]
    assert report["summary"]["untenanted"] == 4 and not leaks(events)

    status, events, report = replay(
        tmp_path, str(sample), "--tenant-from", "request_id",
        "--tenant-pattern", r"^chatcmpl-([a-z]+)-",
    )  # fmt: skip
    found = leaks(events)
    assert status == 1
    assert [(e["tenant"], e["source_tenant"], e["source_request_id"]) for e in found] == [
        ("globex", "acme", source_id)
    ]
    (seen,) = report["summary"]["per_input"]
    assert (seen["untenanted"], seen["partial"], seen["complete"]) == (0, 1, 3)


def test_vllm_without_logged_outputs_is_not_clean(tmp_path):
    """Without ``--enable-log-outputs`` vLLM logs prompts only: the prompts are still
    fingerprinted, the outputs are counted as not in the log."""
    log = tmp_path / "prompts-only.log"
    kept = [line for line in (DATA / "vllm-requests.log").read_text().splitlines()
            if "Generated response" not in line]  # fmt: skip
    log.write_text("\n".join(kept) + "\n")
    status, events, report = replay(
        tmp_path, str(log), "--tenant-from", "request_id", "--tenant-pattern", "^chatcmpl-([a-z]+)-"
    )
    assert status == 3
    unseen = [e for e in events if e["event"] == "replay.not_scannable"]
    assert len(unseen) == 4
    assert all("--enable-log-outputs" in e["reason"] for e in unseen)


def test_findings_on_cut_text_are_marked_in_the_report(tmp_path):
    """A finding whose victim text the log cut says so, in the event and the report."""
    status, events, report = replay(
        tmp_path, str(DATA / "vllm-requests.log"), "--tenant-from", "request_id",
        "--tenant-pattern", "^chatcmpl-([a-z]+)-", "--max-log-len", "120",
        "--report", str(tmp_path / "report.md"),
    )  # fmt: skip
    found = leaks(events)
    assert status == 1 and found
    victim, source = found[0]["partial_text"]  # both texts were over 120 characters
    assert victim.startswith("victim: ") and "output cut by the log" in victim
    assert source.startswith("source: ") and "prompt cut by the log" in source
    assert report["incidents"][0]["findings_on_partial_text"] == len(found)
    markdown = (tmp_path / "report.md").read_text()
    assert "What each input let the replay see" in markdown and "on partial text" in markdown


def test_otel_traces_new_and_legacy_forms(tmp_path):
    """Collector file-exporter lines: 1.37 message attributes and the 1.27 span events
    both read; the tenant from ``tenant.id``; the input messages cut by an attribute
    length limit (the JSON no longer parses) are reported partial, not skipped."""
    sample = DATA / "otel-genai-traces.jsonl"
    spans = [json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
             for line in sample.read_text().splitlines()]  # fmt: skip
    ids = [next(a["value"]["stringValue"] for a in s["attributes"] if a["key"] == "gen_ai.response.id")
           for s in spans]  # fmt: skip
    status, events, report = replay(tmp_path, str(sample))
    found = leaks(events)
    assert status == 1
    assert [(e["tenant"], e["source_tenant"]) for e in found] == [("globex", "acme")]
    assert found[0]["request_id"] == ids[2] and found[0]["source_request_id"] == ids[0]
    (seen,) = report["summary"]["per_input"]
    assert (seen["exchanges"], seen["partial"], seen["complete"]) == (4, 1, 3)
    assert report["summary"]["skipped"] == 0


def test_otel_spans_without_content_or_genai_attributes(tmp_path):
    """Message content is opt-in: a GenAI span without it is not scannable (exit 3). A
    span that is not an LLM call (an HTTP server span) is not an exchange."""
    line = json.loads((DATA / "otel-genai-traces.jsonl").read_text().splitlines()[0])
    span = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["attributes"] = [a for a in span["attributes"] if not a["key"].endswith("messages")
                          and a["key"] != "gen_ai.system_instructions"]  # fmt: skip
    http_span = {"traceId": "ab" * 16, "spanId": "cd" * 8, "name": "POST /chat",
                 "startTimeUnixNano": span["startTimeUnixNano"], "endTimeUnixNano": span["endTimeUnixNano"],
                 "attributes": [{"key": "http.route", "value": {"stringValue": "/chat"}}]}  # fmt: skip
    line["resourceSpans"][0]["scopeSpans"][0]["spans"].append(http_span)
    trace = tmp_path / "traces.json"  # no .jsonl suffix: found by content
    trace.write_text(json.dumps(line) + "\n")
    status, events, report = replay(tmp_path, str(trace))
    assert status == 3
    (unseen,) = [e for e in events if e["event"] == "replay.not_scannable"]
    assert "captured no message content" in unseen["reason"]
    assert report["summary"]["exchanges"] == 1


def test_tenant_from_is_refused_for_http_captures(tmp_path, capsys):
    har = tmp_path / "capture.har"
    har.write_text(json.dumps({"log": {"version": "1.2", "entries": []}}))
    assert cli_main(["replay", str(har), "--tenant-from", "user"]) == 2
    assert "[tenants] rules" in capsys.readouterr().err
    assert cli_main(["replay", str(DATA / "vllm-requests.log"), "--tenant-pattern", "x"]) == 2


def test_format_is_sniffed_per_file_and_merged(tmp_path):
    """Three formats in one replay, each found by content (names without telling
    suffixes) and merged in time order. (The three samples tell the same story at the
    same times, so once globex has said the text in one input it is globex's own in the
    others: one leak between acme and globex, not two.)"""
    inputs = []
    for n, name in enumerate(
        ["sglang-requests.log", "otel-genai-traces.jsonl", "litellm-payloads.jsonl"]
    ):
        copy = tmp_path / f"input-{n}.txt"
        shutil.copy(DATA / name, copy)
        inputs.append(str(copy))
    status, events, report = replay(tmp_path, *inputs)
    assert status == 1
    per_input = report["summary"]["per_input"]
    assert [(r["format"], r["exchanges"]) for r in per_input] == [
        ("sglang", 4), ("otel", 4), ("litellm", 4)
    ]  # fmt: skip
    assert report["summary"]["late"] == 0
    # LiteLLM names the teams differently (acme-finance, globex-support), and the samples
    # share their times, so which acme is the source first depends on the merge order.
    found = {(e["tenant"], e["source_tenant"]) for e in leaks(events)}
    assert found and all(v.startswith("globex") and s.startswith("acme") for v, s in found)


# -- the repr reader ----------------------------------------------------------------------


def test_repr_reader_values_cuts_and_opaque_fields():
    text = (
        "GenerateReqInput(rid='a1', text='first' ... 'last', input_ids=[1, 2, 3], "
        "sampling_params={'max_new_tokens': 8, 'stop': ['\\n']}, image=<PIL.Image at 0x7f>, "
        "lora=LoRARequest(lora_name='acme', lora_int_id=1), ratio=-1.5e-3, ok=True, q=\"it's\")"
    )
    value, end = pyrepr.parse(text)
    assert end == len(text)
    assert value["rid"] == "a1" and value["input_ids"] == [1, 2, 3]
    assert value["text"] == pyrepr.Cut("first", "last")
    assert pyrepr.text_of(value["text"]) == ("first\n...\nlast", True)
    assert value["sampling_params"] == {"max_new_tokens": 8, "stop": ["\n"]}
    assert value["image"] == pyrepr.Opaque("<PIL.Image at 0x7f>")
    assert value["lora"] == {"lora_name": "acme", "lora_int_id": 1}
    assert (value["ratio"], value["ok"], value["q"]) == (-1.5e-3, True, "it's")
    fields, _ = pyrepr.parse_fields(
        "prompt: 'hi', prompt_embeds shape: None, finish_reason: stop", 0, ":"
    )
    assert fields == {"prompt": "hi", "prompt_embeds shape": None, "finish_reason": "stop"}


TEXTS = st.text(st.characters(exclude_categories=("Cs",)), max_size=300)


@settings(max_examples=300, deadline=None)
@given(TEXTS, TEXTS)
def test_repr_reader_reads_back_the_strings_python_wrote(a, b):
    """Strings as ``repr`` writes them (either quote, escapes, line breaks, backslashes
    before a quote) read back unchanged, alone and as a call's fields."""
    assert pyrepr.parse(repr(a)) == (a, len(repr(a)))
    text = f"GenerateReqInput(rid={b!r}, text={a!r}, out={{'text': {b!r}}})"
    assert pyrepr.parse(text) == ({"rid": b, "text": a, "out": {"text": b}}, len(text))


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXTS
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXTS, inner, max_size=4),
    max_leaves=20,
)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(NAMES, VALUES, max_size=6), st.sampled_from([", ", ",", " , "]))
@example({"input_ids": [1, -(2**63) - 1, 2**64]}, ", ")
def test_repr_reader_reads_back_the_calls_python_wrote(fields, comma):
    """A call's fields as ``repr`` writes their values (numbers of any size, constants,
    strings, nested lists and dicts) read back unchanged, however the commas are spaced."""
    text = "Req(" + comma.join(f"{k}={v!r}" for k, v in fields.items()) + ")"
    assert pyrepr.parse(text) == (fields, len(text))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        # Blanks are skipped only from a space, tab or line break on (then any): the
        # one-match read of a scalar item must not skip more than the reader would.
        ("f(a=1\xa0,b=2)", None),
        ("{'a':\x0c1}", {"a": pyrepr.Opaque("\x0c1")}),
        ("{'a' :\n\xa0 'x' , 'b':2}", {"a": "x", "b": 2}),
        # Integer lists JSON would not take are the reader's, not orjson's.
        ("f(ids=[01, 2], n=[-00])", {"ids": [1, 2], "n": [0]}),
    ],
)
def test_repr_reader_skips_only_the_blanks_it_should(text, value):
    if value is None:
        with pytest.raises(pyrepr.ReprError):
            pyrepr.parse(text)
    else:
        assert pyrepr.parse(text) == (value, len(text))


@pytest.mark.parametrize(
    "text",
    ["f(a='x", "[1, 2", "{'a': }", "f(a=1 b=2)", "(" * 100 + ")" * 100, "f(a=1 Okonkwo)", "[1 zq]"],
)
def test_repr_reader_rejects_broken_text_with_a_value_error(text):
    """A ``ValueError`` that says where, never what it read (its message is logged)."""
    with pytest.raises(ValueError) as raised:
        pyrepr.parse(text)
    message = str(raised.value)
    assert not [word for word in ("Okonkwo", "zq", "b=2", "'x") if word in message], message


# -- hostile and broken logs (found in review) ---------------------------------------------


def test_text_inside_a_prompt_cannot_choose_the_reader(tmp_path):
    """A JSON-lines capture whose first prompt quotes an SGLang log line is still JSON
    lines; a marker counts only at the start of a log line."""
    line = {"time": 1000.0, "tenant": "t", "path": "/v1/chat/completions",
            "request": {"messages": [{"role": "user", "content":
                        "[2026-05-04 10:15:02] Finish: obj=GenerateReqInput(rid='x')"}]},
            "response": {"choices": [{"message": {"content": "ok"}}]}}  # fmt: skip
    path = tmp_path / "capture.jsonl"
    path.write_text(json.dumps(line) + "\n")
    status, _, report = replay(tmp_path, str(path))
    assert status == 0 and report["summary"]["per_input"][0]["format"] == "jsonl"


def test_a_trace_export_named_jsonl_with_a_long_first_line_is_otel(tmp_path):
    line = json.loads((DATA / "otel-genai-traces.jsonl").read_text().splitlines()[0])
    spans = line["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans += [dict(spans[0], spanId=f"{i:016x}") for i in range(200)]  # > 64 KB on one line
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(line) + "\n")
    assert len(path.read_bytes()) > 65536
    status, _, report = replay(tmp_path, str(path))
    assert report["summary"]["per_input"][0]["format"] == "otel"
    assert report["summary"]["exchanges"] == 201


def test_odd_values_skip_their_record_and_the_replay_goes_on(tmp_path):
    """A lone surrogate in a logged string is read (as U+FFFD); a time of 400 digits,
    an OTel span without a start, a Finish line cut short each cost their own record,
    said with its place; the rest is replayed."""
    vllm = (DATA / "vllm-requests.log").read_text().splitlines()
    vllm[0] = vllm[0].replace("Draft a two-line", r"Draft \ud800 a two-line")  # a repr escape
    vllm_path = tmp_path / "vllm.log"
    vllm_path.write_text("\n".join(vllm) + "\n")
    sglang = (DATA / "sglang-requests.log").read_text().splitlines()
    sglang[1] = sglang[1].replace("received_time=", "received_time=" + "9" * 400 + "+")
    sglang[-1] = sglang[-1][: len(sglang[-1]) // 2]  # the last Finish line, cut short
    sglang_path = tmp_path / "sglang.log"
    sglang_path.write_text("\n".join(sglang) + "\n")
    otel = json.loads((DATA / "otel-genai-traces.jsonl").read_text().splitlines()[0])
    spans = otel["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append({k: v for k, v in spans[0].items() if k != "startTimeUnixNano"})
    otel_path = tmp_path / "otel.jsonl"
    otel_path.write_text(json.dumps(otel) + "\n")
    status, events, report = replay(
        tmp_path, str(vllm_path), str(sglang_path), str(otel_path),
        "--tenant-from", "request_id", "--tenant-pattern", "^chatcmpl-([a-z]+)-",
    )  # fmt: skip
    skipped = [e for e in events if e["event"] == "replay.skipped"]
    where = sorted((Path(e["path"]).name, e["record"]) for e in skipped)
    assert where == [("otel.jsonl", 1), ("sglang.log", 2), ("sglang.log", len(sglang))], where
    per = {Path(r["input"]).name: r["exchanges"] for r in report["summary"]["per_input"]}
    assert per["vllm.log"] == 4 and per["otel.jsonl"] == 1
    assert status == 1 and report["summary"]["skipped"] == 3  # vLLM's leak is still found


def test_a_skipped_line_is_said_without_its_text(tmp_path, capsys):
    """A vLLM line cut inside its prompt is skipped with its place and why, in the log,
    on stderr and in the reports, and none of them quotes the prompt: the reader's
    message says where it stopped, never what it read there."""
    lines = (DATA / "vllm-requests.log").read_text().splitlines()
    private = "Hi, Okonkwo: wire the settlement to IBAN GB33BUKB20201555555555 tonight"
    cut = (
        lines[0].replace("chatcmpl-acme-", "chatcmpl-acme-cut").replace("Draft a two-line", private)
    )
    lines.append(cut[: cut.index("settlement") + 30])  # cut inside the prompt, no newline
    path = tmp_path / "vllm.log"
    path.write_text("\n".join(lines))
    status, events, report = replay(
        tmp_path, str(path), "--report", str(tmp_path / "report.html"),
        "--tenant-from", "request_id", "--tenant-pattern", "^chatcmpl-([a-z]+)-",
    )  # fmt: skip
    (skipped,) = [e for e in events if e["event"] == "replay.skipped"]
    assert skipped["record"] == len(lines) and "cut short" in skipped["reason"], skipped
    assert "'…'" not in skipped["reason"]  # the reader quoted nothing to take out
    said = "".join(
        [(tmp_path / name).read_text() for name in ("events.jsonl", "report.json", "report.html")]
        + [capsys.readouterr().err]
    )
    assert "skipped" in said and report["summary"]["skipped"] == 1
    for word in ("Okonkwo", "settlement", "GB33", "BUKB", "wire the"):
        assert word not in said, word


def test_an_input_with_no_exchange_is_not_clean(tmp_path, capsys):
    """Read with the wrong --format, a file yields nothing: that is never "clean"."""
    status, _, report = replay(tmp_path, str(DATA / "sglang-requests.log"), "--format", "vllm")
    assert status == 3
    assert report["summary"]["per_input"][0]["exchanges"] == 0
    assert "no LLM exchange" in capsys.readouterr().err


def test_recorded_headers_read_as_mitmproxy_headers_do():
    """Records read from logs carry ``RecordedHeaders``; the replay reads them as it
    reads a flow's mitmproxy ``Headers``: case-insensitive, repeated values joined."""
    from mitmproxy import http

    from proxy.forensics.inputs import RecordedHeaders

    ours, theirs = (
        RecordedHeaders(content_type="text/plain"),
        http.Headers(content_type="text/plain"),
    )
    for headers in (ours, theirs):
        headers.add("X-Tenant-ID", "a")
        headers.add("x-tenant-id", "b")
        headers["X-Request-ID"] = "r1"
        headers["x-request-id"] = "r2"
    for name in ("content-type", "Content-Type", "x-tenant-id", "X-REQUEST-ID", "absent"):
        assert ours.get(name) == theirs.get(name), name
    assert ours.get("x-tenant-id") == "a, b"
    assert ours.get("absent", "none") == theirs.get("absent", "none") == "none"


def test_a_replay_of_logs_imports_neither_mitmproxy_http_nor_pyjwt():
    """~22 MB of a replay's RSS: only flow and HAR files need mitmproxy's HTTP model,
    only JWT tenants PyJWT."""
    code = (
        "import sys, proxy.cli, proxy.commands.replay, proxy.forensics.readers\n"
        "print(sorted(m for m in ('mitmproxy.http', 'mitmproxy.io', 'jwt') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
