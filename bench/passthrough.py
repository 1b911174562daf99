"""Passthrough cost benchmark: what crosstalk adds to streamed LLM traffic.

The same load goes, in one run, to each target in ``make_targets``:

* ``direct``: straight to the simulated engine (no proxy), a floor;
* ``bare mitmdump``: ``mitmdump --mode reverse:SIM --set stream_large_bodies=1`` with no
  addon, the baseline (mitmproxy itself, streaming every body);
* ``bare mitmdump, second instance``: the same again, the control: its ratios to the
  baseline show how far two identical proxies differ in one run (the noise floor);
* ``crosstalk shadow``: ``python -m proxy run --upstream SIM --mode shadow`` (detection
  in its detector process, the default);
* ``crosstalk shadow, inline detector``: the same with ``policy.shadow_detector =
  "inline"`` (detection on the proxy's event loop, when it is idle);
* ``crosstalk enforce``: ``--mode enforce`` (always inline).

One simulator process (``python -m proxy sim --token-delay D``) serves every target; all
proxies are started at once and used only once their port answers ``GET /v1/models``.

Load: ``--concurrency`` clients (default 8) on one keep-alive aiohttp session share a
list of ``--requests`` streamed chat completions (default 200 per target per round).
Prompts come from ``proxy.sim.workload.Workload`` (20 tenants, sent as ``X-Tenant-ID``;
shared system prompts, pasted documents, code, CJK, multi-turn), answers are capped by
``--max-tokens``. Measured per request: TTFT = from just before the request is sent to
the first SSE ``data:`` event whose delta carries non-empty content; SSE events and bytes
received; completion time. Every response must be HTTP 200 ``text/event-stream`` ending
with ``data: [DONE]``; anything else counts as a failure (target: 0).

Noise control (shared 2-core machine): an unmeasured warm-up round, then ``--rounds``
rounds; in each round every target gets the identical request list, in a shuffled target
order. Per round and target: TTFT p50/p99, events/s = SSE events received / wall time of
that target's load, and the CPU time of the proxy's processes (from /proc: its detector process included). Reported values are
medians of the per-round values; ratios against bare mitmdump are computed per round, then
medianed. Targets (crosstalk rows): TTFT p50 ratio <= 1.05 and events/s ratio >= 0.95.

    python bench/passthrough.py [--quick] [--rounds 5] [--requests 200] [--json out.json]

Capacity (``--capacity``): the same at saturation, 64 concurrent streams with no token
delay (the simulator as fast as it can write), direct, through bare mitmdump, its
second instance and crosstalk shadow with its detector process only. The run counts
only if the proxy is what saturates: bare mitmdump must pass at most 0.9 of the events
per second the same load gets direct (else the clients or the simulator are the limit,
and every ratio is near 1 whatever crosstalk costs). What is judged is how many
SSE events per second crosstalk passes against bare mitmdump in the same rounds:
>= 0.9 (TTFT at saturation is queueing, reported but not judged), with every exchange
scanned: at most 1% may pass unscanned (a detector process that falls behind sheds
copies rather than slow the proxy; shedding them all would make any ratio easy). Each
crosstalk row's event log says how many of its exchanges were scanned, in both modes.

    python bench/passthrough.py --capacity [--rounds 5] [--requests 320]

Adding a target (e.g. enforce mode) is one line in ``make_targets``. Exit status: 0 when
every gated target passes and no request failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    die_with_parent,
    fmt,
    free_port,
    median_of,
    percentile,
    stop_on_sigterm,
    stop_processes,
)

from proxy.config import PolicySection  # noqa: E402
from proxy.pipeline.exchange import words_in  # noqa: E402
from proxy.protocols.sse import SSEDecoder  # noqa: E402
from proxy.sim.faults import PAGE_KINDS  # noqa: E402
from proxy.sim.oracle import Observed, PrivacyOracle  # noqa: E402
from proxy.sim.workload import SimRequest, Workload  # noqa: E402

HOST = "127.0.0.1"
BASELINE = "bare mitmdump"
CONTROL = "bare mitmdump, second instance"
DIRECT = "direct"
TTFT_RATIO_MAX = 1.05
EVENTS_RATIO_MIN = 0.95
# Enforce holds back this many words (the default policy): its first token can only
# come once the engine has produced them. Its TTFT is judged against bare mitmdump's
# plus that generation time, with the shadow target's tolerance.
HOLDBACK_WORDS = PolicySection().holdback_words
HOLDBACK_RATIO_MAX = TTFT_RATIO_MAX
CAPACITY_EVENTS_RATIO_MIN = 0.9  # events/s at saturation, against bare mitmdump
CAPACITY_CONCURRENCY = 64
CAPACITY_UNSCANNED_MAX = 0.01  # share of crosstalk's exchanges that passed unscanned
CAPACITY_BARE_OVER_DIRECT_MAX = 0.9  # else the proxy is not what saturates
DRAIN_TIMEOUT = 120.0  # seconds for a detector process to log what it was sent
TENANTS = 20
READY_TIMEOUT = 30.0  # seconds for every server to answer
REQUEST_TIMEOUT = 120.0  # seconds for one streamed response
STOP_TIMEOUT = 5.0  # seconds between SIGTERM and SIGKILL
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- targets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One row of the table: a server command line (None: the simulator itself)."""

    name: str
    argv: list[str] | None
    port: int | None
    gated: bool = False  # checked against the ratio targets
    ttft_gated: bool = True  # its TTFT too (not at saturation, where TTFT is queueing)
    events_min: float = EVENTS_RATIO_MIN
    # Holds back HOLDBACK_WORDS: TTFT judged against bare mitmdump + their generation time
    holdback: bool = False


