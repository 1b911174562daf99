"""Tests of the simulated engine: answers, fault injection, workload mix and the HTTP server."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import openai
import pytest

from proxy.sim.answers import (
    GENERIC_SENTENCE_TEMPLATES,
    answer_for,
    count_units,
    is_mostly_cjk,
    question_part,
)
from proxy.sim.faults import FAULT_KINDS, FaultInjector, extract_entities, luhn_valid
from proxy.sim.server import (
    SimConfig,
    generated_prefix,
    sim_tenant,
    start_sim,
    stream_pieces,
)
from proxy.sim.workload import (
    PUBLIC_DOCUMENTS,
    SHARED_SYSTEM_PROMPTS,
    Workload,
    iban_with_checksum,
)

REPO = Path(__file__).resolve().parents[1]
EN_PROMPT = (
    "You are a helpful assistant.\n"
    "Can you summarise the Q3 Roadmap for Project Falcon and list the risks Maria Jensen "
    "raised in Oslo?"
)
ZH_PROMPT = "请帮我总结一下猎鹰项目第三季度的路线图和预算风险。"
JA_PROMPT = "ファルコン計画の第3四半期ロードマップを要約してください。"
SOURCE_PROMPT = (
    "You are ShopWise Assistant.\n"
    "Customer Ada Quist (ada.quist@example.org, +44 20 7946 0958) disputed invoice INV-2025-0042 "
    "and asked us to refund EUR 310 to IBAN GB29 NWBK 6016 1331 9268 19 for the Heron contract."
)


# --- textgen ------------------------------------------------------------------------------


def test_answer_for_is_deterministic_in_and_across_processes() -> None:
    a = answer_for(EN_PROMPT)
    assert a == answer_for(EN_PROMPT)
    assert a != answer_for(EN_PROMPT + " Thanks.")
    # Another interpreter with a different hash salt must give the same text (no hash()).
    code = (
        "import sys; from proxy.sim.answers import answer_for; "
        "sys.stdout.write(answer_for(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONIOENCODING": "utf-8"}
    out = subprocess.run(
        [sys.executable, "-c", code, EN_PROMPT],
        capture_output=True,
        text=True,
        encoding="utf-8",
        cwd=REPO,
        env=env,
        check=True,
    ).stdout
    assert out == a


def test_answer_restates_the_question_and_adds_generated_specifics() -> None:
    question = question_part(EN_PROMPT)
    assert question.startswith("Can you summarise")
    for i in range(20):
        prompt = f"{EN_PROMPT} Variant {i}."
        answer = answer_for(prompt)
        words = question_part(prompt).rstrip("?.").split()
        trigrams = {" ".join(words[j : j + 3]) for j in range(len(words) - 2)}
        assert any(t in answer for t in trigrams), answer
    specifics = re.compile(r"REF-\d{8}|(?:EUR|USD|GBP|CHF) [\d,]+\.\d\d|#\d{7}|ORD-\d{4}-\d{6}")
    hits = [specifics.findall(answer_for(f"Question {i} about invoices")) for i in range(30)]
    assert sum(bool(h) for h in hits) >= 20
    assert not any(s in EN_PROMPT for h in hits for s in h)


def test_answer_lengths_and_max_words() -> None:
    lengths = [count_units(answer_for(f"Tell me about topic number {i}")) for i in range(200)]
    assert min(lengths) >= 50 and max(lengths) <= 300
    assert 60 <= statistics.median(lengths) <= 250
    full = answer_for(EN_PROMPT)
    short = answer_for(EN_PROMPT, max_words=12)
    assert count_units(short) == 12
    assert full.startswith(short)


def test_generic_phrasing_recurs_but_answers_differ() -> None:
    assert len(GENERIC_SENTENCE_TEMPLATES) >= 20
    answers = [answer_for(f"Help me plan the offsite for team {i}") for i in range(60)]
    assert len(set(answers)) == 60
    sentences = Counter(s for a in answers for s in set(re.split(r"(?<=[.!?])\s+", a)))
    assert sentences.most_common(1)[0][1] >= 5  # boilerplate shared across answers
    assert len(sentences) > 300  # ... yet varied


def test_cjk_prompts_get_cjk_answers() -> None:
    zh = answer_for(ZH_PROMPT)
    assert is_mostly_cjk(zh)
    assert re.search(r"[\u4e00-\u9fff]{4}", zh)
    assert any(ZH_PROMPT[i : i + 4] in zh for i in range(len(ZH_PROMPT) - 3))
    ja = answer_for(JA_PROMPT)
    assert is_mostly_cjk(ja) and re.search(r"[\u3040-\u30ff]", ja)
    assert count_units(answer_for(ZH_PROMPT, max_words=10)) == 10


def test_code_questions_get_python_with_boilerplate_and_specific_identifiers() -> None:
    answer = answer_for("System.\nWrite a python function that parses invoice totals per region")
    assert "```python" in answer and 'if __name__ == "__main__":' in answer
    assert "import logging" in answer
    assert re.search(r"def \w*(invoice|totals|region|parses)\w*\(", answer)


# --- faults -------------------------------------------------------------------------------


def _injector(tmp_path: Path, page_words: tuple[int, ...] = (4, 8, 16, 64)) -> FaultInjector:
    inj = FaultInjector(0.0, seed=7, truth_path=tmp_path / "truth.jsonl", page_words=page_words)
    inj.remember("tenant-src", "req-src-1", SOURCE_PROMPT, answer_for(SOURCE_PROMPT))
    return inj


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_forced_fault_leaks_foreign_text_and_writes_truth(tmp_path: Path, kind: str) -> None:
    inj = _injector(tmp_path)
    victim_prompt = "How do I reset my password?"
    answer = answer_for(victim_prompt)
    new, fault = inj.apply("tenant-victim", "req-v-1", victim_prompt, answer, force=kind)
    assert fault is not None and fault.kind == kind
    assert fault.leaked_text and fault.leaked_text in new and new != answer
    lines = (tmp_path / "truth.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [fault.to_json()]
    assert fault.victim_tenant == "tenant-victim" and fault.request_id == "req-v-1"
    if kind == "degenerate":
        assert fault.source_tenant is None and fault.leaked_text not in SOURCE_PROMPT
        return
    assert fault.source_tenant == "tenant-src" and fault.source_request_id == "req-src-1"
    if kind == "prompt_page":
        assert fault.leaked_text in SOURCE_PROMPT
        assert fault.leaked_words == len(fault.leaked_text.split())
    elif kind == "output_page":
        assert fault.leaked_text in answer_for(SOURCE_PROMPT)
    elif kind == "misroute":
        assert new == answer_for(SOURCE_PROMPT) and fault.position == "whole"
    elif kind == "entities":
        assert 1 <= len(fault.entities) <= 3
        assert all(e in SOURCE_PROMPT and e in new for e in fault.entities)


def test_prompt_page_prefers_the_private_part(tmp_path: Path) -> None:
    inj = _injector(tmp_path, page_words=(8,))
    for i in range(20):
        _, fault = inj.apply("tenant-v", f"r{i}", "q", answer_for(f"q{i}"), force="prompt_page")
        assert fault is not None
        assert fault.leaked_text in question_part(SOURCE_PROMPT)
        assert fault.leaked_words == 8


def test_faults_need_a_different_tenant(tmp_path: Path) -> None:
    inj = _injector(tmp_path)
    for kind in ("prompt_page", "output_page", "entities", "misroute"):
        answer = answer_for("same tenant")
        assert inj.apply("tenant-src", "r", "p", answer, force=kind) == (answer, None)
    assert not (tmp_path / "truth.jsonl").exists()
    with pytest.raises(ValueError):
        inj.apply("tenant-v", "r", "p", "a", force="bogus")


def test_fault_rate_is_honoured(tmp_path: Path) -> None:
    inj = FaultInjector(0.3, seed=1, truth_path=tmp_path / "t.jsonl")
    inj.remember("tenant-src", "s", SOURCE_PROMPT, answer_for(SOURCE_PROMPT))
    hits = sum(inj.apply("tenant-v", f"r{i}", "p", "a b c d e")[1] is not None for i in range(1000))
    assert 230 <= hits <= 370
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == hits
    quiet = FaultInjector(0.0)
    quiet.remember("tenant-src", "s", SOURCE_PROMPT, "out")
    assert all(quiet.apply("v", "r", "p", "a")[1] is None for _ in range(100))


def test_cjk_pages_count_characters_and_entities_fall_back(tmp_path: Path) -> None:
    inj = FaultInjector(0.0, seed=3, page_words=(6,))
    inj.remember("tenant-zh", "z1", ZH_PROMPT, answer_for(ZH_PROMPT))
    _, fault = inj.apply("tenant-en", "e1", "p", answer_for("hello world"), force="prompt_page")
    assert fault is not None and fault.leaked_words == 6 == len(fault.leaked_text)
    assert fault.leaked_text in ZH_PROMPT
    # No entities anywhere in the ring: an entities fault falls back to a prompt page.
    _, fault = inj.apply("tenant-en", "e2", "p", answer_for("hello"), force="entities")
    assert fault is not None and fault.kind == "prompt_page"


def test_extract_entities() -> None:
    text = (
        "Mail jo@corp.example, call +44 20 7946 0958, IBAN GB29NWBK60161331926819, card "
        "4111 1111 1111 1111, bad card 4111 1111 1111 1112, key sk-proj-abcdefghijklmnop1234, "
        "customer CUS-1234567."
    )
    found = extract_entities(text)
    assert found == [
        "jo@corp.example",
        "+44 20 7946 0958",
        "GB29NWBK60161331926819",
        "4111 1111 1111 1111",
        "sk-proj-abcdefghijklmnop1234",
        "CUS-1234567",
    ]


# --- workload -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traffic() -> tuple[Workload, list]:
    wl = Workload(tenants=20, seed=11)
    return wl, list(wl.requests(2000))


def test_workload_is_deterministic() -> None:
    a = [(r.request_id, r.messages) for r in Workload(seed=5).requests(200)]
    b = [(r.request_id, r.messages) for r in Workload(seed=5).requests(200)]
    c = [(r.request_id, r.messages) for r in Workload(seed=6).requests(200)]
    assert a == b and a != c


def test_workload_mix_rates(traffic: tuple[Workload, list]) -> None:
    wl, reqs = traffic
    n = len(reqs)
    rate = Counter(t for r in reqs for t in r.tags)
    assert abs(rate["shared_system"] / n - 0.80) < 0.04
    assert abs(rate["public_doc"] / n - 0.08) < 0.03
    assert abs(rate["same_question"] / n - 0.10) < 0.03
    assert abs(rate["code"] / n - 0.15) < 0.04
    assert abs(rate["multi_turn"] / n - 0.15) < 0.04
    assert 0.02 < rate["repeat"] / n < 0.09
    fresh_private = [r for r in reqs if "private" in r.tags and "repeat" not in r.tags]
    entity_share = sum("entities" in r.tags for r in fresh_private) / len(fresh_private)
    assert abs(entity_share - 0.30) < 0.06
    assert sum(r.endpoint == "completions" for r in reqs) / n == pytest.approx(0.10, abs=0.03)
    assert 0.5 < sum(r.stream for r in reqs) / n < 0.7
    cjk_tenants = {t.name for t in wl.tenants if t.language != "en"}
    assert len(cjk_tenants) >= 2
    assert {r.tenant for r in reqs if "cjk" in r.tags} == cjk_tenants
    assert all(re.fullmatch(r"req-tenant-\d\d-\d{6}", r.request_id) for r in reqs)
    assert len({r.request_id for r in reqs}) == n


def test_shared_texts_are_shared_across_tenants(traffic: tuple[Workload, list]) -> None:
    _, reqs = traffic
    assert 2 <= len(SHARED_SYSTEM_PROMPTS) <= 3
    assert all(60 <= len(p.split()) <= 150 for p in SHARED_SYSTEM_PROMPTS)
    assert all(150 <= len(d.split()) <= 300 for d in PUBLIC_DOCUMENTS)
    users: dict[str, set[str]] = defaultdict(set)
    for r in reqs:
        for m in r.messages:
            users[m["content"]].add(r.tenant)
        for doc in PUBLIC_DOCUMENTS:
            if doc in r.prompt_text():
                users[doc].add(r.tenant)
    assert all(len(users[p]) >= 3 for p in SHARED_SYSTEM_PROMPTS)
    assert all(len(users[d]) >= 3 for d in PUBLIC_DOCUMENTS)
    popular = [r.last_user_text() for r in reqs if "same_question" in r.tags]
    assert max(len(users[q]) for q in popular) >= 3


def test_private_prompts_rarely_share_8_word_runs(traffic: tuple[Workload, list]) -> None:
    _, reqs = traffic
    private = [r for r in reqs if "private" in r.tags and "repeat" not in r.tags]
    grams_of = []
    owners: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for r in private:
        grams: set[tuple[str, ...]] = set()
        for m in r.messages:
            if m["role"] == "user":
                w = m["content"].lower().split()
                grams |= {tuple(w[i : i + 8]) for i in range(len(w) - 7)}
        grams_of.append(grams)
        for g in grams:
            owners[g].add(r.tenant)
    shared = sum(any(len(owners[g]) > 1 for g in grams) for grams in grams_of)
    assert shared / len(private) < 0.05


def test_workload_entities_are_valid_and_multi_turn_quotes_the_sim(
    traffic: tuple[Workload, list],
) -> None:
    _, reqs = traffic
    with_entities = [r for r in reqs if "entities" in r.tags]
    assert all(extract_entities(r.prompt_text()) for r in with_entities)
    cards = [
        e
        for r in with_entities
        for e in extract_entities(r.prompt_text())
        if re.fullmatch(r"[\d ]{16,19}", e)
    ]
    assert cards and all(luhn_valid(c) for c in cards)
    assert iban_with_checksum("GB", "NWBK60161331926819") == "GB29NWBK60161331926819"
    multi = [r for r in reqs if "multi_turn" in r.tags and "repeat" not in r.tags]
    for r in multi[:20]:
        roles = [m["role"] for m in r.messages]
        k = roles.index("assistant")
        earlier = "\n".join(m["content"] for m in r.messages[:k])
        assert r.messages[k]["content"] == answer_for(earlier)
        assert roles[-1] == "user"


# --- server -------------------------------------------------------------------------------


@contextmanager
def running_sim(cfg: SimConfig) -> Iterator[str]:
    """Run the sim on 127.0.0.1 in a background event loop; yields its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(start_sim(cfg), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    truth = tmp_path_factory.mktemp("sim") / "truth.jsonl"
    cfg = SimConfig(truth_path=str(truth), split_words=True, seed=3)
    with running_sim(cfg) as base:
        yield base, truth


def _client(base: str, tenant: str = "tenant-a") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="x",
        max_retries=0,
        timeout=10,
        default_headers={"X-Tenant-ID": tenant},
    )


