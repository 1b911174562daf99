"""A real serving engine in the loop: llama.cpp's llama-server (built by
scripts/ensure-llama-server.sh) serving a tiny random-weight model the tests write
themselves (tests/tiny_gguf.py), with `crosstalk run` in front, four tenants by API key
over four slots, through the real openai SDK.

What the engine emits is nobody's text: random weights write printable token soup, and
at temperature 0 the same prompt gets the same soup. None of it may be a finding, in
shadow or enforce mode; every answer must reach the client as the engine gave it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from conftest import ROOT, bench_module, missing_tool, start_server, stop, wait_for_events
from mitmproxy import http
from mitmproxy.io import FlowReader
from tiny_gguf import write_tiny_model

TENANTS = {"sk-llama-alpha": "alpha", "sk-llama-beta": "beta", "sk-llama-gamma": "gamma",
           "sk-llama-delta": "delta"}  # fmt: skip
SLOTS = 4
# Fields that differ between two calls of the same request: ids and clocks, and what the
# engine's prompt cache held at the time.
VOLATILE = ("id", "created", "timings")


@pytest.fixture(scope="module")
def llama_server_bin() -> Path:
    """The pinned llama-server, built once into the cache (make test builds it first)."""
    script = ROOT / "scripts" / "ensure-llama-server.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not done.stdout.strip():
        missing_tool(f"llama-server could not be built: {done.stderr[-800:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama(llama_server_bin: Path, module_tmp: Path) -> Iterator[str]:
    model = write_tiny_model(module_tmp / "tiny.gguf")

    def command(port: int) -> list[str]:
        return [str(llama_server_bin), "-m", str(model), "-c", "2048", "-np", str(SLOTS),
                "--alias", "tiny", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    with (module_tmp / "llama-server.log").open("wb") as log:
        proc, port = start_server(command, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        bench_module("common").wait_healthy(url, proc, "llama-server", timeout=30)
        yield url
    finally:
        stop(proc)


@dataclass
class Crosstalk:
    url: str
    log: Path
    flows: Path  # --capture: every exchange as the engine sent it, flushed per flow

    def engine_sent(self) -> dict[str, bytes]:
        """Response bytes as crosstalk received them from the engine, by request id."""
        with self.flows.open("rb") as f:
            return {
                fl.request.headers["x-request-id"]: fl.response.raw_content
                for fl in FlowReader(f).stream()
                if isinstance(fl, http.HTTPFlow) and fl.response is not None
            }


def crosstalk_run(tmp: Path, upstream: str, mode: str) -> Iterator[Crosstalk]:
    cfg = tmp / f"crosstalk-{mode}.toml"
    keys = "\n".join(f'"{k}" = "{t}"' for k, t in TENANTS.items())
    cfg.write_text(
        f'[proxy]\nmode = "{mode}"\n[tenants]\nsources = ["api_key"]\n[tenants.api_keys]\n{keys}\n'
    )
    log, flows = tmp / f"events-{mode}.jsonl", tmp / f"flows-{mode}.mitm"

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "proxy", "run", "--listen-port", str(port),
                "--upstream", upstream, "--config", str(cfg), "--log-file", str(log),
                "--capture", str(flows)]  # fmt: skip

    with (tmp / f"crosstalk-{mode}.stderr").open("wb") as stderr:
        proc, port = start_server(command, stderr=stderr)
    try:
        yield Crosstalk(f"http://127.0.0.1:{port}", log, flows)
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module", params=["shadow", "enforce"])
def gateway(request, llama: str, module_tmp: Path) -> Iterator[Crosstalk]:
    yield from crosstalk_run(module_tmp, llama, request.param)


# --- traffic --------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    request_id: str
    key: str
    messages: tuple[tuple[str, str], ...]
    stream: bool
    max_tokens: int = 160

    def body(self) -> dict:
        body = {
            "model": "tiny",
            "messages": [{"role": r, "content": c} for r, c in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "seed": 7,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def workload(n: int = 48) -> list[Call]:
    """Four tenants; a shared system prompt; every third question the same for all
    (temperature 0: the same soup for each of them, which is not a leak)."""
    keys = list(TENANTS)
    calls = []
    for i in range(n):
        question = "Hello, how are you?" if i % 3 == 0 else f"Plan item {i}: budget {1000 + i}?"
        messages = (("system", "You are a helpful assistant."), ("user", question))
        calls.append(Call(f"llama-{i:04d}", keys[i % len(keys)], messages, stream=bool(i % 2)))
    return calls


def send(base: str, call: Call) -> tuple[dict | list[dict], bytes]:
    """The parsed answer (a body, or a stream's chunks) and the raw bytes. The client
    waits up to ten minutes: eight calls share four slots of two busy cores, and a
    clean-clone CI beside other work timed out at 60 s."""
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key=call.key, max_retries=0, timeout=600,
        default_headers={"X-Request-ID": call.request_id},
    )  # fmt: skip
    api = client.chat.completions
    if call.stream:
        with api.with_streaming_response.create(stream=True, **call.body()) as resp:
            raw = b"".join(resp.iter_bytes())
        chunks = [
            json.loads(line[5:])
            for line in raw.decode().splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"
        ]
        return chunks, raw
    raw = api.with_raw_response.create(**call.body()).http_response.content
    return json.loads(raw), raw


def stable(obj: dict) -> dict:
    """An answer without the fields that differ from call to call."""
    out = {k: v for k, v in obj.items() if k not in VOLATILE}
    usage = out.get("usage")
    if isinstance(usage, dict):
        out["usage"] = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    return out


def run_all(base: str, calls: list[Call]) -> list[tuple[dict | list[dict], bytes]]:
    with ThreadPoolExecutor(max_workers=SLOTS * 2) as pool:
        return list(pool.map(lambda c: send(base, c), calls))


# --- tests ----------------------------------------------------------------------------


def test_answers_through_crosstalk_are_the_engines(llama: str, gateway: Crosstalk) -> None:
    """Byte for byte what the engine sent (its capture beside what the client read), and
    the same answers as straight from the engine but for ids, clocks and cache counts."""
    calls = workload()
    direct = run_all(llama, calls)
    through = run_all(gateway.url, calls)
    sent = gateway.engine_sent()
    for call, (_, raw) in zip(calls, through, strict=True):
        assert raw == sent[call.request_id], call
    for call, (want, _), (got, raw) in zip(calls, direct, through, strict=True):
        if call.stream:
            assert [stable(c) for c in got] == [stable(c) for c in want], call
            assert raw.rstrip().endswith(b"data: [DONE]"), call
        else:
            assert stable(got) == stable(want), call
        assert got  # an answer, not an error


def test_usage_and_timings_chunks_reach_the_client(gateway: Crosstalk) -> None:
    call = Call("llama-usage", next(iter(TENANTS)), (("user", "Count to three."),), True)
    chunks, _ = send(gateway.url, call)
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    assert "timings" in last and last["timings"]["predicted_n"] > 0
    assert chunks[0]["system_fingerprint"] == last["system_fingerprint"]


def test_no_finding_on_what_the_engine_really_emits(gateway: Crosstalk) -> None:
    """Exchange events for every request, all clean: no fragment, entity or degenerate
    finding on random-weight soup, and nothing blocked in enforce mode."""
    calls = workload(96)
    results = run_all(gateway.url, calls)
    events = wait_for_events(
        gateway.log,
        lambda ev: sum(e["event"] == "exchange" for e in ev) >= len(calls),
        timeout=30,
    )
    exchanges = [e for e in events if e["event"] == "exchange"]
    assert len(exchanges) >= len(calls)
    assert {e["status"] for e in exchanges} == {200}
    assert {e["tenant"] for e in exchanges} == set(TENANTS.values())
    assert {e["verdict"] for e in exchanges} == {"clean"}, [
        e for e in events if e["event"] in ("leak.detected", "output.degenerate")
    ]
    assert not [e for e in events if e["event"] in ("leak.detected", "output.degenerate")]
    for call, (answer, _) in zip(calls, results, strict=True):
        text = (
            "".join(c["choices"][0]["delta"].get("content") or "" for c in answer if c["choices"])
            if call.stream
            else answer["choices"][0]["message"]["content"]
        )
        assert text.strip(), call


def test_audit_identifies_llama_cpp_and_says_what_it_cannot_know(llama: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "audit", "--target", llama],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = done.stdout
    assert "engine:   llamacpp" in out, out + done.stderr
    assert "Server: llama.cpp" in out
    assert "build number 1" in out and "0c1e570" in out  # built without git history
    assert "slots=4" in out
    assert "llamacpp-system-prompt-leak" in out  # versioned: to check, not ok
    assert done.returncode == 1  # the RAM prompt cache entry applies: on by default


def test_probe_of_a_random_weight_model_is_inconclusive(llama: str, tmp_path: Path) -> None:
    """The model does not repeat its prompt, so it could not have shown another
    tenant's data: the probe must not call it clean."""
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "probe", "--target", llama, "--tenants", "3",
         "--requests", "24", "--concurrency", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "INCONCLUSIVE" in done.stdout and "could not have shown" in done.stdout