def mitmdump_path() -> str:
    """The mitmdump next to this interpreter (the venv's), else the one on PATH."""
    sibling = Path(sys.executable).with_name("mitmdump")
    return str(sibling) if sibling.exists() else shutil.which("mitmdump") or "mitmdump"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def make_targets(
    sim_url: str, workdir: Path, crosstalk_args: Sequence[str] = (), *, capacity: bool = False
) -> list[Target]:
    """Every target of the run (``capacity``: the saturation rows). Add rows here;
    ``crosstalk(...)`` takes extra CLI args."""

    def mitmdump(name: str, *extra: str) -> Target:
        port = free_port()
        argv = [
            mitmdump_path(),
            "-q",
            "--mode",
            f"reverse:{sim_url}",
            "--listen-host",
            HOST,
            "-p",
            str(port),
            "--set",
            "stream_large_bodies=1",
            *extra,
        ]
        return Target(name, argv, port)

    def crosstalk(
        name: str,
        mode: str,
        *extra: str,
        holdback: bool = False,
        gated: bool = True,
        **judged: Any,
    ) -> Target:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "proxy",
            "run",
            "--upstream",
            sim_url,
            "--listen-host",
            HOST,
            "--listen-port",
            str(port),
            "--log-file",
            str(workdir / f"{slug(name)}.jsonl"),
            "--mode",
            mode,
            *crosstalk_args,
            *extra,
        ]
        return Target(name, argv, port, gated=gated, holdback=holdback, **judged)

    bare = [
        # lazy, as crosstalk sets it: both open the upstream connection per request
        mitmdump(BASELINE, "--set", "connection_strategy=lazy"),
        # A second, identical bare mitmdump (not gated): its ratio to the first is the
        # noise floor of this run, what a ratio can mean on a shared machine.
        mitmdump(CONTROL, "--set", "connection_strategy=lazy"),
    ]
    if capacity:
        return [
            Target(DIRECT, None, None),  # what the load reaches with no proxy: the ceiling
            *bare,
            crosstalk("crosstalk shadow", "shadow", ttft_gated=False,
                      events_min=CAPACITY_EVENTS_RATIO_MIN),
        ]  # fmt: skip
    inline = workdir / "inline-detector.toml"
    inline.write_text('[policy]\nshadow_detector = "inline"\n')
    return [
        Target(DIRECT, None, None),
        *bare,
        crosstalk("crosstalk shadow", "shadow"),
        # For comparison (not gated): the detector on the proxy's event loop.
        crosstalk(
            "crosstalk shadow, inline detector", "shadow", "--config", str(inline), gated=False
        ),
        crosstalk("crosstalk enforce", "enforce", holdback=True),
    ]


# --- processes ----------------------------------------------------------------------------


@dataclass
class Server:
    """A started server process and where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def cpu_seconds(self) -> float | None:
        """utime + stime so far of the process and its live descendants (crosstalk's
        detector process), from /proc (None where unavailable)."""
        try:
            return sum(process_cpu(pid) for pid in process_tree(self.proc.pid))
        except (OSError, IndexError, ValueError):
            return None


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc/PID/task/*/children."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(c) for c in (task / "children").read_text().split()]
        i += 1
    return pids


def start_server(name: str, argv: list[str], workdir: Path) -> Server:
    log = workdir / f"{slug(name)}.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
    return Server(name, proc, log)


def stop_servers(servers: Sequence[Server]) -> None:
    """SIGTERM every server we started, then SIGKILL what is still alive after a grace time."""
    stop_processes([s.proc for s in servers], STOP_TIMEOUT)


async def wait_ready(urls: dict[str, str], servers: dict[str, Server]) -> None:
    """Poll ``GET /v1/models`` on every URL until it answers 200 (bounded)."""
    deadline = time.monotonic() + READY_TIMEOUT
    pending = dict(urls)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while pending:
            for name, url in list(pending.items()):
                server = servers.get(name)
                if server is not None and server.proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {server.proc.returncode}:\n{server.tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(f"{url}/v1/models") as resp:
                        await resp.read()
                        if resp.status == 200:
                            del pending[name]
            if not pending:
                break
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{servers[n].tail()}" for n in pending if n in servers)
                raise RuntimeError(
                    f"not ready after {READY_TIMEOUT:.0f} s: {sorted(pending)}\n{tails}"
                )
            await asyncio.sleep(0.1)


# --- load ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One request: its tenant and its pre-encoded JSON body."""

    tenant: str
    body: bytes