def _raw(base: str, path: str, body: object, headers: dict[str, str] | None = None):
    """POST with http.client: no decompression, no retries, the bytes as sent."""
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(
        "POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    return conn, conn.getresponse()


MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Plan Project Heron"},
]
MSGS_PROMPT = "Be brief.\nPlan Project Heron"


def test_openai_sdk_chat_non_streamed(sim: tuple[str, Path]) -> None:
    base, _ = sim
    raw = _client(base).chat.completions.with_raw_response.create(model="sim-llm-1", messages=MSGS)
    assert raw.headers["x-sim-request-id"]
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == "sim-llm-1"
    assert r.choices[0].message.content == answer_for(MSGS_PROMPT)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.prompt_tokens == 5
    assert r.usage.completion_tokens == count_units(answer_for(MSGS_PROMPT))


def test_openai_sdk_chat_streamed_with_usage(sim: tuple[str, Path]) -> None:
    base, _ = sim
    stream = _client(base).chat.completions.create(
        model="sim-llm-1", messages=MSGS, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer_for(MSGS_PROMPT)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_openai_sdk_n2_and_max_tokens(sim: tuple[str, Path]) -> None:
    base, _ = sim
    client = _client(base)
    r = client.chat.completions.create(model="sim-llm-1", messages=MSGS, n=2)
    a, b = (c.message.content for c in r.choices)
    assert a == answer_for(MSGS_PROMPT) and b != a and b
    chunks = list(
        client.chat.completions.create(model="sim-llm-1", messages=MSGS, n=2, stream=True)
    )
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        for i in (0, 1)
    ]
    assert texts == [a, b]
    r = client.chat.completions.create(model="sim-llm-1", messages=MSGS, max_tokens=7)
    assert count_units(r.choices[0].message.content or "") == 7
    assert r.choices[0].finish_reason == "length"


