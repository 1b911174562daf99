"""crosstalk probe: synthetic data, and the command against the real simulator (fault
injection on and off, streamed and not, through a real crosstalk proxy), checked against
the simulator's truth file."""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from conftest import ROOT, TEST_KEY, Sim, free_port, run_mitmdump, run_sim

from proxy.assurance.probe import (
    ProbeProgress,
    iban_like,
    make_request,
    make_tenants,
    make_workload,
)
from proxy.engine.entities import iter_entity_keys
from proxy.sim.faults import extract_entities, luhn_valid


def probe(*args: str, evidence: Path | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``crosstalk probe`` as a subprocess; returns it and its evidence record."""
    cmd = [sys.executable, "-m", "proxy", "probe", *args]
    if evidence is not None:
        cmd += ["--evidence", str(evidence)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    record = json.loads((evidence / "evidence.json").read_text()) if evidence else {}
    return done, record


@pytest.fixture(scope="module")
def leaky(module_tmp: Path) -> Iterator[Sim]:
    with run_sim(module_tmp, "--leak-rate", "0.3", "--seed", "11") as s:
        yield s


@pytest.fixture(scope="module")
def clean(module_tmp: Path) -> Iterator[Sim]:
    with run_sim(module_tmp, "--leak-rate", "0") as s:
        yield s


def truth(sim: Sim) -> list[dict]:
    """Faults the simulator injected (no file: none yet)."""
    if not sim.truth.exists():
        return []
    return [json.loads(line) for line in sim.truth.read_text().splitlines() if line.strip()]


# --- synthetic data ------------------------------------------------------------------


def test_every_prompt_carries_fresh_private_values() -> None:
    rng = random.Random(5)
    tenants = make_tenants(3, rng)
    assert len({t.name for t in tenants}) == 3 and len({t.api_key for t in tenants}) == 3
    requests = [make_request(i, tenants[i % 3], rng) for i in range(300)]
    values = [v for r in requests for v in (r.canary, *r.entities)]
    assert len(values) == len(set(values))  # nothing repeats, within or across tenants
    for r in requests:
        email, iban, card, key = r.entities
        assert luhn_valid(card)
        assert "\n" not in r.user  # one line: the simulator's "private part" is all of it
        # The detection engine and the simulator's fault injector both see them as
        # entities: the injector can leak them, the engine can report them.
        engine_keys = {k for _, k in iter_entity_keys(r.user)}
        assert {email.lower(), key.lower()} <= engine_keys
        assert any(card.replace(" ", "") in k.replace(" ", "") for k in engine_keys)
        assert set(extract_entities(r.user)) >= {email, iban, card, key}


def test_iban_checksum() -> None:
    rng = random.Random(1)
    for _ in range(50):
        iban = iban_like(rng).replace(" ", "")
        moved = iban[4:] + iban[:4]
        assert int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def test_progress_plain_when_not_a_terminal() -> None:
    out = io.StringIO()
    bar = ProbeProgress(8, out)
    for i in range(8):
        bar.step(i == 3)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == [
        "2/8 requests, 0 with findings",
        "4/8 requests, 1 with findings",
        "6/8 requests, 1 with findings",
        "8/8 requests, 1 with findings",
    ]


# --- against the simulator -----------------------------------------------------------


def test_probe_finds_injected_leaks_and_exits_nonzero(leaky: Sim, tmp_path: Path) -> None:
    done, record = probe(
        "--target", leaky.url, "--tenants", "4", "--requests", "160", "--concurrency", "8",
        "--seed", "5", evidence=tmp_path / "ev",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CONTAMINATION FOUND" in done.stdout
    results = record["probe"]["results"]
    assert results["requests_sent"] == results["answered"] == 160
    assert results["contaminated_responses"] > 0
    assert results["canary_findings"] + results["entity_findings"] > 0
    # Every confirmed finding is a response the simulator really corrupted with that
    # tenant's data: no false positive.
    faults = {f["request_id"]: f for f in truth(leaky)}
    findings = record["probe"]["findings"]
    assert findings
    for f in findings:
        fault = faults.get(f["victim_request"])
        assert fault is not None, f
        assert fault["kind"] != "degenerate", f
    # Injected entity leaks carry another tenant's private values: all of them are found
    # (how many the simulator injects depends on the order requests arrive in).
    entity_faults = [f for f in faults.values() if f["kind"] == "entities"]
    victims = {f["victim_request"] for f in findings}
    assert all(f["request_id"] in victims for f in entity_faults), entity_faults
    # A page of another tenant's prompt that holds one of its made-up values (canary,
    # email, key: single words, so a page holds them whole) is always found.
    whole_value = re.compile(r"XTC[0-9A-F]{14}|[\w.]+@probe\d+\.xtc-mail\.net|sk-live-\w{28}")
    pages = [
        f for f in faults.values()
        if f["kind"] == "prompt_page" and whole_value.search(f["leaked_text"])
    ]  # fmt: skip
    assert all(f["request_id"] in victims for f in pages), pages
    # Pages and mis-routed answers of 8+ words that carry a word only the source's
    # tenant sent are found. The judge is the probe's own record (the seed rebuilds what
    # each tenant sent): a page of the shared template, or a mis-routed answer that
    # holds only another tenant's or the victim's own values, leaks nothing of the
    # source. Measured while writing this, probe seeds 1-7 once each and seed 5 eight
    # times: 102 of 102 such pages found (of all 8+-word pages, 100 of 102).
    big = [
        f for f in faults.values()
        if f["kind"] in ("prompt_page", "misroute") and f["leaked_words"] >= 8
        and private_words(f["leaked_text"], f["source_tenant"], seed=5, tenants=4, requests=160)
    ]  # fmt: skip
    missed = [f["leaked_text"][:80] for f in big if f["request_id"] not in victims]
    assert big and len(missed) <= 0.05 * len(big), (missed, len(big))


def private_words(text: str, tenant: str, *, seed: int, tenants: int, requests: int) -> set[str]:
    """The words of ``text`` that ``tenant``'s prompts hold and no other tenant's do."""
    _, sent = make_workload(tenants, requests, random.Random(seed))
    holders: dict[str, set[str]] = {}
    for req in sent:
        for word in re.findall(r"\w+", req.prompt_text().casefold()):
            holders.setdefault(word, set()).add(req.tenant)
    return {w for w in re.findall(r"\w+", text.casefold()) if holders.get(w) == {tenant}}


def test_probe_clean_engine_exits_zero(clean: Sim, tmp_path: Path) -> None:
    done, record = probe(
        "--target", clean.url, "--tenants", "4", "--requests", "200", "--determinism",
        "--sample", "6", evidence=tmp_path / "ev",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NO CONTAMINATION FOUND" in done.stdout
    results = record["probe"]["results"]
    assert results["answered"] == 200 and results["contaminated_responses"] == 0
    assert record["probe"]["findings"] == []
    # The simulator is deterministic: alone or under load, the same answer.
    assert results["determinism_compared"] == results["determinism_identical"] == 6
    assert truth(clean) == []


def test_probe_streamed_with_determinism(leaky: Sim, tmp_path: Path) -> None:
    done, record = probe(
        "--target", leaky.url, "--tenants", "3", "--requests", "90", "--stream",
        "--determinism", "--sample", "12", "--model", "sim-llm-1", evidence=tmp_path / "ev",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    results = record["probe"]["results"]
    assert results["answered"] == 90 and results["errors"] == 0
    assert results["determinism_compared"] == 12
    assert results["determinism_identical"] + results["determinism_divergent"] == 12
    assert record["probe"]["parameters"]["stream"] is True
    # A repeat that diverged was corrupted either under load or alone.
    faults = {f["request_id"] for f in truth(leaky)}
    for rid in record["probe"]["determinism_divergent_requests"]:
        assert rid in faults or rid + "-solo" in faults


def test_probe_through_enforcing_proxy_counts_blocked(leaky: Sim, tmp_path: Path) -> None:
    cfg = tmp_path / "crosstalk.toml"
    cfg.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    with run_mitmdump(
        tmp_path, leaky.url, f"crosstalk_config={cfg}", "crosstalk_mode=enforce"
    ) as proxy:
        done, record = probe(
            "--target", proxy.url, "--tenants", "4", "--requests", "120",
            evidence=tmp_path / "ev",
        )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    results = record["probe"]["results"]
    # The proxy stops entity leaks from the first request (HTTP 451, cross_tenant_leak).
    assert results["blocked_by_proxy"] > 0
    assert results["answered"] + results["blocked_by_proxy"] + results["errors"] == 120
    assert record["probe"]["identification"]["engine"] == "vllm"  # seen through the proxy


def test_probe_errors(tmp_path: Path) -> None:
    done, _ = probe("--target", f"http://127.0.0.1:{free_port()}", "--timeout", "2")
    assert done.returncode == 2 and "cannot list models" in done.stderr
    done, _ = probe("--target", "http://127.0.0.1:9", "--tenants", "1")
    assert done.returncode == 2 and "at least 2" in done.stderr


def test_probe_of_a_model_that_ignores_its_prompt_is_inconclusive(tmp_path: Path) -> None:
    """A model that never repeats its own prompt's values could not have repeated another
    tenant's: the probe says so (exit 2) instead of "no contamination found"."""

    async def chat(_request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": "Thanks for reaching out, happy to help."}
        return web.json_response({"id": "x", "object": "chat.completion", "model": "deaf",
                                  "choices": [{"index": 0, "message": message,
                                               "finish_reason": "stop"}]})  # fmt: skip

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "deaf", "object": "model"}]})

    async def run() -> subprocess.CompletedProcess:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            args = ("--target", f"http://127.0.0.1:{port}", "--tenants", "3", "--requests", "30")
            return await asyncio.to_thread(lambda: probe(*args)[0])
        finally:
            await runner.cleanup()

    done = asyncio.run(run())
    assert done.returncode == 2, done.stdout + done.stderr
    assert "INCONCLUSIVE" in done.stdout and "0 of 30 answers repeated" in done.stdout
    assert "sensitivity" in done.stdout