@dataclass(slots=True)
class Result:
    """What one streamed response looked like from the client."""

    ttft: float | None = None  # seconds to the first content delta
    # seconds to the event that brought the output past HOLDBACK_WORDS words: an enforcing
    # proxy can release the first word then, at the earliest
    past_holdback: float | None = None
    total: float = 0.0  # seconds to the end of the body
    events: int = 0  # SSE events with data (the [DONE] event included)
    nbytes: int = 0
    error: str | None = None


def make_jobs(n: int, seed: int, max_tokens: int) -> list[Job]:
    """n streamed chat requests of the multi-tenant workload (completions sent as chat)."""
    jobs = []
    for req in Workload(tenants=TENANTS, seed=seed).requests(n):
        body: dict[str, Any] = {"model": "sim-llm-1", "messages": req.messages, "stream": True}
        if max_tokens > 0:
            body["max_tokens"] = max_tokens
        jobs.append(Job(req.tenant, orjson.dumps(body)))
    return jobs


def content_of(data: bytes) -> str:
    """The output text an SSE data payload carries (chat deltas or completions text)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return ""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    texts = []
    for choice in choices or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            texts.append(delta["content"])
        if isinstance(choice.get("text"), str):
            texts.append(choice["text"])
    return "".join(texts)


async def one_request(session: aiohttp.ClientSession, url: str, job: Job) -> Result:
    res = Result()
    headers = {"Content-Type": "application/json", "X-Tenant-ID": job.tenant}
    done = False
    after_done = False
    buf = b""
    output = ""
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=job.body, headers=headers) as resp:
            ctype = resp.headers.get("Content-Type", "")
            if resp.status != 200 or "text/event-stream" not in ctype:
                body = await resp.read()
                res.error = f"HTTP {resp.status} {ctype}: {body[:120]!r}"
                return res
            async for chunk in resp.content.iter_any():
                res.nbytes += len(chunk)
                buf += chunk
                while (end := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:end], buf[end + 2 :]
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        res.events += 1
                        data = line[5:].strip()
                        if done:
                            after_done = True
                        elif data == b"[DONE]":
                            done = True
                        elif res.past_holdback is None and (text := content_of(data)):
                            now = time.perf_counter() - t0
                            res.ttft = now if res.ttft is None else res.ttft
                            output += text
                            if words_in(output) > HOLDBACK_WORDS:
                                res.past_holdback = now
        res.total = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not done:
        res.error = "stream ended without data: [DONE]"
    elif after_done or buf.strip():
        res.error = "data after [DONE]"
    elif res.ttft is None:
        res.error = "no content delta"
    return res


def new_session(concurrency: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    )


async def run_load(
    base_url: str, jobs: Sequence[Job], concurrency: int
) -> tuple[list[Result], float]:
    """All jobs through `concurrency` workers on warm keep-alive connections; (results, wall)."""
    url = f"{base_url}/v1/chat/completions"
    async with new_session(concurrency) as session:
        # Open every connection (and the proxy's upstream connection) before timing.
        async def warm() -> None:
            async with session.get(f"{base_url}/v1/models") as resp:
                await resp.read()

        await asyncio.gather(*(warm() for _ in range(concurrency)))
        results: list[Result] = []
        it: Iterator[Job] = iter(jobs)

        async def worker() -> None:
            for job in it:  # one event loop: next() is never concurrent
                results.append(await one_request(session, url, job))

        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


# --- statistics ---------------------------------------------------------------------------


@dataclass
class RoundStats:
    """One target's numbers in one round."""

    target: str
    round: int
    order: int  # position of the target in this round's shuffled order
    requests: int
    failures: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    # median of (past_holdback - ttft): how long the engine takes to produce the holdback
    holdback_gen_p50_ms: float
    completion_p50_ms: float
    events: int
    bytes: int
    wall_s: float
    events_per_s: float
    proxy_cpu_s: float | None
    proxy_cpu_pct: float | None
    errors: list[str] = field(default_factory=list)