def test_openai_sdk_completions(sim: tuple[str, Path]) -> None:
    base, _ = sim
    client = _client(base)
    r = client.completions.create(model="sim-llm-1", prompt="Explain Project Heron")
    assert r.object == "text_completion"
    assert r.choices[0].text == answer_for("Explain Project Heron")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="sim-llm-1", prompt="Explain Project Heron", stream=True
        )
    )
    assert streamed == r.choices[0].text


def test_sse_wire_format(sim: tuple[str, Path]) -> None:
    base, _ = sim
    conn, resp = _raw(
        base, "/v1/chat/completions", {"messages": MSGS, "stream": True, "max_tokens": 5}
    )
    body = resp.read().decode()
    conn.close()
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = body.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    last = json.loads(events[-3][6:])
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}


def test_forced_fault_header_shows_up_in_truth_file(sim: tuple[str, Path]) -> None:
    base, truth = sim
    _client(base, "tenant-src").chat.completions.create(
        model="m", messages=[{"role": "user", "content": SOURCE_PROMPT}]
    )
    raw = _client(base, "tenant-victim").chat.completions.with_raw_response.create(
        model="m", messages=MSGS, extra_headers={"x-sim-fault": "entities"}
    )
    content = raw.parse().choices[0].message.content or ""
    rid = raw.headers["x-sim-request-id"]
    faults = [json.loads(line) for line in truth.read_text(encoding="utf-8").splitlines()]
    mine = [f for f in faults if f["request_id"] == rid]
    assert len(mine) == 1
    fault = mine[0]
    assert fault["kind"] == "entities" and fault["victim_tenant"] == "tenant-victim"
    assert fault["source_tenant"] not in (None, "tenant-victim")
    assert fault["leaked_text"] in content


