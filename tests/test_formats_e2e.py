"""The other API formats end to end: Anthropic Messages (the ``anthropic`` SDK), OpenAI
Responses (the ``openai`` SDK), SGLang ``/generate`` and TGI ``/generate[_stream]`` (plain
HTTP), through a real mitmdump with the crosstalk addon, against the simulator speaking each
format with fault injection.

Every client authenticates with its own API key (``x-api-key`` for Anthropic, a bearer token
for the others) and sends no tenant header: the proxy maps keys to tenants
(``[tenants.api_keys]``), the simulator names tenants by key. Shadow mode must log the
leaks with the right source and change no byte; enforce mode must cut them with the API's
own error event or error body, which the SDKs raise as errors, and leave clean traffic
byte-identical.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import orjson
import pytest
import traffic
from conftest import run_mitmdump, run_sim, wait_for_events
from traffic import Judgement, load_truth, private_words_reached_client

from proxy.pipeline.exchange import BLOCK_MESSAGE
from proxy.protocols import ProtocolError, Route
from proxy.protocols.sse import SSEDecoder
from proxy.sim.workload import SimRequest, Workload

FORMATS = ("anthropic", "responses", "sglang", "tgi")
REQUESTS, TENANTS = 1600, 16  # 400 a format
SIM_ARGS = ("--token-delay", "0.001", "--split-words", "--leak-rate", "0.15", "--seed", "5")
MODEL = "sim-llm-1"
# Floors below the measured figures, as in test_leaks_e2e: 2026-12-06 at 5c5a0db, shadow
# 142/145 and enforce 126/130 (a finding must point into the leaked text), no format
# under 30/32 in shadow or 33/36 in enforce. The per-format floor is there to catch one
# format's parsing going wrong, so sampling must not reach it: at ~30 targets a format
# one borderline, order-dependent miss costs 3 points.
MIN_RECALL, MIN_FORMAT_RECALL, MIN_RIGHT_SOURCE, MAX_FALSE_POSITIVES = 0.93, 0.85, 0.95, 0.005


def key_of(tenant: str) -> str:
    return f"sk-{tenant}"


def tenant_of_key(name: str | None) -> str | None:
    """The simulator names tenants by their key; the proxy maps keys to tenant names."""
    return name.removeprefix("sk-") if name else name


@pytest.fixture
def keyed_config(warm_config: Path) -> Path:
    """The warm config plus every workload tenant's API key."""
    keys = "\n".join(f'"{key_of(f"tenant-{i:02d}")}" = "tenant-{i:02d}"' for i in range(64))
    warm_config.write_text(warm_config.read_text() + f"\n[tenants.api_keys]\n{keys}\n")
    return warm_config


# --- clients --------------------------------------------------------------------------------


@dataclass
class Result:
    fmt: str
    request: SimRequest
    body: bytes = b""
    status: int = 200
    error: str | None = None  # what the client saw go wrong

    @property
    def route(self) -> Route:
        return route_of(self.fmt, self.request.stream)

    @property
    def text(self) -> str:
        return output_text(self.route, self.body, self.request.stream)


def route_of(fmt: str, stream: bool) -> Route:
    return {
        "anthropic": Route("anthropic", "messages"),
        "responses": Route("responses", "responses"),
        "sglang": Route("textgen", "generate"),
        "tgi": Route("textgen", "generate_stream" if stream else "generate"),
        "vllm": Route("textgen", "generate"),
    }[fmt]


def output_text(route: Route, body: bytes, stream: bool) -> str:
    """Choice 0's output text in ``body``, read with the proxy's own parsers."""
    if not stream:
        try:
            return "".join(d.text for d in route.parse_response(body) if d.choice == 0)
        except ProtocolError:
            return ""
    parser, decoder = route.stream_parser(), SSEDecoder()
    return "".join(d.text for e in decoder.feed(body) for d in parser.feed(e) if d.choice == 0)


def split_system(req: SimRequest) -> tuple[str, list[dict]]:
    system = "\n".join(m["content"] for m in req.messages if m["role"] == "system")
    return system, [m for m in req.messages if m["role"] != "system"]


def read_stream(resp, result: Result) -> bytes:
    """The raw bytes of a streamed response. A stream the proxy cut ends without HTTP/1.1's
    last chunk (the connection closes after the error event): what arrived is the body."""
    chunks = []
    try:
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
    except Exception as e:  # noqa: BLE001 -- httpx2's RemoteProtocolError, whatever its module
        result.error = f"{type(e).__name__}: {e}"
    return b"".join(chunks)


