"""Shadow detection in a child process (proxy/mitm/detector_process.py, detector_worker.py).

Real parts: ``mitmdump`` with the crosstalk addon, which spawns the real detector
process; the simulator injecting faults; the ``openai`` SDK as the client. The two
placements must find the same leaks on the same traffic; a dead or stalled child must
never cost a client a byte.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from conftest import ROOT, TEST_KEY, free_port, read_events, run_mitmdump, run_sim, wait_for_events
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.mitm.detector_process import WORKER_FLAGS, DetectorProcess, FrameDecoder, encode
from proxy.sim.workload import Workload


def client(url: str, tenant: str, request_id: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=30,
        default_headers={"X-Tenant-ID": tenant, "X-Request-ID": request_id},
    )


def ask(url: str, tenant: str, request_id: str, messages: list[dict], stream: bool) -> str:
    c = client(url, tenant, request_id)
    if stream:
        parts = c.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    return c.chat.completions.create(model="m", messages=messages).choices[0].message.content


def findings_of(events: list[dict]) -> set[tuple]:
    return {
        (e["request_id"], e["source_request_id"], e["kind"])
        for e in events
        if e["event"] == "leak.detected"
    }


def config(tmp: Path, placement: str) -> Path:
    path = tmp / f"{placement}.toml"
    path.write_text(f'[detection]\nkey = "{TEST_KEY}"\n[policy]\nshadow_detector = "{placement}"\n')
    return path


def test_inline_and_process_find_the_same_leaks(tmp_path: Path):
    """The same sequential traffic (so the same order), the same injected faults: the
    detector process logs exactly the findings and verdicts inline mode logs."""
    requests = list(Workload(tenants=6, seed=11).requests(70))
    logged = {}
    for placement in ("inline", "process"):
        with (
            run_sim(tmp_path, "--token-delay", "0", "--leak-rate", "0.3", "--seed", "5") as sim,
            run_mitmdump(tmp_path, sim.url, f"crosstalk_config={config(tmp_path, placement)}") as p,
        ):
            for i, r in enumerate(requests):
                ask(p.url, r.tenant, r.request_id, r.messages, stream=i % 3 != 0)
            events = wait_for_events(
                p.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= len(requests)
            )
            configured = [e for e in events if e["event"] == "crosstalk.configured"]
            assert {e["detector"] for e in configured} == (
                {"inline"} if placement == "inline" else {"process", "inline"}
            )
            logged[placement] = (
                findings_of(events),
                {e["request_id"]: e["verdict"] for e in events if e["event"] == "exchange"},
            )
    assert len(logged["inline"][0]) >= 5  # the faults were there to find
    assert logged["process"] == logged["inline"]


def test_dead_detector_fails_open_and_is_replaced(tmp_path: Path):
    """Killing the child costs no client anything: answers stay byte-identical to what
    the simulator sent, one detector.error says so, and a fresh child takes over."""
    with (
        run_sim(tmp_path, "--token-delay", "0") as sim,
        run_mitmdump(tmp_path, sim.url, f"crosstalk_config={config(tmp_path, 'process')}") as p,
    ):
        messages = [{"role": "user", "content": "Summarise our travel policy, please."}]
        assert ask(p.url, "acme", "before-kill", messages, stream=True)
        ready = wait_for_events(p.log, lambda ev: any(e["event"] == "detector.ready" for e in ev))
        pid = next(e["pid"] for e in ready if e["event"] == "detector.ready")
        os.kill(pid, signal.SIGKILL)
        for i in range(6):
            rid = f"after-kill-{i}"
            raw = client(p.url, "acme", rid).chat.completions.with_raw_response.create(
                model="m", messages=messages, stream=i % 2 == 0
            )
            assert raw.http_response.read() == sim.sent(rid)
        events = wait_for_events(
            p.log, lambda ev: sum(e["event"] == "detector.ready" for e in ev) >= 2, timeout=60
        )
        errors = [e for e in events if e["event"] == "detector.error"]
        assert len(errors) == 1
        assert "exited" in errors[0]["reason"] and errors[0]["action"] == "failed_open"
        assert "replaced" in errors[0]["reason"]
        new_pid = [e["pid"] for e in events if e["event"] == "detector.ready"][-1]
        assert new_pid != pid
        assert ask(p.url, "acme", "after-restart", messages, stream=True)
        logged = wait_for_events(
            p.log, lambda ev: any(e.get("request_id") == "after-restart" for e in ev)
        )
        assert any(e["event"] == "exchange" and e["request_id"] == "after-restart" for e in logged)
        assert p.proc.poll() is None
    # No exchange vanishes from the log with the child: the ones it never logged (sent
    # while it was gone) have their line from the proxy, verdict "unscanned".
    lines = {e["request_id"]: e for e in read_events(p.log) if e["event"] == "exchange"}
    for rid in ["before-kill", "after-restart", *(f"after-kill-{i}" for i in range(6))]:
        assert rid in lines, rid
    unscanned = [e for e in lines.values() if e["verdict"] == "unscanned"]
    assert all("detector process" in e["error"] for e in unscanned)


def test_a_stalled_detector_makes_the_proxy_skip_copies_not_wait(tmp_path: Path):
    """A stopped child: once ``max_backlog`` bytes wait for it, new exchanges are not
    copied (never blocking the sender); resumed, it catches up and copies resume."""
    events: list[tuple[str, object]] = []

    async def scenario() -> None:
        hello = {"key": TEST_KEY, "options": {"crosstalk_log_file": str(tmp_path / "w.jsonl")}}
        detector = DetectorProcess(
            hello, nice=0, max_backlog=256 << 10, on_event=lambda *e: events.append(e)
        )
        detector.start()
        assert await detector.ready(60) is None
        os.kill(detector.proc.pid, signal.SIGSTOP)
        try:
            chunk = b"data: " + b"x" * 16_000 + b"\n\n"
            started = time.monotonic()
            sent = 0
            while detector.accepting():
                assert detector.send("chunk", 999, chunk, time.monotonic())  # no such exchange
                sent += 1
                assert sent < 1000
            assert time.monotonic() - started < 30  # never waited for the child (stopped)
            assert events == [("lagging", detector.backlog)]
        finally:
            os.kill(detector.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while not detector.accepting():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert events[-1][0] == "caught_up"
        assert detector.close() == 0

    asyncio.run(scenario())


def test_a_detector_that_cannot_start_stops_the_proxy(tmp_path: Path):
    """Its journal directory is a file: the child cannot open it and says why, and the
    proxy stops, as inline mode refuses that configuration."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    cfg = config(tmp_path, "process")
    cfg.write_text(cfg.read_text() + f'[journal]\ndirectory = "{blocker}"\n')
    with (
        run_sim(tmp_path) as sim,
        pytest.raises(RuntimeError, match="exited"),
        run_mitmdump(tmp_path, sim.url, f"crosstalk_config={cfg}") as p,
    ):
        deadline = time.monotonic() + 60
        while p.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError(f"proxy exited: {p.proc.poll()}")
    (log,) = tmp_path.glob("events-*.jsonl")
    failed = [e for e in read_events(log) if e["event"] == "detector.failed"]
    assert failed and "journal" in failed[0]["reason"]
    # crosstalk run: exit status 2 and the reason, as for a configuration it refuses;
    # no "crosstalk is running" banner.
    run = subprocess.run(
        [sys.executable, "-m", "proxy", "run", "--listen-port", str(free_port()),
         "--upstream", "http://127.0.0.1:9", "--config", str(cfg)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "the detector process failed" in run.stderr and "journal" in run.stderr
    assert "crosstalk is running" not in run.stdout


@settings(max_examples=60, deadline=None)
@given(
    messages=st.lists(
        st.tuples(st.sampled_from(["chunk", "request"]), st.integers(0, 99), st.binary()),
        max_size=8,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_frames_survive_any_split(messages, cuts):
    stream = b"".join(encode(*m) for m in messages)
    bounds = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    decoder = FrameDecoder()
    decoded = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        decoded += decoder.feed(stream[start:end])
    assert decoded == messages


def test_placement_follows_the_policies(tmp_path: Path):
    """auto: a detector process unless some policy enforces (the engine must then be on
    the proxy's loop, and one engine sees all traffic); process with enforce: refused."""
    from proxy import config as configuration

    def load(text: str, **overrides: str):
        path = tmp_path / "c.toml"
        path.write_text(text)
        return configuration.load(path, **overrides)

    assert load("").detector_process()
    assert not load("", proxy__mode="enforce").detector_process()
    assert not load('[policy.tenants.acme]\nmode = "enforce"\n').detector_process()
    assert not load('[policy.routes."/v1/completions"]\nmode = "enforce"\n').detector_process()
    assert not load('[policy]\nshadow_detector = "inline"\n').detector_process()
    with pytest.raises(configuration.ConfigError, match="cannot serve enforce"):
        load('[policy]\nshadow_detector = "process"\n', proxy__mode="enforce")
    with pytest.raises(configuration.ConfigError, match="shadow_detector must be"):
        load('[policy]\nshadow_detector = "thread"\n')
    with pytest.raises(configuration.ConfigError, match="0..19"):
        load("[policy]\nshadow_detector_nice = 20\n")


FINISHED_COPY = """
import gc, sys, weakref
from mitmproxy import http
from proxy.mitm.detector_worker import rebuilt_flow
from proxy.mitm.flowstate import METADATA_KEY
from proxy.pipeline.exchange import ExchangeMonitor

def finished_copy(released):
    request = http.Request.make("POST", "http://127.0.0.1:1/v1/chat/completions", b"{}")
    flow = rebuilt_flow(request.get_state(), None)
    flow.response = http.Response.make(200, b"{}")
    monitor = ExchangeMonitor(
        route="chat", tenant="B", request_id="b-1", scan=None,
        on_findings=lambda _, found: None, on_block=lambda _: flow.kill(),
    )
    flow.metadata[METADATA_KEY] = monitor
    monitor.on_delta = lambda choice, text: monitor.output_chars  # a cycle, as the addon's
    if released:
        monitor.release()
        flow.metadata.clear()
    return weakref.ref(monitor), weakref.ref(flow), weakref.ref(flow.request)

gc.collect()
gc.disable()
print(sum(ref() is not None for ref in finished_copy(sys.argv[1] == "released")))
"""


@pytest.mark.parametrize(
    "flags, released, left",
    [(WORKER_FLAGS, True, 0), (WORKER_FLAGS, False, 3), ((), True, 3)],
    ids=["worker", "not-released", "debug-python"],
)
def test_a_finished_copy_is_freed_without_the_cycle_collector(flags, released, left):
    """The detector process rebuilds each exchange as a flow, and the addons' callbacks
    close over it and its monitor: if that made a reference cycle, the copies would pile
    up for a full collection, which frees the last minutes' exchanges at once while
    every stream waits (measured: 16-64 ms of a detector's full collections). The worker
    releases a finished copy and runs under -O; with the collector off, its monitor,
    flow and request are then gone with their last reference. Controls: a copy not
    released, or built by a Python with mitmproxy's debug type checks (whose caught
    TypeErrors hold the frames that built the request), stays alive: 3 of 3 left."""
    out = subprocess.run(
        [sys.executable, *flags, "-c", FINISHED_COPY, "released" if released else "kept"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert int(out.stdout) == left


class _Child:
    """A detector process that takes every copy and answers nothing."""

    def accepting(self) -> bool:
        return True

    def send(self, *message: object) -> None:
        pass

    def close(self) -> None:
        pass


class _Proxy:
    """What a placement asks of its ``CrossTalk``: here, the unscanned lines it logs."""

    def __init__(self) -> None:
        self.unscanned: list[tuple[str, str]] = []

    def log_unscanned(self, flow, reason: str) -> None:
        self.unscanned.append((flow.request.path, reason))


def test_a_stopped_detector_s_exchanges_pass_on_and_are_logged_once_each():
    """A reconfiguration stops the detector process with exchanges in its hands: the
    one whose end it had is logged as unscanned at once; the one still streaming keeps
    streaming (never buffered, though no mirror copies it), no hook of it reaches a
    later child, and it is logged as unscanned at its end, once."""
    from mitmproxy.test import tflow

    from proxy.mitm.detector_process import MIRROR_KEY, FlowMirror
    from proxy.mitm.placement import ENDED_KEY, InProcess

    proxy = _Proxy()
    placement = InProcess(proxy)  # type: ignore[arg-type]
    placement.mirror = FlowMirror(_Child())  # type: ignore[arg-type]
    ended, streaming = tflow.tflow(resp=True), tflow.tflow(resp=True)
    ended.request.path, streaming.request.path = "/ended", "/streaming"
    for flow in (ended, streaming):
        assert placement.mirror.request(flow)
    ended.metadata[ENDED_KEY] = True
    placement.stop()
    assert proxy.unscanned == [("/ended", "the detector process was stopped before logging it")]
    assert MIRROR_KEY not in streaming.metadata
    streaming.response.headers["content-type"] = "text/event-stream"
    placement.responseheaders(streaming, None, True)  # type: ignore[arg-type]
    assert streaming.response.stream is True
    asyncio.run(placement.response(streaming, None))  # type: ignore[arg-type]
    asyncio.run(placement.response(streaming, None))  # type: ignore[arg-type]
    assert proxy.unscanned[1:] == [
        ("/streaming", "the detector process was stopped before logging it")
    ]