def round_stats(
    target: str,
    rnd: int,
    order: int,
    results: Sequence[Result],
    wall: float,
    cpu_s: float | None,
) -> RoundStats:
    ttfts = [r.ttft * 1000 for r in results if r.ttft is not None and r.error is None]
    totals = [r.total * 1000 for r in results if r.error is None]
    holdback_gen = [
        (r.past_holdback - r.ttft) * 1000
        for r in results
        if r.error is None and r.ttft is not None and r.past_holdback is not None
    ]
    events = sum(r.events for r in results)
    errors = [r.error for r in results if r.error is not None]
    return RoundStats(
        target=target,
        round=rnd,
        order=order,
        requests=len(results),
        failures=len(errors),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        holdback_gen_p50_ms=percentile(holdback_gen, 50),
        completion_p50_ms=percentile(totals, 50),
        events=events,
        bytes=sum(r.nbytes for r in results),
        wall_s=wall,
        events_per_s=events / wall if wall > 0 else float("nan"),
        proxy_cpu_s=cpu_s,
        proxy_cpu_pct=None if cpu_s is None else 100 * cpu_s / wall,
        errors=errors[:5],
    )


@dataclass
class Summary:
    """A target's medians across rounds and its per-round ratios to bare mitmdump."""

    target: str
    gated: bool
    holdback: bool
    ttft_gated: bool
    rounds: int
    failures: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    completion_p50_ms: float | None
    events_per_s: float | None
    proxy_cpu_pct: float | None
    proxy_cpu_ms_per_req: float | None
    ttft_p50_ratio: float | None
    ttft_p99_ratio: float | None
    events_ratio: float | None
    ttft_p50_ratios: list[float]
    events_ratios: list[float]
    # holdback targets: TTFT p50 / (bare TTFT p50 + the direct target's holdback generation
    # time p50), per round then medianed; and the two terms' medians
    holdback_ratio: float | None
    holdback_ratios: list[float]
    holdback_gen_ms: float | None
    added_over_bare_ms: float | None
    ttft_pass: bool | None
    events_pass: bool | None


def exchange_verdicts(log: Path) -> list[str]:
    """The verdicts of the ``exchange`` lines in a crosstalk event log."""
    if not log.exists():
        return []
    return [
        e.get("verdict", "")
        for line in log.read_bytes().splitlines()
        if line.strip() and (e := orjson.loads(line)).get("event") == "exchange"
    ]


def scan_coverage(
    targets: Sequence[Target], workdir: Path, sent: int, timeout: float = DRAIN_TIMEOUT
) -> dict[str, tuple[int, int, float]]:
    """Per crosstalk target, once its detector has logged all ``sent`` exchanges (or
    ``timeout`` seconds after the load ended): the exchanges sent, how many did not
    get scanned (verdict ``unscanned``: shed or lost; or never logged), and the seconds
    the detector took after the load to log the last one (its backlog at saturation)."""
    logs = {
        t.name: workdir / f"{slug(t.name)}.jsonl"
        for t in targets
        if t.argv and "--log-file" in t.argv
    }
    started = time.monotonic()
    done: dict[str, tuple[int, int, float]] = {}
    while len(done) < len(logs):
        for name, log in logs.items():
            verdicts = exchange_verdicts(log) if name not in done else []
            late = time.monotonic() - started
            if name not in done and (len(verdicts) >= sent or late > timeout):
                scanned = sum(v in ("clean", "leak", "blocked") for v in verdicts)
                done[name] = (sent, sent - scanned, round(late, 1))
        time.sleep(0.5)
    return done


def summarise(targets: Sequence[Target], rows: Sequence[RoundStats]) -> list[Summary]:
    by: dict[tuple[str, int], RoundStats] = {(r.target, r.round): r for r in rows}
    rounds = sorted({r.round for r in rows})
    # The engine's own pacing: measured without a proxy when the run has the direct target.
    pacing = DIRECT if any(r.target == DIRECT for r in rows) else BASELINE
    out = []
    for t in targets:
        mine = [by[(t.name, n)] for n in rounds if (t.name, n) in by]
        base = [by.get((BASELINE, n)) for n in rounds if (t.name, n) in by]
        p50r = [m.ttft_p50_ms / b.ttft_p50_ms for m, b in zip(mine, base, strict=True) if b]
        p99r = [m.ttft_p99_ms / b.ttft_p99_ms for m, b in zip(mine, base, strict=True) if b]
        evr = [m.events_per_s / b.events_per_s for m, b in zip(mine, base, strict=True) if b]
        cpu_per_req = [
            1000 * m.proxy_cpu_s / m.requests if m.proxy_cpu_s is not None else None for m in mine
        ]
        gen = [by[(pacing, n)].holdback_gen_p50_ms for n in rounds if (pacing, n) in by]
        hold_r = [
            m.ttft_p50_ms / (b.ttft_p50_ms + by[(pacing, m.round)].holdback_gen_p50_ms)
            for m, b in zip(mine, base, strict=True)
            if b and (pacing, m.round) in by
        ]
        added = [m.ttft_p50_ms - b.ttft_p50_ms for m, b in zip(mine, base, strict=True) if b]
        ttft_ratio, events_ratio = median_of(p50r), median_of(evr)
        holdback_ratio = median_of(hold_r) if t.holdback else None
        judged, limit = (
            (holdback_ratio, HOLDBACK_RATIO_MAX) if t.holdback else (ttft_ratio, TTFT_RATIO_MAX)
        )
        out.append(
            Summary(
                target=t.name,
                gated=t.gated,
                holdback=t.holdback,
                ttft_gated=t.ttft_gated,
                rounds=len(mine),
                failures=sum(m.failures for m in mine),
                ttft_p50_ms=median_of([m.ttft_p50_ms for m in mine]),
                ttft_p99_ms=median_of([m.ttft_p99_ms for m in mine]),
                completion_p50_ms=median_of([m.completion_p50_ms for m in mine]),
                events_per_s=median_of([m.events_per_s for m in mine]),
                proxy_cpu_pct=median_of([m.proxy_cpu_pct for m in mine]),
                proxy_cpu_ms_per_req=median_of(cpu_per_req),
                ttft_p50_ratio=ttft_ratio,
                ttft_p99_ratio=median_of(p99r),
                events_ratio=events_ratio,
                ttft_p50_ratios=p50r,
                events_ratios=evr,
                holdback_ratio=holdback_ratio,
                holdback_ratios=hold_r if t.holdback else [],
                holdback_gen_ms=median_of(gen),
                added_over_bare_ms=median_of(added),
                ttft_pass=None
                if not (t.gated and t.ttft_gated) or judged is None
                else judged <= limit,
                events_pass=None
                if not t.gated or events_ratio is None
                else events_ratio >= t.events_min,
            )
        )
    return out


