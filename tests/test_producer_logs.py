"""bench/producer_logs.py: the harness writes the lines the producers' real logging code
writes (vLLM 0.33.0, SGLang 0.5.23, the pinned LiteLLM and OpenLLMetry). Only the harness
is checked here (the line shapes each producer writes), not crosstalk's readers, but for
one replay of OpenLLMetry's spans with a planted leak.

The first run downloads the two wheels (vLLM 336 MB, SGLang 39 MB) into the pip cache
and extracts a few files into ~/.cache/crosstalk/producers; a download that fails
fails the tests (the readers would otherwise go untested against the real producers).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re
import sys
import time

import pytest
from conftest import bench_module

producer_logs = bench_module("producer_logs")
Exchange = producer_logs.Exchange

T0 = 1_764_930_000.0
LONG = "The acme ledger lists row 12 again. " * 90  # 3,240 characters: over 2,048

EXCHANGES = [
    Exchange(
        "acme",
        "req-acme-0001",
        "completions",
        "The vault code of acme is 4471. Continue:",
        "It is kept in row 12 of the ledger.",
        False,
        T0,
        T0 + 1.5,
    ),
    Exchange(
        "acme",
        "req-acme-0002",
        "chat",
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hello there"}],
        "Hi! How can I help acme today?",
        True,
        T0 + 0.2,
        T0 + 2.0,
    ),
    Exchange(
        "globex",
        "req-globex-0001",
        "chat",
        [{"role": "user", "content": "Summarise ticket 99 for Globex."}],
        "Ticket 99 is about a broken pump in hall B.",
        False,
        T0 + 0.5,
        T0 + 0.9,
    ),
    Exchange(
        "globex",
        "req-globex-0002",
        "completions",
        "Once upon a time",
        " there was a tiny pump.",
        True,
        T0 + 0.6,
        T0 + 1.2,
    ),
]


@pytest.fixture(scope="module")
def sources() -> None:
    for name in ("vllm", "sglang"):
        try:
            producer_logs.ensure_source(name)
        except producer_logs.SourceUnavailable as exc:
            pytest.fail(f"the pinned {name} wheel cannot be downloaded: {exc}")


def local(ts: float, fmt: str) -> str:
    return time.strftime(fmt, time.localtime(ts))


def lines_of(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


# --------------------------------------------------------------------------- vLLM

VLLM_PREFIX = re.compile(
    r"^\(APIServer pid=1\) (DEBUG|INFO) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\.py:\d+\] (.*)$"
)


def vllm_messages(lines: list[str]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        m = VLLM_PREFIX.match(line)
        assert m, line
        out.append((m.group(1), m.group(2)))
    return out


def test_vllm_debug_writes_prompts_outputs_and_deltas(sources, tmp_path) -> None:
    [path] = producer_logs.vllm_log(EXCHANGES, tmp_path / "vllm.log")
    lines = lines_of(path)
    messages = vllm_messages(lines)
    text = "\n".join(m for _, m in messages)
    assert lines[0].startswith(f"(APIServer pid=1) DEBUG {local(T0, '%m-%d %H:%M:%S')} ")
    assert "[entrypoints/.../utils/request_logger.py:" in lines[0]  # DEBUG: relative path
    # completions: input as cmpl-{X-Request-Id}-0, outputs as cmpl-{X-Request-Id}
    assert (
        "Request cmpl-acme:req-acme-0001-0 details: prompt: "
        "'The vault code of acme is 4471. Continue:', prompt_token_ids: [" in text
    )
    assert "Received request cmpl-acme:req-acme-0001-0: params: SamplingParams(n=1, " in text
    assert "max_tokens=512, " in text and ", lora_request: None." in text
    assert re.search(
        r"^Generated response cmpl-acme:req-acme-0001 details: output_token_ids: \[\d+(, \d+)*\]$",
        text,
        re.M,
    )
    assert (
        "Generated response cmpl-acme:req-acme-0001: output: "
        "'It is kept in row 12 of the ledger.', finish_reason: stop" in text
    )
    # chat: the rendered template under chatcmpl-{X-Request-Id}
    assert (
        "Request chatcmpl-acme:req-acme-0002 details: prompt: "
        "'<|system|>\\nYou help.\\n<|user|>\\nHello there\\n<|assistant|>\\n'" in text
    )
    # a stream: one delta line per word, then the whole text
    deltas = re.findall(
        r"^Generated response chatcmpl-acme:req-acme-0002 \(streaming delta\): "
        r"output: ('.*'), finish_reason: (\w+)$",
        text,
        re.M,
    )
    assert "".join(ast.literal_eval(d) for d, _ in deltas) == EXCHANGES[1].output
    assert [f for _, f in deltas] == ["None"] * (len(deltas) - 1) + ["stop"]
    assert (
        "Generated response chatcmpl-acme:req-acme-0002 (streaming complete): output: "
        "'Hi! How can I help acme today?', finish_reason: streaming_complete" in text
    )
    assert (
        "Generated response chatcmpl-acme:req-acme-0002 (streaming complete) details: "
        "output_token_ids: None" in text
    )
    # the JSON body of every request (_check_model), under the body's own request id
    bodies = [
        json.loads(m.group(1))
        for _, msg in messages
        if (m := re.match(r"Request [0-9a-f]{16} JSON body: (\{.*\})$", msg))
    ]
    assert len(bodies) == 4
    assert bodies[0] == {
        "model": producer_logs.MODEL,
        "prompt": "The vault code of acme is 4471. Continue:",
        "max_tokens": 512,
        "stream": False,
    }
    assert bodies[1]["messages"][1] == {"content": "Hello there", "role": "user"}
    # interleaved by time: globex's request arrives before acme's first answer
    first_output = text.index("Generated response cmpl-acme:req-acme-0001:")
    assert text.index("Request chatcmpl-globex:req-globex-0001 details") < first_output


def test_vllm_info_has_no_prompt(sources, tmp_path) -> None:
    [path] = producer_logs.vllm_log(EXCHANGES, tmp_path / "vllm.log", level="INFO")
    messages = vllm_messages(lines_of(path))
    assert {level for level, _ in messages} == {"INFO"}
    text = "\n".join(m for _, m in messages)
    assert messages[0][1].startswith("`--enable-log-requests` is set but the minimum log level")
    assert " details: " not in text and " JSON body: " not in text
    for x in EXCHANGES:
        assert producer_logs.prompt_text(x) not in text
    assert "Received request chatcmpl-globex:req-globex-0001: params: SamplingParams(" in text
    assert "Generated response cmpl-globex:req-globex-0002 (streaming delta): output: " in text
    assert "[request_logger.py:" in lines_of(path)[1]  # INFO: the file name only


def test_vllm_max_log_len_and_no_outputs(sources, tmp_path) -> None:
    [path] = producer_logs.vllm_log(
        EXCHANGES, tmp_path / "cut.log", max_log_len=10, log_deltas=False
    )
    text = path.read_text()
    assert "details: prompt: 'The vault ', prompt_token_ids: [" in text
    assert "Generated response cmpl-acme:req-acme-0001: output: 'It is kept'," in text
    assert "(streaming delta)" not in text and "(streaming complete)" in text
    [path] = producer_logs.vllm_log(EXCHANGES, tmp_path / "in.log", log_outputs=False)
    text = path.read_text()
    assert "Generated response" not in text and text.count("Received request") == 4


# --------------------------------------------------------------------------- SGLang

SGLANG_PREFIX = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] (.*)$")
LONG_EXCHANGE = Exchange(
    "acme", "req-acme-0003", "completions", LONG, "Noted.", False, T0 + 3, T0 + 4
)


def test_sglang_text_level_2_cuts_long_strings(sources, tmp_path) -> None:
    [path] = producer_logs.sglang_log([*EXCHANGES, LONG_EXCHANGE], tmp_path / "sglang.log", level=2)
    lines = lines_of(path)
    assert len(lines) == 3 * 5  # Receive OpenAI, Receive, Finish
    for line in lines:
        assert SGLANG_PREFIX.match(line), line
    assert lines[0] == (
        f"[{local(T0, '%Y-%m-%d %H:%M:%S')}] Receive OpenAI: obj={{'model': "
        f"'{producer_logs.MODEL}', 'prompt': 'The vault code of acme is 4471. Continue:', "
        + lines[0].split("Continue:', ", 1)[1]
    )
    assert lines[0].endswith(", headers={'x-tenant-id': 'acme'}")
    assert lines[1].startswith(
        f"[{local(T0, '%Y-%m-%d %H:%M:%S')}] Receive: obj=GenerateReqInput(rid='"
    )
    assert "text='The vault code of acme is 4471. Continue:', input_ids=None," in lines[1]
    assert "sampling_params={'temperature': 1.0, 'max_new_tokens': 512," in lines[1]
    assert re.search(r"received_time=\d+\.\d+,", lines[1])
    # chat: token ids when received, the rendered template once finished
    receive = next(x for x in lines if "Receive: " in x and "'globex'" in x)
    assert "text=None, input_ids=[" in receive
    finish = next(x for x in lines if "Finish: " in x and "'globex'" in x)
    assert "text='<|user|>\\nSummarise ticket 99 for Globex.\\n<|assistant|>\\n'" in finish
    assert (
        ", headers={'x-tenant-id': 'globex'}, out={'text': "
        "'Ticket 99 is about a broken pump in hall B.', 'output_ids': [" in finish
    )
    assert "'meta_info': {'id': '" in finish and "'finish_reason': {'type': 'stop'" in finish
    # level 2: a string over 2,048 characters is its first and last 1,024
    long_lines = [x for x in lines if "The acme ledger" in x]
    assert len(long_lines) == 3
    cut = f"{LONG[:1024]!r} ... {LONG[-1024:]!r}"
    for line in long_lines:
        assert cut in line and repr(LONG) not in line


def test_sglang_json_hosts_and_clocks(sources, tmp_path) -> None:
    paths = producer_logs.sglang_log(
        EXCHANGES, tmp_path / "sglang.log", level=3, fmt="json", hosts=2
    )
    assert [p.name for p in paths] == ["sglang-host0.log", "sglang-host1.log"]
    received = {}
    for k, path in enumerate(paths):
        records = []
        for line in lines_of(path):
            m = SGLANG_PREFIX.match(line)
            assert m, line
            record = json.loads(m.group(2))
            assert record["timestamp"].replace("T", " ").startswith(m.group(1))
            records.append(record)
        hosted = EXCHANGES[k::2]
        assert [r["event"] for r in records].count("request.finished") == len(hosted)
        for r in records:
            assert r["headers"] == {"x-tenant-id": r["headers"]["x-tenant-id"]}
            if r["event"] == "request.received":
                received[r["obj"]["rid"]] = (k, r["obj"]["received_time"])
            if r["event"] == "request.finished":
                x = next(x for x in hosted if x.output == r["out"]["text"])
                assert r["headers"]["x-tenant-id"] == x.tenant
                assert r["out"]["meta_info"]["response_sent_to_client_ts"] == x.end
                assert r["timestamp"] == producer_logs._dt.datetime.fromtimestamp(x.end).isoformat()
    # received_time is each host's perf_counter: seconds since its boot, not an epoch
    by_host = {k: t for k, t in received.values()}
    assert 86_400 <= by_host[0] < 100_000 and by_host[1] > by_host[0] + 86_400


def test_sglang_levels_0_and_1_log_no_text(sources, tmp_path) -> None:
    for level in (0, 1):
        [path] = producer_logs.sglang_log(EXCHANGES, tmp_path / f"l{level}.log", level=level)
        text = path.read_text()
        assert "Receive OpenAI" not in text  # level 2 and up
        assert text.count("Receive: obj=GenerateReqInput(rid=") == 4
        assert text.count("Finish: obj=GenerateReqInput(rid=") == 4
        for x in EXCHANGES:
            assert x.output not in text and producer_logs.prompt_text(x) not in text
        assert ("sampling_params=" in text) == (level == 1)
        assert "out={'meta_info': {'id': " in text


def test_producers_leave_the_process_as_it_was(sources, tmp_path) -> None:
    environ = dict(os.environ)
    factory = logging.getLogRecordFactory()
    producer_logs.vllm_log(EXCHANGES[:1], tmp_path / "v.log")
    producer_logs.sglang_log(EXCHANGES[:1], tmp_path / "s.log")
    tops = ("vllm", "sglang", "torch", "msgspec", "zmq")
    assert not [m for m in sys.modules if m.split(".")[0] in tops]
    assert dict(os.environ) == environ
    assert logging.getLogRecordFactory() is factory
    assert not logging.getLogger("vllm").handlers
    assert not logging.getLogger("sglang.srt.utils.request_logger.stdout").handlers


# --------------------------------------------------------------------------- LiteLLM


@pytest.mark.parametrize("setup", ["sdk", "proxy"])
def test_litellm_payloads(tmp_path, setup) -> None:
    [path] = producer_logs.litellm_log(EXCHANGES, tmp_path / "litellm.jsonl", setup=setup)
    payloads = [json.loads(line) for line in lines_of(path)]
    by_end = sorted(EXCHANGES, key=lambda x: x.end)
    assert [p["litellm_call_id"] for p in payloads] == [x.request_id for x in by_end]
    for p, x in zip(payloads, by_end, strict=True):
        assert p["status"] == "success"
        assert p["call_type"] == ("acompletion" if x.api == "chat" else "atext_completion")
        assert p["model"] == producer_logs.MODEL
        assert x.output in json.dumps(p["response"])
        assert p["messages"][-1]["content"] in json.dumps(x.prompt)
        assert p["model_parameters"]["stream"] is x.streamed
        assert p["stream"] is (True if x.streamed else None)
        metadata = p["metadata"]
        if setup == "sdk":
            assert p["model_parameters"]["user"] == x.tenant
            assert metadata["user_api_key_team_alias"] is None
        else:
            assert "user" not in p["model_parameters"]
            assert metadata["user_api_key_team_alias"] == x.tenant
            assert metadata["user_api_key_alias"] == f"{x.tenant}-key"
            assert re.fullmatch(r"[0-9a-f]{64}", metadata["user_api_key_hash"])


# --------------------------------------------------------------------------- OpenTelemetry

HEX32, HEX16 = re.compile(r"[0-9a-f]{32}"), re.compile(r"[0-9a-f]{16}")


def otel_spans(path) -> list[tuple[dict, dict, dict]]:
    """Every span of an OTLP/JSON file: (span, its attributes as a dict, its scope)."""
    out = []
    for line in lines_of(path):
        export = json.loads(line)
        assert set(export) == {"resourceSpans"}
        for rs in export["resourceSpans"]:
            resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            assert resource["service.name"] == {"stringValue": producer_logs.OTEL_SERVICE}
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    attrs = {a["key"]: a["value"] for a in span.get("attributes", [])}
                    out.append((span, attrs, ss["scope"]))
    return out


def genai_spans(path) -> dict[str, tuple[dict, dict]]:
    """The GenAI spans of a file by request id (the X-Request-Id the call carried)."""
    found = {}
    for span, attrs, scope in otel_spans(path):
        if "gen_ai.operation.name" in attrs:
            assert scope == {
                "name": "opentelemetry.instrumentation.openai.v1",
                "version": producer_logs.PINS["openllmetry"],
            }
            rid = re.search(r"'X-Request-Id': '([^']+)'", attrs["gen_ai.headers"]["stringValue"])
            found[rid.group(1)] = (span, attrs)
    return found


def test_otel_spans_hold_the_calls(tmp_path) -> None:
    import openai

    environ = dict(os.environ)
    methods = [
        openai.resources.chat.completions.Completions.create,
        openai.resources.completions.Completions.create,
    ]
    [path] = producer_logs.otel_log(EXCHANGES, tmp_path / "otel.jsonl")
    # one line per exchange's trace, in the order the calls ended
    assert len(lines_of(path)) == 4
    spans = otel_spans(path)
    assert len(spans) == 8  # the application's request span and OpenLLMetry's
    for span, _attrs, _scope in spans:
        assert HEX32.fullmatch(span["traceId"]) and HEX16.fullmatch(span["spanId"])
        assert int(span["startTimeUnixNano"]) <= int(span["endTimeUnixNano"])
        assert isinstance(span["kind"], int)  # OTLP/JSON: enums as integers
    parents = {s["spanId"]: (s, a) for s, a, scope in spans if scope["name"] == "support-desk"}
    genai = genai_spans(path)
    assert set(genai) == {x.request_id for x in EXCHANGES}
    for x in EXCHANGES:
        span, attrs = genai[x.request_id]
        assert span["kind"] == 3  # SPAN_KIND_CLIENT
        assert attrs["tenant.id"] == {"stringValue": x.tenant}
        parent, parent_attrs = parents[span["parentSpanId"]]
        assert parent["traceId"] == span["traceId"] and parent["name"] == "POST /v1/answer"
        assert parent_attrs["tenant.id"] == {"stringValue": x.tenant}
        # the call's span is moved to the exchange's time, its parent around it
        assert int(span["startTimeUnixNano"]) == round(x.start * 1e9)
        assert int(span["endTimeUnixNano"]) == round(x.end * 1e9)
        assert int(parent["startTimeUnixNano"]) <= int(span["startTimeUnixNano"])
        assert attrs["gen_ai.operation.name"]["stringValue"] == (
            "chat" if x.api == "chat" else "text_completion"
        )
        assert attrs["gen_ai.is_streaming"] == {"boolValue": x.streamed}
        prefix = "chatcmpl" if x.api == "chat" else "cmpl"
        assert attrs["gen_ai.response.id"] == {"stringValue": f"{prefix}-{x.request_id}"}
        outputs = json.loads(attrs["gen_ai.output.messages"]["stringValue"])
        assert outputs == [
            {
                "role": "assistant",
                "parts": [{"content": x.output, "type": "text"}],
                "finish_reason": "stop",
            }
        ]
        inputs = json.loads(attrs["gen_ai.input.messages"]["stringValue"])
        texts = [p["content"] for m in inputs for p in m["parts"]]
        if x.api == "chat":
            assert texts == [m["content"] for m in x.prompt]
        else:
            assert texts == [x.prompt]
        # a streamed chat: one event per chunk, no text in them
        chunks = span.get("events", [])
        if x.streamed and x.api == "chat":
            assert chunks and {e["name"] for e in chunks} == {"gen_ai.content.completion.chunk"}
            assert all(x.start * 1e9 <= int(e["timeUnixNano"]) <= x.end * 1e9 for e in chunks)
        else:
            assert not chunks
    # the process as it was: environment, no instrumentation left on the SDK
    assert dict(os.environ) == environ
    assert methods == [
        openai.resources.chat.completions.Completions.create,
        openai.resources.completions.Completions.create,
    ]


def test_otel_without_content_capture(tmp_path) -> None:
    [path] = producer_logs.otel_log(EXCHANGES, tmp_path / "otel.jsonl", capture_content=False)
    text = path.read_text()
    for x in EXCHANGES:
        assert x.output not in text
        assert producer_logs.prompt_text(x) not in text
        for m in x.prompt if isinstance(x.prompt, list) else []:
            assert m["content"] not in text
    genai = genai_spans(path)
    assert len(genai) == 4
    for x in EXCHANGES:
        _span, attrs = genai[x.request_id]
        assert attrs["tenant.id"] == {"stringValue": x.tenant}
        assert "gen_ai.input.messages" not in attrs and "gen_ai.output.messages" not in attrs


def test_otel_attribute_limit_and_tenant_attribute(tmp_path) -> None:
    [path] = producer_logs.otel_log(
        EXCHANGES,
        tmp_path / "otel.jsonl",
        max_attribute_length=40,
        tenant_attribute="enduser.id",
    )
    for _span, attrs, _scope in otel_spans(path):
        assert "tenant.id" not in attrs and "enduser.id" in attrs
        for value in attrs.values():
            assert len(value.get("stringValue", "")) <= 40
    for x in EXCHANGES:
        _span, attrs = genai_spans_by_response(path)[x.request_id]
        cut = attrs["gen_ai.output.messages"]["stringValue"]
        assert len(cut) == 40 and cut.startswith('[{"role": "assistant", "parts": [')


def genai_spans_by_response(path) -> dict[str, tuple[dict, dict]]:
    """The GenAI spans by request id, from ``gen_ai.response.id`` (``gen_ai.headers`` is
    cut too under a small attribute length limit)."""
    found = {}
    for span, attrs, _scope in otel_spans(path):
        if "gen_ai.response.id" in attrs:
            rid = re.sub(r"^(?:chat)?cmpl-", "", attrs["gen_ai.response.id"]["stringValue"])
            found[rid] = (span, attrs)
    return found


def test_otel_replay_finds_a_planted_leak(tmp_path) -> None:
    """crosstalk replay on OpenLLMetry's spans: tenant B's answer repeating tenant A's
    private prompt sentence is found, with A as its source."""
    producer_replay = bench_module("producer_replay")
    secret = (
        "Please wire 4,218,730.55 to account NO93 8601 1117 947 for the Halvorsen merger "
        "and copy ingrid.halvorsen@krenner-logistics.no before the audit on 14 March."
    )
    xs = [
        Exchange(
            "acme",
            "req-acme-0100",
            "chat",
            [{"role": "user", "content": f"Draft a short reply to our bank. {secret}"}],
            "Dear bank, we confirm the transfer as instructed. Kind regards.",
            True,
            T0,
            T0 + 2,
        ),
        Exchange(
            "globex",
            "req-globex-0100",
            "completions",
            "Explain what a heap is in one paragraph:",
            f" A heap is a tree kept in an array. {secret}",
            False,
            T0 + 5,
            T0 + 7,
        ),
        *EXCHANGES,
    ]
    [path] = producer_logs.otel_log(xs, tmp_path / "otel.jsonl")
    code, summary, events, stderr = producer_replay.replay([path], tmp_path, "otel", ())
    assert code == 1, stderr
    assert summary["exchanges"] == 6 and summary["per_input"][0]["complete"] == 6
    assert summary["per_input"][0]["format"] == "otel"
    leaks = [e for e in events if e.get("event") == "leak.detected"]
    assert leaks
    assert {(e["tenant"], e["source_tenant"]) for e in leaks} == {("globex", "acme")}
    assert {e["request_id"] for e in leaks} == {"cmpl-req-globex-0100"}
    assert {e["source_request_id"] for e in leaks} == {"chatcmpl-req-acme-0100"}