def send_anthropic(url: str, req: SimRequest, result: Result) -> None:
    client = anthropic.Anthropic(
        base_url=url, api_key=key_of(req.tenant), max_retries=0, timeout=60,
        default_headers={"X-Request-ID": req.request_id},
    )  # fmt: skip
    system, messages = split_system(req)
    kwargs = {"model": MODEL, "max_tokens": 4096, "messages": messages}
    if system:
        kwargs["system"] = system
    try:
        if req.stream:
            with client.messages.with_streaming_response.create(stream=True, **kwargs) as resp:
                result.body = read_stream(resp, result)
        else:
            result.body = client.messages.with_raw_response.create(**kwargs).http_response.content
    except anthropic.APIStatusError as e:
        result.status, result.error, result.body = e.status_code, str(e), e.response.content


def send_responses(url: str, req: SimRequest, result: Result) -> None:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key=key_of(req.tenant), max_retries=0, timeout=60,
        default_headers={"X-Request-ID": req.request_id},
    )  # fmt: skip
    system, messages = split_system(req)
    kwargs = {"model": MODEL, "input": messages if len(messages) > 1 else messages[0]["content"]}
    if system:
        kwargs["instructions"] = system
    api = client.responses
    try:
        if req.stream:
            with api.with_streaming_response.create(stream=True, **kwargs) as resp:
                result.body = read_stream(resp, result)
        else:
            result.body = api.with_raw_response.create(**kwargs).http_response.content
    except openai.APIStatusError as e:
        result.status, result.error, result.body = e.status_code, str(e), e.response.content


def post(url: str, path: str, body: dict, tenant: str, request_id: str) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key_of(tenant)}",
            "X-Request-ID": request_id,
        },
    )
    return read(request)


def read(request: urllib.request.Request) -> tuple[int, bytes]:
    """Status and body; a stream the proxy cut ends without HTTP/1.1's last chunk (the
    connection closes after the error event): what arrived is the body."""
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            try:
                return response.status, response.read()
            except http.client.IncompleteRead as e:
                return response.status, e.partial
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def send_textgen(url: str, req: SimRequest, result: Result) -> None:
    prompt = req.prompt_text()
    if result.fmt == "sglang":
        path, body = "/generate", {"text": prompt, "stream": req.stream}
    elif result.fmt == "vllm":
        path, body = "/generate", {"prompt": prompt, "stream": req.stream}
    else:
        path = "/generate_stream" if req.stream else "/generate"
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 4096}}
    result.status, result.body = post(url, path, body, req.tenant, req.request_id)
    if result.status != 200:
        result.error = f"status {result.status}"


SENDERS = {
    "anthropic": send_anthropic,
    "responses": send_responses,
    "sglang": send_textgen,
    "tgi": send_textgen,
    "vllm": send_textgen,
}


def send(url: str, fmt: str, req: SimRequest) -> Result:
    result = Result(fmt, req)
    SENDERS[fmt](url, req, result)
    return result


def run_formats(url: str, *, requests: int, seed: int, concurrency: int = 16) -> list[Result]:
    """The simulator's multi-tenant workload, each request in one of FORMATS in turn."""
    reqs = list(Workload(tenants=TENANTS, seed=seed).requests(requests))
    jobs = [(FORMATS[i % len(FORMATS)], r) for i, r in enumerate(reqs)]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda job: send(url, *job), jobs))


# --- judging --------------------------------------------------------------------------------


def judge(results: list[Result], truth: list[dict], events: list[dict], answer_of) -> Judgement:
    """tests/traffic.py's judge, for these formats: truth tenants are keys, mapped back to
    tenant names."""
    named = [
        {
            **t,
            "victim_tenant": tenant_of_key(t["victim_tenant"]),
            "source_tenant": tenant_of_key(t["source_tenant"]),
        }
        for t in truth
    ]
    return traffic.judge(
        results,
        named,
        events,
        answer_of,
    )


def per_format(j: Judgement, results: list[Result]) -> dict[str, tuple[int, int, int]]:
    """Format -> (targets, found, found with the right source)."""
    fmt = {r.request.request_id: r.fmt for r in results}
    out = {}
    for name in FORMATS:
        count = [
            sum(1 for f in group if fmt[f["request_id"]] == name)
            for group in (j.targets, j.found, j.right_source)
        ]
        out[name] = tuple(count)
    return out


