"""Limits at the door ([limits]), through a real mitmdump: a body over the size limit is
413 and never reaches the engine; beyond the concurrency limit a request is 429 with
Retry-After until an exchange in flight ends. Errors in the API's own format."""

from __future__ import annotations

import threading
import time
import urllib.error

import openai
import pytest
from conftest import run_mitmdump, run_sim, wait_for_events


def client(url: str, rid: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-limits", max_retries=0, timeout=30,
        default_headers={"X-Request-ID": rid, **headers},
    )  # fmt: skip


def ask(url: str, rid: str, text: str = "Hello", **headers: str):
    return client(url, rid, **headers).chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}]
    )


def stream(url: str, rid: str, **headers: str) -> None:
    chunks = client(url, rid, **headers).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me a story"}], stream=True
    )
    for _ in chunks:
        pass


def reached(sim, rid: str, timeout: float = 30) -> None:
    """Wait (bounded) until the engine has the request."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sim.headers(rid)
            return
        except urllib.error.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def limited(tmp_path):
    cfg = tmp_path / "limits.toml"
    cfg.write_text("[limits]\nmax_request_bytes = 2000\nmax_concurrent_exchanges = 2\n")
    with run_sim(tmp_path) as sim, run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as p:
        yield sim, p


def test_a_body_over_the_limit_is_413_and_never_reaches_the_engine(limited):
    sim, proxy = limited
    with pytest.raises(openai.APIStatusError) as info:
        ask(proxy.url, "too-big", "x " * 2000)
    assert info.value.status_code == 413
    assert info.value.body["code"] == "request_too_large"
    with pytest.raises(urllib.error.HTTPError):
        sim.headers("too-big")
    assert ask(proxy.url, "small").choices[0].message.content  # the next one passes


def test_beyond_the_concurrency_limit_clients_are_told_to_retry(limited):
    sim, proxy = limited
    slow = {"x-sim-misbehave": "slow"}  # 0.2 s a chunk: these two stay in flight a while
    busy = [
        threading.Thread(target=stream, args=(proxy.url, f"busy-{i}"), kwargs=slow) for i in (1, 2)
    ]
    for t in busy:
        t.start()
    for i in (1, 2):
        reached(sim, f"busy-{i}")
    with pytest.raises(openai.APIStatusError) as info:
        ask(proxy.url, "third")
    assert info.value.status_code == 429
    assert info.value.response.headers["retry-after"] == "1"
    assert info.value.body["code"] == "too_many_requests"
    for t in busy:
        t.join(60)
    assert ask(proxy.url, "after").choices[0].message.content
    events = wait_for_events(
        proxy.log, lambda ev: any(e.get("request_id") == "after" for e in ev), timeout=30
    )
    refused = [e for e in events if e["event"] == "limit.exceeded"]
    assert [e["status"] for e in refused] == [429]
