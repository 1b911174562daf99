"""SIGHUP reloads policy, tenants and baselines without dropping open streams; an
invalid file keeps the old configuration and says why. Through `crosstalk run` and
through crosstalk's addon in a plain `mitmdump -s` (each with its detector process), the
real openai SDK, the simulator."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import ROOT, read_events, run_mitmdump, run_sim, start_server, stop, wait_for_events

CONFIG = '[tenants]\nsources = ["api_key"]\n[tenants.api_keys]\n"sk-reload" = "{tenant}"\n'


def ask(url: str, rid: str, *, stream: bool = False, **headers: str) -> str:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-reload", max_retries=0, timeout=60,
        default_headers={"X-Request-ID": rid, **headers},
    )  # fmt: skip
    messages = [{"role": "user", "content": "Tell me about the plan"}]
    if stream:
        chunks = client.chat.completions.create(
            model="m", messages=messages, stream=True, max_tokens=40
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content


def tenant_of(log, rid: str) -> str:
    events = wait_for_events(
        log, lambda ev: any(e.get("request_id") == rid and e["event"] == "exchange" for e in ev),
        timeout=30,
    )  # fmt: skip
    return next(e["tenant"] for e in events if e["event"] == "exchange" and e["request_id"] == rid)


def until(log, event: str, count: int) -> list[dict]:
    return wait_for_events(
        log, lambda ev: sum(e["event"] == event for e in ev) >= count, timeout=30
    )


@contextlib.contextmanager
def launched(how: str, tmp_path: Path, upstream: str, cfg: Path) -> Iterator[tuple[str, Any, Path]]:
    """The proxy as a user starts it: ``crosstalk run``, or crosstalk's addon in their own
    ``mitmdump -s``. Yields its URL, process and event log."""
    if how == "mitmdump":
        with run_mitmdump(tmp_path, upstream, f"crosstalk_config={cfg}") as proxy:
            yield proxy.url, proxy.proc, proxy.log
        return
    log = tmp_path / "events.jsonl"

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "proxy", "run", "--listen-port", str(port),
                "--upstream", upstream, "--config", str(cfg), "--log-file", str(log)]  # fmt: skip

    with (tmp_path / "run.stderr").open("wb") as err:
        proc, port = start_server(command, stderr=err, cwd=ROOT)
    try:
        yield f"http://127.0.0.1:{port}", proc, log
    finally:
        assert stop(proc) == 0


@pytest.mark.parametrize("how", ["crosstalk run", "mitmdump"])
def test_sighup_reloads_tenants_and_keeps_open_streams(tmp_path, how):
    cfg = tmp_path / "crosstalk.toml"
    cfg.write_text(CONFIG.format(tenant="alpha"))
    with run_sim(tmp_path) as sim, launched(how, tmp_path, sim.url, cfg) as (url, proc, log):
        ask(url, "before")
        assert tenant_of(log, "before") == "alpha"
        # A stream in flight across the reload (0.2 s a chunk).
        answers: list[str] = []
        slow = threading.Thread(
            target=lambda: answers.append(
                ask(url, "in-flight", stream=True, **{"x-sim-misbehave": "slow"})
            )
        )
        slow.start()
        sim.wait_received("in-flight")
        cfg.write_text(CONFIG.format(tenant="omega"))
        proc.send_signal(signal.SIGHUP)
        until(log, "config.reloaded", 2)  # the proxy and its detector process
        ask(url, "after")
        assert tenant_of(log, "after") == "omega"
        slow.join(120)
        assert answers == [sim.answer("in-flight")]  # the open stream ran to its end
        assert tenant_of(log, "in-flight") == "alpha"  # with the tenant it began with
        # An invalid file: the old configuration stays, and the log says why.
        cfg.write_text('[tenants]\nsources = ["nowhere"]\n')
        proc.send_signal(signal.SIGHUP)
        failed = until(log, "config.reload_failed", 1)
        ask(url, "after-bad")
        assert tenant_of(log, "after-bad") == "omega"
        # A key file that holds no key: the same.
        (tmp_path / "idp.pem").write_text("not a key\n")
        cfg.write_text(f'[tenants]\nsources = ["jwt"]\njwt_key_file = "{tmp_path / "idp.pem"}"\n')
        proc.send_signal(signal.SIGHUP)
        failed = until(log, "config.reload_failed", 2)
        ask(url, "after-bad-key")
        assert tenant_of(log, "after-bad-key") == "omega"
    reasons = [e["reason"] for e in failed if e["event"] == "config.reload_failed"]
    assert "tenants.sources" in reasons[0] and "tenants.jwt_key_file" in reasons[1]
    exchange = {e["request_id"]: e for e in read_events(log) if e["event"] == "exchange"}
    assert exchange["in-flight"]["status"] == 200