def exchanges_logged(proxy, results):
    ids = {r.request.request_id for r in results}
    return wait_for_events(
        proxy.log,
        lambda ev: ids <= {e.get("request_id") for e in ev if e["event"] == "exchange"},
        timeout=30,
    )


def report(j: Judgement, results: list[Result]) -> str:
    return (
        f"targets={len(j.targets)} found={len(j.found)} right_source={len(j.right_source)} "
        f"per format (targets, found, right source)={per_format(j, results)} "
        f"missed={[(m['request_id'], m['kind'], m['leaked_text'][:60]) for m in j.missed]} "
        f"clean={j.clean} clean_flagged={j.clean_flagged}"
    )


def assert_detection(j: Judgement, results: list[Result]) -> None:
    figures = per_format(j, results)
    assert len(j.targets) >= 40, report(j, results)
    assert len(j.found) / len(j.targets) >= MIN_RECALL, report(j, results)
    assert len(j.right_source) / len(j.found) >= MIN_RIGHT_SOURCE, report(j, results)
    assert len(j.clean_flagged) / j.clean <= MAX_FALSE_POSITIVES, report(j, results)
    for name, (targets, found, _) in figures.items():
        assert targets >= 5 and found / targets >= MIN_FORMAT_RECALL, (name, report(j, results))


# --- the API's own error format ---------------------------------------------------------------


def last_event(body: bytes):
    decoder = SSEDecoder()
    events = decoder.feed(body)
    events += decoder.close()
    return [e for e in events if e.data.strip() != "[DONE]"][-1]


def assert_cut_in_format(fmt: str, body: bytes) -> None:
    """A cut stream ends with one error event in the API's own format."""
    event = last_event(body)
    data = orjson.loads(event.data)
    if fmt == "anthropic":
        assert event.event == "error" and data["type"] == "error"
        assert (
            data["error"]["type"] == "permission_error"
            and data["error"]["code"] == "cross_tenant_leak"
        )
        assert data["error"]["message"] == BLOCK_MESSAGE
    elif fmt == "responses":
        assert event.event == "error" and data["type"] == "error"
        assert data["code"] == data["error"]["code"] == "cross_tenant_leak"
        numbers = [orjson.loads(e.data)["sequence_number"] for e in SSEDecoder().feed(body)[:-1]]
        assert data["sequence_number"] > max(numbers, default=-1)
    elif fmt == "tgi":  # TGI's own: an "error" string and an "error_type"
        assert data == {"error": BLOCK_MESSAGE, "error_type": "cross_tenant_leak"}
    else:  # SGLang's {"error": {...}} then [DONE]
        assert data["error"]["code"] == "cross_tenant_leak"
        assert body.endswith(b"data: [DONE]\n\n")


def assert_block_body_in_format(fmt: str, status: int, body: bytes) -> None:
    assert status == 451, (status, body[:200])
    data = orjson.loads(body)
    if fmt == "anthropic":
        assert data["type"] == "error" and data["error"]["type"] == "permission_error"
    else:
        assert data["error"]["code"] == "cross_tenant_leak"


# --- the workload -----------------------------------------------------------------------------


def test_shadow_logs_leaks_in_every_format_and_changes_nothing(tmp_path, keyed_config):
    with (
        run_sim(tmp_path, *SIM_ARGS) as sim,
        run_mitmdump(tmp_path, sim.url, f"crosstalk_config={keyed_config}") as proxy,
    ):
        results = run_formats(proxy.url, requests=REQUESTS, seed=31)
        events = exchanges_logged(proxy, results)
        for r in results:
            assert r.error is None, (r.fmt, r.request.request_id, r.error)
            assert r.body == sim.sent(r.request.request_id), (r.fmt, r.request.request_id)
        j = judge(results, load_truth(sim.truth), events, sim.answer)
    print("shadow:", report(j, results))  # the measured figures, with pytest -s
    assert_detection(j, results)
    exchanges = [e for e in events if e["event"] == "exchange"]
    assert {e["tenant"] for e in exchanges} <= {f"tenant-{i:02d}" for i in range(TENANTS)}
    assert not [e for e in events if e["event"] in ("detector.error", "request.unparsed")]
    assert {e["action"] for e in events if e["event"] == "leak.detected"} == {"logged"}