def test_streamed_exchanges_are_remembered(tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    with running_sim(SimConfig(truth_path=str(truth))) as base:
        source = list(
            _client(base, "tenant-a").chat.completions.create(model="m", messages=MSGS, stream=True)
        )
        source_text = "".join(c.choices[0].delta.content or "" for c in source)
        r = _client(base, "tenant-b").chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-sim-fault": "misroute"},
        )
    assert r.choices[0].message.content == source_text
    (fault,) = [json.loads(line) for line in truth.read_text().splitlines()]
    assert fault["source_tenant"] == "tenant-a" and fault["victim_tenant"] == "tenant-b"


def test_misbehaviour_hooks(sim: tuple[str, Path]) -> None:
    base, _ = sim
    body = {"messages": MSGS, "max_tokens": 30}
    client = _client(base)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(
            model="m", messages=MSGS, extra_headers={"x-sim-misbehave": "status500"}
        )
    conn, resp = _raw(base, "/v1/chat/completions", body, {"x-sim-misbehave": "nonjson"})
    assert resp.status == 200 and resp.read() == b"oops not json"
    conn, resp = _raw(base, "/v1/chat/completions", body, {"x-sim-misbehave": "gzip"})
    assert resp.getheader("Content-Encoding") == "gzip"
    assert json.loads(gzip.decompress(resp.read()))["choices"][0]["message"]["content"]
    conn, resp = _raw(
        base, "/v1/chat/completions", {**body, "stream": True}, {"x-sim-misbehave": "gzip"}
    )
    sse_text = zlib.decompressobj(wbits=31).decompress(resp.read()).decode()
    assert sse_text.endswith("data: [DONE]\n\n")
    conn, resp = _raw(
        base, "/v1/chat/completions", {**body, "stream": True}, {"x-sim-misbehave": "error-event"}
    )
    events = resp.read().decode().split("\n\n")
    assert json.loads(events[-2][6:]) == {
        "error": {"message": "engine overloaded", "type": "server_error"}
    }
    assert "data: [DONE]" not in events and len(events) >= 3
    conn, resp = _raw(
        base, "/v1/chat/completions", {**body, "stream": True}, {"x-sim-misbehave": "truncate"}
    )
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    partial = info.value.partial.decode()
    assert "[DONE]" not in partial and not partial.endswith("\n\n")
    conn.close()