def verdict(s: Summary) -> str:
    if not s.gated:
        return "baseline" if s.target == BASELINE else ""
    if (s.ttft_gated and s.ttft_pass is None) or s.events_pass is None:
        return "n/a"
    checks = (("TTFT", s.ttft_pass if s.ttft_gated else True), ("events/s", s.events_pass))
    missed = [m for m, ok in checks if not ok]
    if s.failures:
        missed.append("failures")
    return "PASS" if not missed else "FAIL (" + ", ".join(missed) + ")"


def table(summaries: Sequence[Summary]) -> str:
    head = (
        "| target | TTFT p50 ms | TTFT p99 ms | events/s | TTFT p50 / bare | events/s / bare "
        "| TTFT p99 / bare | req p50 ms | proxy CPU % | CPU ms/req | failures | verdict |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        lines.append(
            f"| {s.target} | {fmt(s.ttft_p50_ms, '.2f')} | {fmt(s.ttft_p99_ms, '.2f')} "
            f"| {fmt(s.events_per_s, '.0f')} | {fmt(s.ttft_p50_ratio, '.3f')} "
            f"| {fmt(s.events_ratio, '.3f')} | {fmt(s.ttft_p99_ratio, '.3f')} "
            f"| {fmt(s.completion_p50_ms, '.0f')} | {fmt(s.proxy_cpu_pct, '.0f')} "
            f"| {fmt(s.proxy_cpu_ms_per_req, '.2f')} | {s.failures} | {verdict(s)} |"
        )
    held = [s for s in summaries if s.holdback]
    if held:
        lines += [
            "",
            f"| target (holds back {HOLDBACK_WORDS:g} words) | TTFT p50 added over bare ms "
            f"| generation of {HOLDBACK_WORDS:g} words p50 ms | TTFT p50 / (bare + generation) |",
            "|---|---:|---:|---:|",
        ]
        for s in held:
            lines.append(
                f"| {s.target} | {fmt(s.added_over_bare_ms, '.1f')} | {fmt(s.holdback_gen_ms, '.1f')} "
                f"| {fmt(s.holdback_ratio, '.3f')} (target <= {HOLDBACK_RATIO_MAX}) |"
            )
    return "\n".join(lines)


# --- the run ------------------------------------------------------------------------------


async def bench(
    args: argparse.Namespace,
    targets: Sequence[Target],
    urls: dict[str, str],
    servers: dict[str, Server],
) -> list[RoundStats]:
    await wait_ready(urls, servers)
    rng = random.Random(args.seed)
    rows: list[RoundStats] = []
    warm_jobs = make_jobs(args.concurrency * 2, args.seed + 10_000, args.max_tokens)
    for rnd in range(args.rounds + 1):  # round 0: warm-up, not reported
        jobs = warm_jobs if rnd == 0 else make_jobs(args.requests, args.seed + rnd, args.max_tokens)
        order = list(targets)
        rng.shuffle(order)
        for pos, t in enumerate(order):
            server = servers.get(t.name)
            cpu0 = server.cpu_seconds() if server else None
            results, wall = await run_load(urls[t.name], jobs, args.concurrency)
            cpu1 = server.cpu_seconds() if server else None
            if server is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{t.name} died during the load:\n{server.tail()}")
            cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
            stats = round_stats(t.name, rnd, pos, results, wall, cpu)
            label = "warm-up" if rnd == 0 else f"round {rnd}/{args.rounds}"
            print(
                f"{label:>11} {t.name:<20} TTFT p50 {stats.ttft_p50_ms:7.2f} ms "
                f"p99 {stats.ttft_p99_ms:7.2f} ms  {stats.events_per_s:7.0f} ev/s  "
                f"wall {wall:5.1f} s  cpu {fmt(stats.proxy_cpu_pct, '3.0f'):>3}%  "
                f"fail {stats.failures}",
                flush=True,
            )
            for err in stats.errors:
                print(f"{'':>11} ! {err}", flush=True)
            if rnd > 0:
                rows.append(stats)
    return rows