def test_enforce_cuts_leaks_in_each_formats_own_error_format(tmp_path, keyed_config):
    with (
        run_sim(tmp_path, *SIM_ARGS) as sim,
        run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={keyed_config}", "crosstalk_mode=enforce"
        ) as proxy,
    ):
        results = run_formats(proxy.url, requests=REQUESTS, seed=31)
        events = exchanges_logged(proxy, results)
        j = judge(results, load_truth(sim.truth), events, sim.answer)
        sent_bytes = {r.request.request_id: sim.sent(r.request.request_id) for r in results}
    verdicts = {e["request_id"]: e["verdict"] for e in events if e["event"] == "exchange"}
    blocked = {rid for rid, v in verdicts.items() if v == "blocked"}
    targets = {f["request_id"]: f for f in j.targets}
    late, cut = [], {name: 0 for name in FORMATS}
    for r in results:
        rid = r.request.request_id
        if rid not in blocked:
            assert r.error is None and r.body == sent_bytes[rid], (r.fmt, rid, r.error)
            continue
        cut[r.fmt] += 1
        if r.request.stream:
            assert r.status == 200, (r.fmt, rid)
            assert_cut_in_format(r.fmt, r.body)
            if rid in targets and private_words_reached_client(targets[rid], r, j.oracle):
                late.append((r.fmt, rid))
        else:
            assert_block_body_in_format(r.fmt, r.status, r.body)
            assert r.text == ""
    print(f"enforce: {report(j, results)} blocked={cut} late={late}")
    assert all(cut.values()), cut
    # As in test_leaks_e2e: a leak whose evidence comes late can release part of itself.
    assert len(late) <= 0.15 * len(blocked), late
    assert_detection(j, results)


# --- how each client reacts to a block ----------------------------------------------------------

OWNER_PROMPT = (
    "Summarise the dispute file for Harriet Okonkwo-Lindqvist: invoice 88213 from "
    "Brightwater Aquafarms was disputed on the grounds that the salmon pens at Skjervøy "
    "failed inspection twice, and the settlement of 41,700 euro must stay confidential "
    "until the board of Nordhavn Seafood signs."
)
LEAK = {"x-sim-fault": "prompt_page"}


@pytest.fixture
def enforcing(tmp_path, keyed_config):
    """An enforcing proxy in front of a simulator that leaks only when told to, after the
    owner's private prompt went through it."""
    with (
        run_sim(tmp_path, "--token-delay", "0.002") as sim,
        run_mitmdump(
            tmp_path, sim.url, f"crosstalk_config={keyed_config}", "crosstalk_mode=enforce"
        ) as proxy,
    ):
        status, _ = post(proxy.url, "/generate", {"text": OWNER_PROMPT}, "tenant-00", "owner")
        assert status == 200
        yield sim, proxy


def exchanges_of(proxy, request_id: str) -> list[dict]:
    def of(events: list[dict]) -> list[dict]:
        return [e for e in events if e["event"] == "exchange" and e["request_id"] == request_id]

    return of(wait_for_events(proxy.log, of))


def test_anthropic_sdk_raises_on_a_block_and_does_not_retry(enforcing):
    _, proxy = enforcing
    # Default retries (2): a 451 is not retried, a stream error comes after the 200.
    client = anthropic.Anthropic(base_url=proxy.url, api_key=key_of("tenant-01"))
    ask = {"model": MODEL, "max_tokens": 1024, "messages": [{"role": "user", "content": "Hi!"}]}

    with pytest.raises(anthropic.APIStatusError) as caught:
        client.messages.create(**ask, extra_headers={**LEAK, "X-Request-ID": "a-whole"})
    err = caught.value
    assert err.status_code == 451 and err.type == "permission_error"
    assert err.api_message == BLOCK_MESSAGE and err.body["error"]["code"] == "cross_tenant_leak"
    assert [e["verdict"] for e in exchanges_of(proxy, "a-whole")] == ["blocked"]

    received = []
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(**ask, extra_headers={**LEAK, "X-Request-ID": "a-stream"}) as stream,
    ):
        received += list(stream.text_stream)
    err = caught.value
    assert err.status_code == 200 and err.body["error"]["type"] == "permission_error"
    assert BLOCK_MESSAGE in str(err)
    assert "Brightwater" not in "".join(received)
    assert [e["verdict"] for e in exchanges_of(proxy, "a-stream")] == ["blocked"]

    with pytest.raises(anthropic.APIStatusError) as caught:
        for _ in client.messages.create(
            **ask, stream=True, extra_headers={**LEAK, "X-Request-ID": "a-events"}
        ):
            pass
    assert caught.value.body["error"]["code"] == "cross_tenant_leak"

    # Clean traffic: the SDK parses what the proxy passed on.
    message = client.messages.create(**ask, extra_headers={"X-Request-ID": "a-clean"})
    assert message.content[0].text and message.stop_reason == "end_turn"