def test_streaming_is_incremental_and_slow_hook_paces_chunks(sim: tuple[str, Path]) -> None:
    base, _ = sim

    async def go() -> tuple[float, float, int]:
        async with aiohttp.ClientSession() as s:
            start = time.monotonic()
            first = 0.0
            count = 0
            payload = {"messages": MSGS, "stream": True, "max_tokens": 3}
            headers = {"x-sim-misbehave": "slow"}
            async with s.post(f"{base}/v1/chat/completions", json=payload, headers=headers) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        count += 1
                        first = first or time.monotonic() - start
            return first, time.monotonic() - start, count

    first, total, count = asyncio.run(go())
    assert count >= 5
    # Paced: every chunk after the first waited its delay. Incremental: the first one
    # arrived before the delays of the others had passed (buffered, it would come last).
    assert total >= 0.2 * (count - 1) - 0.05
    assert first <= total - 0.2 * (count - 2)


def test_bad_requests_and_info_endpoints(sim: tuple[str, Path]) -> None:
    base, _ = sim
    conn, resp = _raw(base, "/v1/chat/completions", b"{not json")
    assert resp.status == 400 and "error" in json.loads(resp.read())
    conn, resp = _raw(base, "/v1/chat/completions", {"messages": MSGS}, {"x-sim-fault": "nope"})
    assert resp.status == 400
    conn, resp = _raw(base, "/v1/chat/completions", {"messages": []})
    assert resp.status == 400
    models = _client(base).models.list()
    assert [m.id for m in models.data] == ["sim-llm-1"]
    for path, expected in (("/version", b'{"version": "0.10.2"}'), ("/health", b"")):
        c = http.client.HTTPConnection(base.removeprefix("http://"), timeout=5)
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 200 and r.read() == expected
        c.close()