# --- leaks: words from a leak's start to its detection --------------------------------------

LEAK_RATE = 0.1
LEAK_TOKEN_DELAY = 0.001  # lags are counted in words: no need to wait 5 ms a token
# Scan every delta (shadow's default batches 64 characters): the lag an enforcing
# proxy's holdback must cover.
LEAK_CONFIG = "[policy]\nshadow_batch_chars = 0\n"


@dataclass
class LeakStats:
    """Injected page leaks (>= 8 private words) through ``crosstalk run`` in shadow mode."""

    requests: int
    targets: int
    found: int
    right_source: int
    clean: int
    clean_flagged: int
    lags: list[float]  # words from a found leak's first private word to its detection
    # target leaks missed, or logged with another source: "request id (kind, source)"
    misses: list[str] = field(default_factory=list)


async def leak_request(session: aiohttp.ClientSession, url: str, req: SimRequest) -> str:
    """The output text of one streamed chat request, as the client received it."""
    headers = {"X-Tenant-ID": req.tenant, "X-Request-ID": req.request_id}
    body = {"model": "sim-llm-1", "messages": req.messages, "stream": True}
    decoder, text = SSEDecoder(), []
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        async for chunk in resp.content.iter_any():
            text += [content_of(event.data.encode()) for event in decoder.feed(chunk)]
    return "".join(text)


async def leak_load(url: str, reqs: Sequence[SimRequest], concurrency: int) -> dict[str, str]:
    outputs: dict[str, str] = {}
    it = iter(reqs)
    async with new_session(concurrency) as session:

        async def worker() -> None:
            for req in it:
                outputs[req.request_id] = await leak_request(session, url, req)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outputs


def judge_leaks(
    earlier: Sequence[SimRequest],
    reqs: Sequence[SimRequest],
    outputs: dict[str, str],
    truth: Path,
    log: Path,
) -> LeakStats:
    """Which injected page leaks in ``reqs`` had >= 8 private words (the oracle, which
    also knows the ``earlier`` traffic), which were logged, and how many words after the
    leak's first private word the detector had enough."""
    faults = {}
    for line in truth.read_text().splitlines() if truth.exists() else []:
        fault = orjson.loads(line)
        faults[fault["request_id"]] = fault
    detections: dict[str, dict] = {}
    for line in log.read_text().splitlines():
        event = orjson.loads(line)
        if event.get("event") == "leak.detected":
            detections.setdefault(event["request_id"], event)
    oracle = PrivacyOracle(
        Observed(r.tenant, r.prompt_text(), outputs.get(r.request_id, ""),
                 faults.get(r.request_id, {}).get("leaked_text", ""))
        for r in [*earlier, *reqs]
    )  # fmt: skip
    stats = LeakStats(len(reqs), 0, 0, 0, 0, 0, [])
    for req in reqs:
        fault, found = faults.get(req.request_id), detections.get(req.request_id)
        if fault is None:
            stats.clean += 1
            stats.clean_flagged += found is not None
            continue
        source, leaked = fault["source_tenant"], fault["leaked_text"]
        if fault["kind"] not in PAGE_KINDS or oracle.private_run(source, leaked) < 8:
            continue
        stats.targets += 1
        what = f"{req.request_id} ({fault['kind']} of {fault['source_request_id']}"
        if found is None:
            stats.misses.append(f"{what}): missed")
            continue
        stats.found += 1
        stats.right_source += found["source_tenant"] == source
        if found["source_tenant"] != source:
            stats.misses.append(f"{what}): logged with {found['source_request_id']}")
        output = outputs[req.request_id]
        if leaked in output:
            stats.lags.append(
                oracle.words_to_detection(source, leaked, output, found["detected_at"])
            )
    return stats