def test_openai_responses_sdk_raises_on_a_block_and_does_not_retry(enforcing):
    _, proxy = enforcing
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=key_of("tenant-02"))

    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(
            model=MODEL, input="Hi!", extra_headers={**LEAK, "X-Request-ID": "r-whole"}
        )
    assert caught.value.status_code == 451
    assert caught.value.body["code"] == "cross_tenant_leak"
    assert [e["verdict"] for e in exchanges_of(proxy, "r-whole")] == ["blocked"]

    seen = []
    with pytest.raises(openai.APIError) as caught:
        for event in client.responses.create(
            model=MODEL, input="Hi!", stream=True, extra_headers={**LEAK, "X-Request-ID": "r-s"}
        ):
            seen.append(event.type)
    assert caught.value.message == BLOCK_MESSAGE
    assert caught.value.body["code"] == "cross_tenant_leak"
    assert seen[0] == "response.created" and "response.completed" not in seen

    with (
        pytest.raises(openai.APIError),
        client.responses.stream(
            model=MODEL, input="Hi!", extra_headers={**LEAK, "X-Request-ID": "r-helper"}
        ) as stream,
    ):
        for _ in stream:
            pass

    response = client.responses.create(
        model=MODEL, input="Hi!", extra_headers={"X-Request-ID": "r-ok"}
    )
    assert response.output_text and response.status == "completed"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "Hi!", "stream": True}),
        ("/generate", {"text": "Hi!"}),
        ("/generate_stream", {"inputs": "Hi!"}),
        ("/generate", {"inputs": "Hi!"}),
    ],
)
def test_textgen_blocks_in_the_engines_error_format(enforcing, path, body):
    _, proxy = enforcing
    rid = f"g-{path}-{len(body)}"
    request = urllib.request.Request(
        proxy.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Tenant-ID": "tenant-03",
                 "X-Request-ID": rid, **LEAK},
    )  # fmt: skip
    status, data = read(request)
    if path == "/generate_stream" or body.get("stream"):
        assert status == 200
        assert_cut_in_format("tgi" if path == "/generate_stream" else "sglang", data)
    else:
        assert_block_body_in_format("sglang", status, data)
    assert [e["verdict"] for e in exchanges_of(proxy, rid)] == ["blocked"]


def test_vllm_demo_generate_and_sglang_incremental_streams_are_scanned(tmp_path, keyed_config):
    """vLLM's demo /generate (JSON lines, prompt repeated: buffered, scanned whole) and
    SGLang with --incremental-output: the leak is logged with its source."""
    with (
        run_sim(tmp_path, "--incremental-output") as sim,
        run_mitmdump(tmp_path, sim.url, f"crosstalk_config={keyed_config}") as proxy,
    ):
        post(proxy.url, "/generate", {"text": OWNER_PROMPT}, "tenant-00", "owner")
        cases = {
            "v-whole": {"prompt": "Hi!"},
            "v-lines": {"prompt": "Hi!", "stream": True},
            "s-incr": {"text": "Hi!", "stream": True},
        }
        for rid, body in cases.items():
            request = urllib.request.Request(
                proxy.url + "/generate",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-Tenant-ID": "tenant-04",
                         "X-Request-ID": rid, **LEAK},
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.read() == sim.sent(rid)
        events = wait_for_events(
            proxy.log, lambda ev: len([e for e in ev if e["event"] == "exchange"]) >= 4
        )
    leaks = {e["request_id"]: e for e in events if e["event"] == "leak.detected"}
    assert set(cases) <= set(leaks), sorted(leaks)
    assert {leaks[rid]["source_tenant"] for rid in cases} == {"tenant-00"}