def test_tenant_resolution_and_stream_pieces() -> None:
    assert sim_tenant({"X-Tenant-ID": "t1", "Authorization": "Bearer k"}, {"user": "u"}) == "t1"
    assert sim_tenant({"Authorization": "Bearer k"}, {"user": "u"}) == "k"
    assert sim_tenant({}, {"user": "u"}) == "u"
    assert sim_tenant({}, {}) == "anonymous"
    text = answer_for(EN_PROMPT)
    pieces = stream_pieces(text, 1, True, random.Random(1))
    assert "".join(pieces) == text
    assert any(p[-1].isalpha() and q[0].isalpha() for p, q in zip(pieces, pieces[1:], strict=False))
    assert len(stream_pieces(text, 3, False, random.Random(1))) == -(-len(text.split()) // 3)


def test_cli_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from proxy.sim.server import main; sys.exit(main(sys.argv[1:]))",
            "--port",
            "0",
            "--leak-rate",
            "0.1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"sim listening on http://127\.0\.0\.1:(\d+)\n", line)
        assert m, line
        c = http.client.HTTPConnection("127.0.0.1", int(m.group(1)), timeout=5)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from proxy.sim.server import main; sys.exit(main(sys.argv[1:]))",
            "--fault-kinds",
            "nope",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "fault-kinds" in bad.stderr


def test_a_cut_stream_generated_only_the_pieces_written_before_the_cut():
    pieces = [["Hel", "lo ", "world"], ["Bon", "jour"]]
    # one role chunk per choice, then the choices' pieces interleave
    assert generated_prefix(pieces, written=2, lead=2) == ""
    assert generated_prefix(pieces, written=3, lead=2) == "Hel"
    assert generated_prefix(pieces, written=5, lead=2) == "Hello "
    assert generated_prefix(pieces, written=99, lead=2) == "Hello world"