async def measure_leaks(
    args: argparse.Namespace, workdir: Path, servers: list[Server], crosstalk_args: Sequence[str]
) -> LeakStats:
    """A simulator injecting faults behind a shadow ``crosstalk run`` (both their own: the
    timed rounds stay clean). ``--leak-warmup`` requests first, unjudged, so that the
    engine has learned the workload's boilerplate as a deployed one has; then
    ``--leak-requests``, judged."""
    sim_port, proxy_port = free_port(), free_port()
    truth, log = workdir / "leaks-truth.jsonl", workdir / "leaks-events.jsonl"
    config = workdir / "leaks.toml"
    config.write_text(LEAK_CONFIG)
    sim_url, proxy_url = f"http://{HOST}:{sim_port}", f"http://{HOST}:{proxy_port}"
    sim = start_server(
        "leaks sim",
        [sys.executable, "-m", "proxy", "sim", "--host", HOST, "--port", str(sim_port),
         "--token-delay", str(LEAK_TOKEN_DELAY), "--split-words", "--leak-rate", str(LEAK_RATE),
         "--truth", str(truth), "--seed", str(args.seed)],
        workdir,
    )  # fmt: skip
    proxy = start_server(
        "leaks crosstalk shadow",
        [sys.executable, "-m", "proxy", "run", "--upstream", sim_url, "--listen-host", HOST,
         "--listen-port", str(proxy_port), "--log-file", str(log), "--mode", "shadow",
         "--config", str(config), *crosstalk_args],
        workdir,
    )  # fmt: skip
    servers += [sim, proxy]
    await wait_ready({"sim": sim_url, "proxy": proxy_url}, {"sim": sim, "proxy": proxy})
    workload = Workload(tenants=TENANTS, seed=args.seed + 7919)
    earlier = list(workload.requests(args.leak_warmup))
    outputs = await leak_load(proxy_url, earlier, args.concurrency)
    judged = list(workload.requests(args.leak_requests))
    outputs |= await leak_load(proxy_url, judged, args.concurrency)
    stop_servers([proxy, sim])  # flushes the event log and the truth file
    return judge_leaks(earlier, judged, outputs, truth, log)


def leak_table(stats: LeakStats) -> str:
    lags = stats.lags
    within = sum(lag <= HOLDBACK_WORDS for lag in lags)
    return "\n".join(
        [
            "| leaks (shadow, leak rate 0.1) | value |",
            "|---|---:|",
            f"| requests / page leaks with >= 8 private words | {stats.requests} / {stats.targets} |",
            f"| found / with the right source | {stats.found} / {stats.right_source} |",
            f"| clean responses flagged | {stats.clean_flagged} / {stats.clean} |",
            "| words from a leak's first private word to its detection, p50 / p90 / max "
            f"| {fmt(percentile(lags, 50), '.1f')} / {fmt(percentile(lags, 90), '.1f')} "
            f"/ {fmt(max(lags, default=float('nan')), '.1f')} |",
            f"| detected within the {HOLDBACK_WORDS:g}-word holdback | {within} / {len(lags)} |",
            *(f"  {miss}" for miss in stats.misses),
        ]
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~30 s: 3 rounds of 48 requests")
    p.add_argument("--rounds", type=int, help="measured rounds (default 5, --quick 3)")
    p.add_argument("--requests", type=int, help="per target per round (default 200, quick 48)")
    p.add_argument(
        "--capacity", action="store_true",
        help=f"saturation: {CAPACITY_CONCURRENCY} clients, no token delay, events/s judged",
    )  # fmt: skip
    p.add_argument("--concurrency", type=int, help="concurrent clients (default 8)")
    p.add_argument("--token-delay", type=float, help="simulator s per event (default 0.005)")
    p.add_argument(
        "--max-tokens", type=int, default=80, help="answer cap in words (0: full ~160-word answers)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--leak-requests",
        type=int,
        help="requests of the leak measurement (default 600, quick 200; 0: skip it)",
    )
    p.add_argument(
        "--leak-warmup", type=int, help="unjudged requests before it (default 1000, quick 300)"
    )
    p.add_argument(
        "--crosstalk-args", default="", help="extra arguments for every crosstalk command (shell)"
    )
    p.add_argument("--keep-logs", metavar="DIR", help="write server output and event logs here")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    args = p.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 5)
    if args.requests is None:
        args.requests = 48 if args.quick else 5 * CAPACITY_CONCURRENCY if args.capacity else 200
    if args.concurrency is None:
        args.concurrency = CAPACITY_CONCURRENCY if args.capacity else 8
    if args.token_delay is None:
        args.token_delay = 0.0 if args.capacity else 0.005
    if args.leak_requests is None:
        args.leak_requests = 0 if args.capacity else 200 if args.quick else 600
    if args.leak_warmup is None:
        args.leak_warmup = 300 if args.quick else 1000
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1:
        p.error("--rounds, --requests and --concurrency must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    servers: list[Server] = []
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            workdir = Path(args.keep_logs)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="passthrough-")))
        stack.callback(stop_servers, servers)  # runs first: before the directory goes
        sim_port = free_port()
        sim_url = f"http://{HOST}:{sim_port}"
        sim_argv = [sys.executable, "-m", "proxy", "sim", "--host", HOST, "--port", str(sim_port)]
        sim_argv += ["--token-delay", str(args.token_delay)]
        servers.append(start_server("sim", sim_argv, workdir))
        targets = make_targets(
            sim_url, workdir, shlex.split(args.crosstalk_args), capacity=args.capacity
        )
        names = [t.name for t in targets]
        if len(set(names)) != len(names) or BASELINE not in names:
            raise SystemExit(f"target names must be unique and include {BASELINE!r}")
        by_name: dict[str, Server] = {}
        urls: dict[str, str] = {}
        for t in targets:
            if t.argv is None:
                urls[t.name] = sim_url
                continue
            by_name[t.name] = start_server(t.name, t.argv, workdir)
            servers.append(by_name[t.name])
            urls[t.name] = f"http://{HOST}:{t.port}"
        print(
            f"passthrough: {len(targets)} targets, {args.rounds} rounds x {args.requests} "
            f"requests, {args.concurrency} clients, token delay {args.token_delay * 1000:g} ms, "
            f"max_tokens {args.max_tokens or 'none'}, {os.cpu_count()} CPUs",
            flush=True,
        )
        started = time.monotonic()
        try:
            rows = asyncio.run(bench(args, targets, urls, {"sim": servers[0], **by_name}))
            elapsed = time.monotonic() - started
            sent = 2 * args.concurrency + args.rounds * args.requests  # warm-up, rounds
            coverage = scan_coverage(targets, workdir, sent)
            stop_servers(servers)  # the leak measurement has servers of its own
            leaks = None
            if args.leak_requests > 0:
                ct_args = shlex.split(args.crosstalk_args)
                leaks = asyncio.run(measure_leaks(args, workdir, servers, ct_args))
        except KeyboardInterrupt:
            print("\ninterrupted; stopping servers", file=sys.stderr)
            return 130
        except RuntimeError as e:
            print(f"passthrough: {e}", file=sys.stderr)
            return 1

    summaries = summarise(targets, rows)
    print()
    print(table(summaries))
    print()
    print(
        f"Medians over {args.rounds} rounds; ratios per round vs {BASELINE}, then medianed. "
        + (
            f"Target (saturation): events/s ratio >= {CAPACITY_EVENTS_RATIO_MIN}"
            if args.capacity
            else f"Targets: TTFT p50 ratio <= {TTFT_RATIO_MAX}, events/s ratio >= "
            f"{EVENTS_RATIO_MIN}"
        )
        + f", 0 failures. Run took {elapsed:.0f} s."
    )
    for name, (exchanges, unscanned, drain) in coverage.items():
        print(
            f"  {name}: {exchanges} exchanges, {unscanned} not scanned; its detector logged "
            f"the last one {drain:g} s after the load ended"
        )
    if leaks is not None:
        print()
        print(leak_table(leaks))
    for s in summaries:
        if s.target not in (BASELINE, DIRECT):
            print(
                f"  {s.target}: per-round TTFT p50 ratios "
                + " ".join(f"{r:.3f}" for r in s.ttft_p50_ratios)
                + "; events/s ratios "
                + " ".join(f"{r:.3f}" for r in s.events_ratios)
                + (
                    "; TTFT p50 / (bare + holdback generation) "
                    + " ".join(f"{r:.3f}" for r in s.holdback_ratios)
                    if s.holdback
                    else ""
                )
            )
    ok = all(verdict(s) == "PASS" for s in summaries if s.gated) and not any(
        s.failures for s in summaries
    )
    if args.capacity:
        by = {s.target: s.events_per_s for s in summaries}
        headroom = by[BASELINE] / by[DIRECT] if by.get(DIRECT) and by.get(BASELINE) else None
        print(f"capacity: bare mitmdump passes {fmt(headroom, '.3f')} of direct's events/s")
        if headroom is None or headroom > CAPACITY_BARE_OVER_DIRECT_MAX:
            print("capacity: the proxy is not what saturates; the ratios say nothing")
            ok = False
        shed = {n: u / e for n, (e, u, _) in coverage.items()}
        if not shed or max(shed.values()) > CAPACITY_UNSCANNED_MAX:
            print(f"capacity: more than {CAPACITY_UNSCANNED_MAX:.0%} not scanned: {shed}")
            ok = False
    if args.json:
        doc = {
            "config": {
                k: v for k, v in vars(args).items() if k not in ("json", "keep_logs", "quick")
            },
            "targets": [asdict(t) for t in targets],
            "thresholds": {
                "ttft_p50_ratio_max": TTFT_RATIO_MAX,
                "events_ratio_min": EVENTS_RATIO_MIN,
                "capacity_events_ratio_min": CAPACITY_EVENTS_RATIO_MIN,
                "holdback_ratio_max": HOLDBACK_RATIO_MAX,
            },
            "summary": [asdict(s) for s in summaries],
            "rounds": [asdict(r) for r in rows],
            "leaks": asdict(leaks) if leaks is not None else None,
            "scan_coverage": {
                n: {"exchanges": e, "not_scanned": u, "drain_s": d}
                for n, (e, u, d) in coverage.items()
            },
            "elapsed_s": elapsed,
            "pass": ok,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
