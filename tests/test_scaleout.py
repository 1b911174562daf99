"""Scale-out on Redis (proxy/store/redis_index.py): replicas share their keyed records through
a Redis Stream, against a real ``redis-server`` on a free loopback port (nothing mocked).

- In one process: two engines linked through the stream (latency from publication to
  visibility, cross-engine findings), a new replica loading the window, another key
  refused, an outage (degraded once, bounded outbox, recovery, catch-up), trimming.
- End to end: three ``crosstalk run`` replicas behind a round-robin done here, in front
  of one simulator with fault injection: leaks whose source and victim passed different
  replicas are found with the right source at the single-replica floors.
- Faults end to end: Redis stopped while traffic flows (no client sees an error, local
  detection goes on), started again (the outboxes catch the others up, cross-replica
  detection resumes), one replica restarted (it rejoins with the window).

``redis-server`` comes from the distribution (``.ci/run`` installs it). Without it the
tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest
import redis
from conftest import (
    ROOT,
    TEST_KEY,
    free_port,
    missing_tool,
    read_events,
    run_sim,
    stop,
    wait_for_events,
    wait_for_port,
)
from pki import issue, make_ca
from traffic import Result, judge, load_truth, send

from proxy.config import ConfigError, load
from proxy.engine.detector import FRAGMENT
from proxy.engine.ordered_replay import RecordReplayer
from proxy.engine.records import OutputRecord, PromptRecord, unjudged
from proxy.eventlog import make_logger
from proxy.factory import build_engine
from proxy.sim.answers import answer_for
from proxy.sim.workload import SimRequest, Workload
from proxy.store.codec import is_packed, pack, unpack
from proxy.store.journal import encode
from proxy.store.redis_index import (
    Ingester,
    OriginIngester,
    Pacer,
    SharedIndex,
    domain_of,
    settings_from,
)

# -- a real redis-server ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server_bin() -> str:
    """The ``redis-server`` binary; skipped without one, failed under CI."""
    found = shutil.which("redis-server")
    if found is None:
        message = (
            "redis-server is not installed (Debian/Ubuntu: apt-get install redis-server; "
            ".ci/run installs it)"
        )
        missing_tool(message)
    return found


class RedisServer:
    """One redis-server on 127.0.0.1, stopped and started again on the same port."""

    def __init__(self, binary: str, directory: Path, *extra: str) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_port(self.port, self.proc)
        deadline = time.monotonic() + 10
        while True:  # listening is not yet loaded: wait for PING
            with contextlib.suppress(redis.RedisError):
                if self.client().ping():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server does not answer PING")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)


@contextlib.contextmanager
def redis_server(binary: str, directory: Path, *extra: str) -> Iterator[RedisServer]:
    server = RedisServer(binary, directory, *extra)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- in one process ---------------------------------------------------------------------------


class Events:
    """A replica's JSON-lines event log, read back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.log = make_logger(path)

    def named(self, name: str) -> list[dict]:
        return [e for e in read_events(self.path) if e["event"] == name]


def replica(
    tmp: Path, url: str, name: str, key: str = TEST_KEY, window: float = 600.0, **index
) -> tuple:
    """An engine and its SharedIndex, as the addon makes them, logging to ``name``."""
    cfg = load(
        None,
        detection__key=key,
        detection__window_seconds=window,
        index__url=url,
        index__reconnect_max_seconds=0.5,
        **{f"index__{k}": v for k, v in index.items()},
    )
    engine = build_engine(cfg)
    events = Events(tmp / f"{name}.jsonl")
    counters: dict[str, int] = {}
    return engine, SharedIndex(settings_from(cfg), engine, events.log, counters), events, counters


def phrase(n: int = 12) -> str:
    """Words nobody else uses."""
    return " ".join(secrets.token_hex(3) + "q" for _ in range(n))


SECRET = (
    "Project Quillfeather merger terms: Halvorsen Bright pays 41.7 million for Ostrava "
    "Lumen, closing on the ninth of Brumaire, codename saffron lantern"
)


async def until(predicate, timeout: float = 30.0) -> float:
    """Seconds until ``predicate()`` held (polling the loop every 0.5 ms)."""
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.0005)
    return time.perf_counter() - started


def test_replicas_share_records_through_the_stream(tmp_path, redis_server_bin):
    """A prompt observed by A is found as the source of a leak in B's output; a new
    replica C loads the window before serving; records of another key are refused."""
    with redis_server(redis_server_bin, tmp_path) as server:
        a_engine, a, _, a_counts = replica(tmp_path, server.url, "a")
        b_engine, b, b_events, b_counts = replica(tmp_path, server.url, "b")

        async def scenario() -> list[float]:
            a.load_window(), b.load_window()
            a.start(), b.start()
            # Publication to visibility on the other replica, one record at a time.
            latencies = []
            for i in range(200):
                scan = a_engine.observe_prompt(f"tenant-{i % 7}", f"warm-{i}", phrase())
                scan.feed(f"Answer {i}.")
                scan.finish()
                a.publish(scan.prompt)
                latencies.append(await until(lambda n=2 * i: b_counts["index_ingested"] > n))
                a.publish(scan.record())
            scan = a_engine.observe_prompt("alpha", "source-1", SECRET)
            a.publish(scan.prompt)
            await until(lambda: b_counts["index_ingested"] == 401)
            victim = b_engine.observe_prompt("beta", "victim-1", "How do I reset my password?")
            found = victim.feed(f"Sure. {SECRET} Then click reset.") + victim.finish()
            # The page, and the firm it names ("Project Quillfeather", known here by id
            # only), as the engine that saw the prompt finds them.
            assert sorted((f.kind, f.source_tenant, f.source_request_id) for f in found) == [
                ("entity", "alpha", "source-1"),
                ("fragment", "alpha", "source-1"),
            ]
            a.close(), b.close()
            await asyncio.sleep(0)
            return latencies

        latencies = asyncio.run(scenario())
        q = statistics.quantiles([x * 1000 for x in latencies], n=100)
        print(
            f"publication -> visibility on another replica: p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms"
        )
        # Latency is bench/scaleout.py's to judge; here every publication became visible.
        # At least once: a batch in flight when A stopped is sent again at exit.
        assert a_counts["index_published"] >= 401 and b_counts["index_ingested"] == 401
        assert b_counts["index_remote_findings"] == 0  # A's own exchanges were clean
        stopped = b_events.named("index.stopped")
        assert stopped and stopped[0]["index_ingested"] == 401

        # A replica that starts now loads the window before it serves: it knows the source.
        c_engine, c, c_events, c_counts = replica(tmp_path, server.url, "c")
        c.load_window()
        ready = c_events.named("index.ready")[0]
        assert ready["entries"] >= 401 and ready["complete"] and ready["origins"] == 1
        assert c_counts["index_ingested"] == 401  # duplicates (see above) skipped
        victim = c_engine.observe_prompt("gamma", "victim-2", "Any news today?")
        found = victim.feed(f"Yes: {SECRET}") + victim.finish()
        assert {f.source_tenant for f in found} == {"alpha"}

        # Records hashed under another key mean nothing here: refused, logged once.
        other_key = secrets.token_hex(32)
        d_engine, d, _, _ = replica(tmp_path, server.url, "d", key=other_key)
        for i in range(3):
            d.publish(d_engine.observe_prompt("delta", f"d-{i}", SECRET).prompt)
        d.close()  # flushes the outbox synchronously
        # Entries that cannot be read are counted and skipped, the others still used:
        # neither packed nor zlib, an old replica's line of no record, a packed record
        # cut short, one whose array runs past its end.
        packed = pack(a_engine.observe_prompt("alpha", "cut", SECRET).prompt)
        arrays_at = 8 + int.from_bytes(packed[4:8], "little")  # magic, length, JSON
        for garbage in (
            b"not zlib",
            zlib.compress(b'{"t": "prompt"}'),
            zlib.compress(packed[:20]),
            zlib.compress(packed[:arrays_at] + b"\0" * 8),
        ):
            server.client().xadd(
                "crosstalk:records",
                {"o": "elsewhere", "k": a_engine.hasher.key_id, "r": garbage, "t": "0"},
            )
        e_engine, e, e_events, e_counts = replica(tmp_path, server.url, "e")
        e.load_window()
        assert e_counts["index_refused"] == 3 and e_counts["index_ingested"] == 401
        assert len(e_events.named("index.refused")) == 1
        assert e_counts["index_corrupt"] == 4 and len(e_events.named("index.corrupt")) == 1
        # Nothing that left a replica is text: the secret's words are nowhere in Redis.
        entries = server.client().xrange("crosstalk:records")
        dump = b"".join(
            zlib.decompress(v) if k == b"r" else v
            for _, fields in entries
            if fields[b"o"] != b"elsewhere"  # the garbage above
            for k, v in fields.items()
        )
        ours = [f[b"r"] for _, f in entries if f[b"o"] != b"elsewhere"]
        # Standard zlib data (ISA-L wrote it): a replica of a version before it reads it.
        assert all(is_packed(zlib.decompress(r)) for r in ours)
        assert b"alpha" in dump and b"source-1" in dump  # tenant and request ids: yes
        words = [w.strip(",:") for w in SECRET.split() if len(w.strip(",:")) >= 7]
        assert len(words) >= 8 and not any(w.encode() in dump for w in words)


def test_outage_degrades_once_holds_the_outbox_and_catches_up(tmp_path, redis_server_bin):
    with redis_server(redis_server_bin, tmp_path) as server:
        a_engine, a, a_events, a_counts = replica(tmp_path, server.url, "a", outbox_records=50)
        b_engine, b, b_events, b_counts = replica(tmp_path, server.url, "b")
        texts: dict[str, str] = {}

        def observe(n: int, tag: str) -> None:
            for i in range(n):
                text = texts[f"{tag}-{i}"] = phrase()
                a.publish(a_engine.observe_prompt("alpha", f"{tag}-{i}", text).prompt)

        async def scenario() -> None:
            a.load_window(), b.load_window()
            a.start(), b.start()
            observe(10, "before")
            await until(lambda: b_counts["index_ingested"] == 10)
            server.stop()
            # Redis is gone: publishing never waits, the outbox keeps the newest 50.
            started = time.perf_counter()
            observe(80, "during")
            assert time.perf_counter() - started < 30  # waiting would be 80 timeouts
            await until(lambda: a_counts["index_degraded"] == 1 and b_counts["index_degraded"] == 1)
            await asyncio.sleep(1.0)  # a few failed reconnections: still one episode each
            assert len(a_events.named("index.degraded")) == 1
            assert len(b_events.named("index.degraded")) == 1
            assert a_counts["index_dropped"] == 30 and len(a.publisher.outbox) == 50
            server.start()  # same port, empty
            await until(lambda: b_counts["index_ingested"] == 60, timeout=20)
            assert len(a_events.named("index.recovered")) == 1
            assert len(b_events.named("index.recovered")) == 1
            observe(5, "after")
            await until(lambda: b_counts["index_ingested"] == 65)
            a.close(), b.close()
            await asyncio.sleep(0)

        asyncio.run(scenario())
        # B knows what A saw during the outage: the newest 50 of those 80 prompts.
        for rid, known in (("during-79", True), ("during-30", True), ("during-29", False)):
            victim = b_engine.observe_prompt("beta", f"victim-{rid}", "What is new?")
            found = victim.feed(f"News: {texts[rid]}.") + victim.finish()
            assert [f.source_request_id for f in found] == ([rid] if known else []), rid
        assert a_counts["index_degraded"] == b_counts["index_degraded"] == 1


def test_a_stalled_redis_never_holds_up_traffic(tmp_path, redis_server_bin):
    """Redis frozen (SIGSTOP): publishing costs the caller nothing, the event loop keeps
    turning, the replicas degrade once; thawed, they recover, and batches that timed
    out but did reach Redis are not ingested twice."""
    with redis_server(redis_server_bin, tmp_path) as server:
        a_engine, a, a_events, a_counts = replica(tmp_path, server.url, "a", timeout_seconds=4.0)
        b_engine, b, _, b_counts = replica(tmp_path, server.url, "b", timeout_seconds=4.0)

        def observe(i: int) -> None:
            a.publish(a_engine.observe_prompt("alpha", f"p-{i}", phrase()).prompt)

        async def scenario() -> tuple[float, float]:
            a.load_window(), b.load_window()
            a.start(), b.start()
            for i in range(5):
                observe(i)
            await until(lambda: b_counts["index_ingested"] == 5)
            server.proc.send_signal(signal.SIGSTOP)
            try:
                slowest_publish = loop_lag = 0.0
                for i in range(5, 105):
                    record = a_engine.observe_prompt("alpha", f"p-{i}", phrase()).prompt
                    started = time.perf_counter()
                    a.publish(record)
                    slowest_publish = max(slowest_publish, time.perf_counter() - started)
                    started = time.perf_counter()
                    await asyncio.sleep(0.005)
                    loop_lag = max(loop_lag, time.perf_counter() - started - 0.005)
                await until(lambda: a_counts["index_degraded"] == 1, timeout=20)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            await until(lambda: b_counts["index_ingested"] == 105, timeout=20)
            await asyncio.sleep(0.5)  # any late duplicate would be here by now
            a.close(), b.close()
            await asyncio.sleep(0)
            return slowest_publish, loop_lag

        slowest_publish, loop_lag = asyncio.run(scenario())
        print(f"stalled Redis: slowest publish {slowest_publish * 1e6:.0f} us, loop lag "
              f"{loop_lag * 1000:.1f} ms, skipped duplicates {b_counts['index_skipped']}")  # fmt: skip
        # A call that waited for the frozen Redis would hold the loop for the whole
        # timeout (4 s); what is left is the machine's own scheduling noise.
        assert slowest_publish < 2.0 and loop_lag < 2.0
        assert b_counts["index_ingested"] == 105
        assert len(a_events.named("index.degraded")) == 1
        assert len(a_events.named("index.recovered")) == 1


def test_outputs_ingested_whole_teach_the_engine_what_feed_by_feed_replay_does():
    """``ResponseScan.ingest_output``: an output record ingested whole, its text judged
    as the origin's scan judged it (``foreign``), leaves the engine
    knowing the same sources as replaying it delta by delta (for the leaks of 100
    victims), with the same index; so does a record of an earlier version, scanned
    again as one feed."""
    cfg = load(None, detection__key=TEST_KEY)
    origin = build_engine(cfg)
    rng = random.Random(7)
    requests = list(Workload(tenants=24, seed=3).requests(150))
    records = []
    for req in requests:
        scan = origin.observe_prompt(req.tenant, req.request_id, req.prompt_text())
        answer, pos = answer_for(req.prompt_text()), 0
        while pos < len(answer):
            step = rng.randint(1, 12)
            scan.feed(answer[pos : pos + step])
            pos += step
        scan.finish()
        records += [scan.prompt, scan.record()]
    outputs = [r for r in records if isinstance(r, OutputRecord)]
    # Text other tenants hold is met everywhere in these answers: the judgment matters.
    judged = [c.foreign for r in outputs for c in r.choices if c.foreign is not None]
    assert len(judged) > 0.9 * len(outputs) and sum(map(len, judged)) > 1000
    findings: dict[str, list] = {"steps": [], "whole": [], "whole, before": []}
    held = {}
    for mode, found in findings.items():
        engine = build_engine(cfg)
        replayer, ingester = RecordReplayer(engine), OriginIngester(engine)
        for record in records:
            if mode == "steps":
                replayer.push(record)
            else:
                ingester.push(unjudged(record) if mode == "whole, before" else record)
        replayer.close()
        held[mode] = engine.fingerprints
        victims = random.Random(11)
        for v in range(100):
            source = victims.choice(requests)
            text = (
                source.prompt_text() if victims.random() < 0.5 else answer_for(source.prompt_text())
            )
            words = text.split()
            n = victims.choice((8, 12, 16, 32))
            start = victims.randint(0, max(0, len(words) - n))
            output = f"Thank you for asking. {' '.join(words[start : start + n])} Hope this helps."
            scan = engine.observe_prompt("victim", f"v-{v}", "What is new?")
            got = [f for k in range(0, len(output), 7) for f in scan.feed(output[k : k + 7])]
            found.append(sorted((f.source_request_id, f.kind) for f in got + scan.finish()))
    assert sum(map(bool, findings["whole"])) >= 30
    assert findings["whole"] == findings["steps"] == findings["whole, before"]
    assert held["whole"] == held["steps"]


def test_a_leak_ingested_whole_stays_its_source_s_text():
    """The text of a leak the origin found is not its victim's on the replicas that
    ingest the victim's output (scanned again there: its record holds no judgment):
    leaked there again, to the victim or to a third tenant, it names its source."""
    cfg = load(None, detection__key=TEST_KEY)
    origin = build_engine(cfg)
    source = origin.observe_prompt("alpha", "source-1", SECRET)
    victim = origin.observe_prompt("beta", "victim-1", "Any news on my order?")
    answer = f"Here it is: {SECRET}. Anything else?"
    leaked = [f for w in answer.split(" ") for f in victim.feed(w + " ")] + victim.finish()
    assert {f.source_tenant for f in leaked} == {"alpha"}
    output = victim.record()
    assert output.choices[0].foreign is None  # a leak was found: no judgment
    judged = build_engine(cfg).observe_prompt("beta", "victim-1", "Any news on my order?")
    for w in answer.split(" "):
        judged.feed(w + " ")
    judged.finish()  # the same output where no source is known: nothing found, judged
    assert judged.record().choices[0].foreign is not None

    def again(record: OutputRecord, tenant: str) -> set[str]:
        """The sources of the text (not entity) findings on the leak's text again."""
        receiver = build_engine(cfg)
        ingester = OriginIngester(receiver)
        for r in (source.prompt, victim.prompt, record):
            ingester.push(r)
        scan = receiver.observe_prompt(tenant, f"{tenant}-2", "Anything new?")
        found = scan.feed(f"Also: {SECRET}") + scan.finish()
        return {f.source_tenant for f in found if f.kind == FRAGMENT}

    for tenant in ("beta", "gamma"):
        assert again(output, tenant) == {"alpha"}
        assert again(unjudged(output), tenant) == {"alpha"}  # judged here, rescanned
    no_foreign = np.empty(0, np.uint32)
    ignored = dataclasses.replace(
        output,
        choices=tuple(dataclasses.replace(c, foreign=no_foreign) for c in output.choices),
    )
    # Taken as judged with nothing found in it (a record that lied), the leak's text is
    # the victim's own words there, and in a third tenant's answer the victim's model
    # output, tied to nothing: both missed.
    assert again(ignored, "beta") == again(ignored, "gamma") == set()


def test_an_answer_carried_to_another_tenant_carries_on_every_replica():
    """A finding of another request's answer in an output makes that output carry its
    tenant's answer (``ResponseScan._carries``): the rest of it, seen only there, is no
    evidence when its tenant is answered it again (tests/test_engine.py's cut stream,
    across replicas). A replica that ingests the copy must know it too, also when the
    source left the window before the copy ended (the finding cannot be made again
    there): the record says which answers it carries (``carries``). Not knowing it,
    the receiver reported the tenant's own answer as the copy's tenant's leak."""
    cfg = load(None, detection__key=TEST_KEY)
    origin = build_engine(cfg)
    question = "Summarise the Vividfield Foods deadline and the reference of my invoice."
    head = ("Vividfield Foods moves the Halvorsen deadline to 13 May. The amount due is "
            "8,168.78, scheduled for August. Order ORD-2026-641211 was placed by Noor "
            "Thibodeau.")  # fmt: skip
    tail = "The projected Kestrel total is 5,373.97 under reference REF-16299053 for Lisbet."
    window = origin.config.window_seconds
    for gap in (1.0, window - 5):  # the copy starts soon after the cut, or near the edge
        now = time.time()
        cut = origin.observe_prompt("alpha", "a-1", question, now=now)
        cut.feed(head, now=now)
        cut.finish(now=now)  # the stream was cut: the engine saw only its head
        start, end = now + gap, now + window + 3
        copy = origin.observe_prompt("beta", "b-1", "Weather in Oslo?", now=start)
        found = copy.feed(f"{head} ", now=start)
        # Another request as the copy still streams: past the window, it sweeps "a-1".
        other = origin.observe_prompt("gamma", "g-1", "Hello there, how are you?", now=end)
        found += copy.feed(tail, now=end) + copy.finish(now=end)
        assert {f.source_tenant for f in found} == {"alpha"}
        record = copy.record()
        assert record.carries == ("alpha",) and record.choices[0].foreign is None
        records = [cut.prompt, cut.record(), copy.prompt, other.prompt, record]

        def answered_again(engine, at: float = end + 1) -> list:
            scan = engine.observe_prompt("alpha", "a-2", question, now=at)
            return scan.feed(f"Again: {tail}", now=at) + scan.finish(now=at)

        receiver = build_engine(cfg)
        ingester = OriginIngester(receiver)
        for r in records:
            ingester.push(unpack(pack(r)))
        assert answered_again(origin) == answered_again(receiver) == [], gap
        # Without the record's word for it, the receiver that swept the source first
        # would have made no finding again, and reported the answer as beta's leak.
        blind = build_engine(cfg)
        ingester = OriginIngester(blind)
        for r in records:
            ingester.push(dataclasses.replace(r, carries=()) if r is record else r)
        if gap > 1:
            assert {f.source_tenant for f in answered_again(blind) if f.kind == FRAGMENT} == {
                "beta"
            }
        origin = build_engine(cfg)


def test_a_replica_starts_while_redis_is_down(tmp_path, redis_server_bin):
    """Redis unreachable at start: the replica is ready at once with what it has, and
    catches up (both ways) once Redis answers."""
    server = RedisServer(redis_server_bin, tmp_path)  # not started yet
    try:
        a_engine, a, a_events, a_counts = replica(tmp_path, server.url, "a")
        started = time.monotonic()
        a.load_window()
        assert time.monotonic() - started < 2.0
        ready = a_events.named("index.ready")[0]
        assert ready["complete"] is False and ready["entries"] == 0
        assert [e["where"] for e in a_events.named("index.degraded")] == ["load"]

        async def scenario() -> None:
            a.start()
            for i in range(3):
                a.publish(a_engine.observe_prompt("alpha", f"early-{i}", phrase()).prompt)
            await asyncio.sleep(0.3)
            server.start()
            await until(lambda: a_counts["index_published"] == 3, timeout=10)
            a.close()
            await asyncio.sleep(0)

        asyncio.run(scenario())
        assert len(a_events.named("index.recovered")) == 1
        _, b, b_events, b_counts = replica(tmp_path, server.url, "b")
        b.load_window()
        assert b_counts["index_ingested"] == 3
    finally:
        server.stop()


def test_tls_and_password(tmp_path, redis_server_bin):
    """``tls = true`` with the CA that signed the server's certificate, and a password
    (never logged); a wrong password is an outage like any other."""
    ca, cert, key = make_certificates(tmp_path)
    port = free_port()
    tls = ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
           "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
           "--tls-auth-clients", "no", "--requirepass", "s3cret-pw")  # fmt: skip
    proc = subprocess.Popen(
        [redis_server_bin, "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path), *tls],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, proc)
        url = f"redis://127.0.0.1:{port}/0"
        options = {"tls": True, "tls_ca_file": str(ca)}
        a_engine, a, a_events, a_counts = replica(
            tmp_path, url, "a", password="s3cret-pw", **options
        )
        for i in range(3):
            a.publish(a_engine.observe_prompt("alpha", f"tls-{i}", phrase()).prompt)
        a.close()  # synchronous flush over TLS
        assert a_counts["index_published"] == 3
        _, b, _, b_counts = replica(tmp_path, url, "b", password="s3cret-pw", **options)
        b.load_window()
        assert b_counts["index_ingested"] == 3
        _, c, c_events, c_counts = replica(tmp_path, url, "c", password="wrong", **options)
        c.load_window()
        assert c_counts["index_ingested"] == 0
        degraded = c_events.named("index.degraded")
        assert len(degraded) == 1 and "Authentication" in degraded[0]["reason"], degraded
        logs = b"".join(p.read_bytes() for p in tmp_path.glob("*.jsonl"))
        assert b"s3cret-pw" not in logs
    finally:
        stop(proc)


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed: (CA, chain, key) PEM files."""
    ca = make_ca(directory, "ca")
    cert, key = issue(directory, "server", ca)
    return ca[0], cert, key


def test_stream_is_trimmed_to_the_detection_window(tmp_path, redis_server_bin):
    # Small stream nodes, so that approximate trimming (whole nodes) shows at this size.
    with redis_server(redis_server_bin, tmp_path, "--stream-node-max-entries", "10") as server:
        engine, index, _, counts = replica(tmp_path, server.url, "a", window=2.0)
        assert engine.config.window_seconds == 2.0

        async def scenario() -> None:
            index.start()
            for i in range(100):
                index.publish(engine.observe_prompt("alpha", f"old-{i}", f"old {i}").prompt)
            await until(lambda: counts["index_published"] == 100)
            await asyncio.sleep(2.5)
            for i in range(15):
                index.publish(engine.observe_prompt("alpha", f"new-{i}", f"new {i}").prompt)
            await until(lambda: counts["index_published"] == 115)
            index.close()
            await asyncio.sleep(0)

        asyncio.run(scenario())
        length = server.client().xlen("crosstalk:records")
        assert length < 40, length  # the 100 old entries left with the window


def test_under_load_records_go_in_batches_one_call_per_batch_ms(tmp_path, redis_server_bin):
    """A record offered every ~2 ms: without pacing, each would cost a send on A and a
    read on B (~100 us of CPU each); with ``batch_ms`` they share calls, at most one
    per ``batch_ms``, and every one still arrives."""
    batch_ms, records = 40.0, 150
    with redis_server(redis_server_bin, tmp_path) as server:
        a_engine, a, _, a_counts = replica(tmp_path, server.url, "a", batch_ms=batch_ms)
        _, b, _, b_counts = replica(tmp_path, server.url, "b", batch_ms=batch_ms)

        async def scenario() -> float:
            a.start(), b.start()
            started = time.monotonic()
            for i in range(records):
                a.publish(a_engine.observe_prompt("alpha", f"r-{i}", phrase()).prompt)
                await asyncio.sleep(0.002)
            await until(lambda: b_counts["index_ingested"] == records)
            elapsed = time.monotonic() - started
            a.close(), b.close()
            await asyncio.sleep(0)
            return elapsed

        elapsed = asyncio.run(scenario())
    most = elapsed * 1000 / batch_ms + 2  # one per batch_ms, and the first at once
    assert 1 <= a_counts["index_sends"] <= most, (a_counts["index_sends"], most)
    assert 1 <= b_counts["index_reads"] <= most, (b_counts["index_reads"], most)
    assert b_counts["index_ingested"] == records


def test_a_call_after_a_quiet_spell_or_with_a_backlog_is_not_held_back():
    now = [100.0]
    pacer = Pacer(interval=30.0, clock=lambda: now[0])

    async def calls() -> None:
        await asyncio.wait_for(pacer.wait(), timeout=5.0)  # the first: at once
        now[0] += 31.0  # a quiet spell longer than the interval
        await asyncio.wait_for(pacer.wait(), timeout=5.0)
        await asyncio.wait_for(pacer.wait(backlog=True), timeout=5.0)  # a full call is due
        with pytest.raises(TimeoutError):  # within the interval, no backlog: held back
            await asyncio.wait_for(pacer.wait(), timeout=0.2)

    asyncio.run(calls())


def test_batch_ms_is_checked():
    with pytest.raises(ConfigError, match="batch_ms"):
        load(None, detection__key=TEST_KEY, index__url="redis://127.0.0.1:1/0", index__batch_ms=-1)


# -- three `crosstalk run` replicas ----------------------------------------------------------


@dataclass
class Replica:
    port: int
    log: Path
    proc: subprocess.Popen
    config: Path
    upstream: str
    index: str | None = None  # given by --index

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in read_events(self.log) if name is None or e["event"] == name]


def replica_config(
    tmp: Path, name: str, warm_state: Path, url: str | None, index_extra: str = ""
) -> Path:
    """Each replica: the shared key, its own copy of the learned state, the index
    (``url`` None: given by ``--index`` instead). Its detector process keeps the
    proxy's CPU priority: three replicas on this 2-core machine would starve a niced
    one, and what it has not read yet, the other replicas cannot match either."""
    root = tmp / name
    root.mkdir()
    shutil.copy(warm_state, root / "state.npz")
    cfg = root / "crosstalk.toml"
    cfg.write_text(
        f'[detection]\nkey = "{TEST_KEY}"\nstate_file = "{root / "state.npz"}"\n'
        + (f'[index]\nurl = "{url}"\n' if url else "[index]\n")
        + f'replica_name = "{name}"\ntimeout_seconds = 2.0\nreconnect_max_seconds = 0.5\n'
        + index_extra
        + "[policy]\nshadow_detector_nice = 0\n"
    )
    return cfg


def start_replica(
    config: Path, upstream: str, port: int | None = None, index: str | None = None
) -> Replica:
    """``crosstalk run`` (with ``--index`` when given), once its engine has loaded the
    window (``index.ready``). With detection in a process, the proxy listens first:
    the copies of early exchanges wait in the pipe until the window is loaded."""
    port = port or free_port()
    log = config.parent / f"events-{port}-{time.monotonic_ns()}.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "run", "--upstream", upstream,
         "--listen-port", str(port), "--config", str(config), "--log-file", str(log),
         *(["--index", index] if index else [])],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    replica = Replica(port, log, proc, config, upstream, index)
    try:
        wait_for_port(port, proc, timeout=60)
        deadline = time.monotonic() + 60
        while not replica.events("index.ready"):
            assert time.monotonic() < deadline, "the window was never loaded"
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
    except BaseException:
        stop(proc)  # a replica that never got ready must not outlive the test
        raise
    return replica


@contextlib.contextmanager
def replicas(tmp: Path, n: int, upstream: str, warm_state: Path, url: str, flag: bool = False):
    """``n`` replicas; the index in their config, or with ``flag`` as ``--index``."""
    configs = [replica_config(tmp, f"r{i}", warm_state, None if flag else url) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:  # each start loads an engine: in parallel
        started = list(
            pool.map(lambda c: start_replica(c, upstream, index=url if flag else None), configs)
        )
    try:
        yield started
    finally:
        for r in started:
            stop(r.proc)


def round_robin(urls: list[str], requests: list[SimRequest], concurrency: int = 16):
    """Request i goes to replica i % len(urls): the load balancer."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda ir: send(urls[ir[0] % len(urls)], ir[1]), enumerate(requests)))


def all_events(reps: list[Replica]) -> list[dict]:
    return [e for r in reps for e in r.events()]


def exchanges_logged(reps: list[Replica], results: list[Result]) -> list[dict]:
    ids = {r.request.request_id for r in results}

    def logged() -> set:
        return {e.get("request_id") for e in all_events(reps) if e["event"] == "exchange"}

    deadline = time.monotonic() + 30
    while not ids <= logged() and time.monotonic() < deadline:
        time.sleep(0.1)
    return all_events(reps)


REQUESTS, TENANTS = 600, 24
# Measured 2026-12-06 at 5c5a0db: 59/63 found, 41/43 across replicas. Here there are
# only ~60 targets, ~40 of them across replicas: one standard deviation of the measured
# share is 3-3.5 points, so the floors sit about two below (a floor of 0.9 failed a CI
# run at 34/39 across replicas, 2026-12-01). A replica that did not see the others' records would find
# next to nothing across replicas, far below either floor.
# False positives: ~480 clean exchanges, so one flagged is 0.21%. Under load a replica
# may scan a phrase before the others' records of it arrived (commonness crosses replicas
# with the stream's lag): one such exchange failed a 0.2% bound in a run with the other
# core busy. The bound is 1% (four); bench/quality.py measures the rate itself.
MIN_RECALL, MIN_CROSS_RECALL, MIN_RIGHT_SOURCE, MAX_FALSE_POSITIVES = 0.88, 0.85, 0.97, 0.01
SIM_ARGS = ("--token-delay", "0.001", "--split-words", "--leak-rate", "0.2", "--seed", "11")


def test_three_replicas_find_leaks_across_replicas(tmp_path, warm_state, redis_server_bin):
    with (
        redis_server(redis_server_bin, tmp_path) as server,
        run_sim(tmp_path, *SIM_ARGS) as sim,
        replicas(tmp_path, 3, sim.url, warm_state, server.url) as reps,
    ):
        requests = list(Workload(tenants=TENANTS, seed=21).requests(REQUESTS))
        started = time.monotonic()
        results = round_robin([r.url for r in reps], requests)
        elapsed = time.monotonic() - started
        events = exchanges_logged(reps, results)
        for r in results:
            assert r.error is None, (r.request.request_id, r.error)
            assert r.body == sim.sent(r.request.request_id), r.request.request_id
        j = judge(results, load_truth(sim.truth), events, sim.answer)
        for r in reps:
            stop(r.proc)
        stopped = [r.events("index.stopped")[0] for r in reps]
        memory = stream_memory(server.client())
    print(
        f"Redis: {memory['bytes'] / REQUESTS:.0f} B per exchange, "
        f"{memory['bytes'] / memory['units']:.1f} B per unit hash (a unit makes one "
        f"fingerprint), {memory['entries']} entries"
    )
    replica_of = {req.request_id: i % 3 for i, req in enumerate(requests)}
    cross = [
        t
        for t in j.targets
        if replica_of[t["request_id"]] != replica_of.get(t["source_request_id"])
    ]
    cross_found = [t for t in j.found if t in cross]
    cross_right = [t for t in j.right_source if t in cross]
    summary = (
        f"targets={len(j.targets)} found={len(j.found)} right_source={len(j.right_source)} "
        f"cross-replica: targets={len(cross)} found={len(cross_found)} right={len(cross_right)} "
        f"clean={j.clean} flagged={len(j.clean_flagged)} "
        f"missed={[(m['request_id'], m['kind'], m['leaked_text'][:60]) for m in j.missed]}"
    )
    print(f"3 replicas: {REQUESTS / elapsed:.0f} requests/s;", summary)
    print("visibility on the other replicas (ms):", [s["visibility_ms"] for s in stopped])
    assert len(cross) >= 15, summary
    assert len(j.found) / len(j.targets) >= MIN_RECALL, summary
    assert len(cross_found) / len(cross) >= MIN_CROSS_RECALL, summary
    assert len(cross_right) / len(cross_found) >= MIN_RIGHT_SOURCE, summary
    assert len(j.clean_flagged) / j.clean <= MAX_FALSE_POSITIVES, summary
    # Findings are logged once, by the replica that served the victim.
    detected = [e["request_id"] for e in events if e["event"] == "leak.detected"]
    assert all(replica_of[rid] == i for i, r in enumerate(reps) for rid in
               [e["request_id"] for e in r.events("leak.detected")])  # fmt: skip
    assert detected
    # Every record of the two other replicas reached each replica (a prompt and an
    # output record per exchange).
    for i, s in enumerate(stopped):
        others = sum(1 for rid, r in replica_of.items() if r != i)
        assert s["index_ingested"] == 2 * others, stopped
        assert s["index_dropped"] == 0 and s["outbox"] == 0


def test_cache_domains_keep_each_replica_to_its_domain(tmp_path, warm_state, redis_server_bin):
    """Two engines that share no cache (two simulators: each mixes only its own
    requests), two replicas in front of each, ``[index.domains]`` naming which upstream
    is in which domain. Each replica publishes to and ingests only its own domain's
    stream: exactly the records of the other replica of its domain, none of the other
    domain's; and the leaks inside each domain, across its two replicas, are still found
    with their sources."""
    with (
        redis_server(redis_server_bin, tmp_path) as server,
        run_sim(tmp_path, *SIM_ARGS) as sim_a,
        run_sim(tmp_path, *SIM_ARGS[:-1], "12") as sim_b,
    ):
        domains = f'[index.domains]\na = ["{sim_a.url}"]\nb = ["{sim_b.url}/"]\n'
        sims = {"a": sim_a, "b": sim_b}
        configs = {
            (d, i): replica_config(tmp_path, f"{d}{i}", warm_state, server.url, domains)
            for d in "ab"
            for i in range(2)
        }
        with ThreadPoolExecutor(4) as pool:
            reps = dict(
                zip(configs, pool.map(lambda k: start_replica(configs[k], sims[k[0]].url), configs),
                    strict=True)
            )  # fmt: skip
        try:
            # One workload, its tenants split between the domains (unique request ids).
            requests = list(Workload(tenants=16, seed=23).requests(800))
            share = {d: [r for r in requests if (int(r.tenant[-2:]) % 2 == 0) == (d == "a")]
                     for d in "ab"}  # fmt: skip
            with ThreadPoolExecutor(2) as pool:
                sent = dict(zip("ab", pool.map(
                    lambda d: round_robin([reps[d, 0].url, reps[d, 1].url], share[d], 8), "ab"),
                    strict=True))  # fmt: skip
            judged = {}
            for d in "ab":
                mine = [reps[d, 0], reps[d, 1]]
                events = exchanges_logged(mine, sent[d])
                assert all(r.error is None for r in sent[d])
                judged[d] = judge(sent[d], load_truth(sims[d].truth), events, sims[d].answer)
        finally:
            for rep in reps.values():
                stop(rep.proc)
        stopped = {k: rep.events("index.stopped")[0] for k, rep in reps.items()}
        keys = sorted(k.decode() for k in server.client().keys("crosstalk:*"))
    assert keys == ["crosstalk:records:a", "crosstalk:records:b"]
    for (d, i), s in stopped.items():
        other = len(share[d][1 - i :: 2])  # round robin: the other replica's requests
        assert s["stream"] == f"crosstalk:records:{d}" and s["domain"] == d
        # Exactly the other replica of its domain: nothing of the other domain (whose
        # records are in the other stream; test_an_entry_of_another_domain_is_counted_
        # not_ingested puts both in one stream, where the domain field must decide).
        assert s["index_ingested"] == 2 * other, (d, i, s)
    # Recall across the replicas of a domain, pooled over the two domains (~40 targets:
    # the floors of the three-replica test, which has as many, apply).
    cross, found, right = [], [], []
    for d, j in judged.items():
        replica_of = {req.request_id: i % 2 for i, req in enumerate(share[d])}
        mine = [
            t
            for t in j.targets
            if replica_of[t["request_id"]] != replica_of.get(t["source_request_id"])
        ]
        cross += mine
        found += [t for t in j.found if t in mine]
        right += [t for t in j.right_source if t in mine]
        print(
            f"domain {d}: targets={len(j.targets)} found={len(j.found)} cross={len(mine)} "
            f"found={len([t for t in j.found if t in mine])} flagged={len(j.clean_flagged)}"
        )
        assert len(mine) >= 8
        assert len(j.clean_flagged) / j.clean <= MAX_FALSE_POSITIVES, d
    summary = f"cross-replica targets={len(cross)} found={len(found)} right={len(right)}"
    assert len(found) / len(cross) >= MIN_CROSS_RECALL, summary
    assert len(right) / len(found) >= MIN_RIGHT_SOURCE, summary


def test_an_entry_of_another_domain_is_counted_not_ingested():
    """Two domains given one stream by hand: a replica uses only its own domain's
    entries (and an entry without a domain field is the default domain's)."""
    cfg = load(None, detection__key=TEST_KEY)
    origin, receiver = build_engine(cfg), build_engine(cfg)
    scan = origin.observe_prompt("alpha", "source-1", SECRET)
    entry = {b"o": b"elsewhere", b"k": origin.hasher.key_id.encode(),
             b"r": zlib.compress(pack(scan.prompt)), b"t": b"0"}  # fmt: skip
    counters: dict[str, int] = collections.Counter()
    ingester = Ingester(receiver, "here", make_logger(None), counters, domain="a")
    ingester.ingest(b"1-0", {**entry, b"d": b"b"})
    ingester.ingest(b"2-0", entry)  # the default domain's
    assert counters["index_other_domain"] == 2 and counters["index_ingested"] == 0
    ingester.ingest(b"3-0", {**entry, b"d": b"a"})
    assert counters["index_ingested"] == 1
    victim = receiver.observe_prompt("beta", "victim-1", "Any news?")
    assert {f.source_tenant for f in victim.feed(f"Yes: {SECRET}") + victim.finish()} == {"alpha"}


def test_an_entry_that_inflates_past_the_limit_is_corrupt(monkeypatch):
    """A compressed entry is inflated up to ``MAX_RECORD_BYTES``, no further (a zip bomb
    in the stream costs nothing but a count)."""
    monkeypatch.setattr("proxy.store.redis_index.MAX_RECORD_BYTES", 4096)
    receiver = build_engine(load(None, detection__key=TEST_KEY))
    counters: dict[str, int] = collections.Counter()
    ingester = Ingester(receiver, "here", make_logger(None), counters)
    key = receiver.hasher.key_id.encode()
    bomb = {b"o": b"x", b"k": key, b"r": zlib.compress(bytes(1 << 20)), b"t": b"0"}
    ingester.ingest(b"1-0", bomb)
    assert counters["index_corrupt"] == 1 and counters["index_ingested"] == 0
    # Just past the cap, all of it read at once (no input left over to tell), and a
    # stream cut short: corrupt too, not a record cut at the cap.
    past = zlib.compress(bytes(4096 + 1000))
    ingester.ingest(b"1-1", {**bomb, b"r": past})
    ingester.ingest(b"1-2", {**bomb, b"r": zlib.compress(bytes(2000))[:-6]})
    assert counters["index_corrupt"] == 3 and counters["index_ingested"] == 0
    prompt = receiver.observe_prompt("alpha", "source-1", SECRET).prompt
    fits = {**bomb, b"r": zlib.compress(pack(prompt))}
    assert len(zlib.decompress(fits[b"r"])) < 4096
    ingester.ingest(b"2-0", fits)
    assert counters["index_ingested"] == 1


def test_an_older_replica_s_compressed_line_is_still_ingested():
    """Replicas before packed records sent a (zlib-compressed) journal line, and an
    output's every feed: a fleet upgraded one replica at a time still shares them."""
    cfg = load(None, detection__key=TEST_KEY)
    origin, receiver = build_engine(cfg), build_engine(cfg)
    scan = origin.observe_prompt("alpha", "source-1", SECRET)
    answer = "Noted: the wire of 48,310 EUR goes out on Friday via Helmsworth Bank."
    for delta in answer.split(" "):
        scan.feed(delta + " ")
    scan.finish()
    assert len(scan.record().choices[0].batches) > 1
    counters: dict[str, int] = collections.Counter()
    ingester = Ingester(receiver, "here", make_logger(None), counters)
    indexed = []
    for i, record in enumerate((scan.prompt, unjudged(scan.record()))):
        old = {b"o": b"old", b"k": origin.hasher.key_id.encode(),
               b"r": zlib.compress(encode(record), 1), b"t": b"0"}  # fmt: skip
        ingester.ingest(b"%d-0" % (i + 1), old)
        indexed.append(receiver.fingerprints)
    assert counters["index_ingested"] == 2 and counters["index_corrupt"] == 0
    assert 0 < indexed[0] < indexed[1] == origin.fingerprints  # the output's too
    victim = receiver.observe_prompt("beta", "victim-1", "Any news?")
    assert {f.source_tenant for f in victim.feed(f"Yes: {SECRET}") + victim.finish()} == {"alpha"}


def test_a_replica_s_domain_comes_from_its_upstream():
    section = load(
        None, index__domains={"a": ["http://10.0.0.1:8000"], "b": ["https://pool.example"]}
    ).index
    assert domain_of(section, ["http://10.0.0.1:8000/"]) == "a"
    assert domain_of(section, ["https://POOL.example:443"]) == "b"
    assert domain_of(section, ["http://10.0.0.9:8000"]) == ""  # no domain: the default one
    with pytest.raises(ValueError, match="2 cache domains"):
        domain_of(section, ["http://10.0.0.1:8000", "https://pool.example"])
    named = load(None, index__domain="c", index__domains={"a": ["http://10.0.0.1:8000"]}).index
    assert domain_of(named, ["http://10.0.0.1:8000"]) == "c"
    with pytest.raises(ConfigError, match="is in 'a' and 'b'"):
        load(None, index__domains={"a": ["http://x:1"], "b": ["http://X:1/"]})
    with pytest.raises(ConfigError, match="names a Redis stream"):
        load(None, index__domains={"a b": []})


def stream_memory(client: redis.Redis) -> dict[str, int]:
    """Bytes the stream takes in Redis, and the unit hashes its records carry."""
    units = entries = 0
    for _, fields in client.xrange("crosstalk:records"):
        entries += 1
        record = unpack(zlib.decompress(fields[b"r"]))
        if isinstance(record, PromptRecord):
            units += len(record.units)
        elif isinstance(record, OutputRecord):
            units += sum(len(c.units) for c in record.choices)
    used = client.memory_usage("crosstalk:records", samples=0)
    return {"bytes": used, "units": units, "entries": entries}


def test_index_needs_a_fixed_key(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "proxy", "run", "--index", "redis://127.0.0.1:1/0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "index.url needs a fixed detection.key" in result.stderr


# -- faults ----------------------------------------------------------------------------------


def client(url: str, tenant: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=30,
        default_headers={"X-Tenant-ID": tenant, **headers},
    )  # fmt: skip


def source_prompt(n: int) -> str:
    """A private prompt with entities only this tenant has (forced 'entities' faults
    draw from prompts with entities: only these)."""
    tag = secrets.token_hex(3)
    account = 10_000_000 + secrets.randbelow(80_000_000)
    return (
        f"Please move the billing contact of account ZX-{account} to "
        f"morgan.{tag}.{n}@halden-logistics.eu before the next invoice run."
    )


def ask(url: str, tenant: str, text: str, **headers: str) -> str:
    answer = client(url, tenant, **headers).chat.completions.create(
        model="sim-llm-1", messages=[{"role": "user", "content": text}]
    )
    return answer.id


class Background:
    """Entity-free traffic from 8 tenants, round-robin over the given replicas, until
    stopped (bounded by ``limit`` requests): the load that Redis fails under."""

    def __init__(self, urls: list[str], limit: int = 3000) -> None:
        self.urls = urls
        self.limit = limit
        self.results: list[tuple[str, str, bytes | None, str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,)) for w in range(4)]

    def __enter__(self) -> Background:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set() and len(self.results) < self.limit:
            url = self.urls[i % len(self.urls)]
            rid = f"bg-{worker}-{i}-{secrets.token_hex(4)}"
            tenant = f"bg-tenant-{i % 8}"
            try:
                c = client(url, tenant, **{"X-Request-ID": rid})
                raw = c.chat.completions.with_raw_response.create(
                    model="sim-llm-1",
                    messages=[{"role": "user", "content": f"Tell me about topic {i} please"}],
                )
                self.results.append((rid, url, raw.http_response.content, None))
            except Exception as e:  # noqa: BLE001 -- what a client would see
                self.results.append((rid, url, None, f"{type(e).__name__}: {e}"))
            i += 4


def leaks_of(rep: Replica, request_id: str, timeout: float = 10.0) -> list[dict]:
    events = wait_for_events(
        rep.log,
        lambda ev: any(e["event"] == "exchange" and e["request_id"] == request_id for e in ev),
        timeout,
    )
    return [e for e in events if e["event"] == "leak.detected" and e["request_id"] == request_id]


def forced_leak(sim, rep: Replica, tenant: str) -> tuple[str, list[dict], dict]:
    """A request whose answer the simulator corrupts with another tenant's entities;
    returns its id, what ``rep`` logged, and the simulator's truth line."""
    rid = f"victim-{secrets.token_hex(6)}"
    ask(rep.url, tenant, "Could you summarise what you can do for me today?",
        **{"X-Request-ID": rid, "x-sim-fault": "entities"})  # fmt: skip
    truth = {t["request_id"]: t for t in load_truth(sim.truth)}[rid]
    return rid, leaks_of(rep, rid), truth


def wait_logged(reps: list[Replica], name: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.events(name) for r in reps):
        assert time.monotonic() < deadline, f"not every replica logged {name}"
        time.sleep(0.05)


def test_redis_outage_and_replica_restart(tmp_path, warm_state, redis_server_bin):
    with (
        redis_server(redis_server_bin, tmp_path) as server,
        run_sim(tmp_path, "--token-delay", "0.001", "--seed", "5") as sim,
        replicas(tmp_path, 3, sim.url, warm_state, server.url, flag=True) as reps,
    ):
        r0, r1, r2 = reps
        urls = [r.url for r in reps]
        with Background(urls) as bg:
            time.sleep(1.0)
            server.stop()  # mid-run: requests are in flight on every replica
            before = len(bg.results)
            wait_logged(reps, "index.degraded")
            # Served during the outage: counted, not timed (a busy machine serves fewer
            # a second; the bound only keeps a stuck proxy from hanging the test).
            deadline = time.monotonic() + 120
            while len(bg.results) - before <= 20 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert len(bg.results) - before > 20  # served during the outage
        # No client saw anything of the outage: every answer is what the simulator sent.
        for rid_bg, _, body, error in bg.results:
            assert error is None, (rid_bg, error)
            assert body == sim.sent(rid_bg), rid_bg
        # Local detection goes on: a source and its victim on the same replica. (The
        # background stopped: a forced leak draws from the 32 latest exchanges, and only
        # the sources' prompts have entities.)
        src2 = f"src2-{secrets.token_hex(4)}"
        ask(r0.url, "source-two", source_prompt(2), **{"X-Request-ID": src2})
        rid, leaks, truth = forced_leak(sim, r0, "victim-two")
        assert truth["source_request_id"] == src2  # the only candidate with entities
        assert {(e["source_tenant"], e["kind"]) for e in leaks} == {("source-two", "entity")}
        server.start()  # same port, empty
        wait_logged(reps, "index.recovered")
        time.sleep(0.5)

        # Catch-up: the source seen by r0 during the outage reached r1 once Redis was back.
        rid, leaks, truth = forced_leak(sim, r1, "victim-three")
        assert truth["source_request_id"] == src2
        assert {(e["source_tenant"], e["kind"]) for e in leaks} == {("source-two", "entity")}
        # Cross-replica detection resumes for what is observed now.
        src4 = f"src4-{secrets.token_hex(4)}"
        ask(r2.url, "source-four", source_prompt(4), **{"X-Request-ID": src4})
        time.sleep(0.3)
        rid, leaks, truth = forced_leak(sim, r0, "victim-four")
        assert truth["source_request_id"] in (src2, src4)
        source = {src2: "source-two", src4: "source-four"}[truth["source_request_id"]]
        assert {(e["source_tenant"], e["kind"]) for e in leaks} == {(source, "entity")}

        # Restart r1: the new process loads the window before it listens.
        stop(r1.proc)
        stopped_r1 = r1.events("index.stopped")[0]
        r1b = start_replica(r1.config, sim.url, port=r1.port, index=r1.index)
        reps[1] = r1b
        ready = r1b.events("index.ready")[0]
        assert ready["complete"] and ready["origins"] == 3, ready
        assert ready["entries"] == server.client().xlen("crosstalk:records")
        for tenant in ("victim-five", "victim-six"):
            rid, leaks, truth = forced_leak(sim, r1b, tenant)
            source = {src2: "source-two", src4: "source-four"}[truth["source_request_id"]]
            assert {(e["source_tenant"], e["kind"]) for e in leaks} == {(source, "entity")}
        for r in reps:
            stop(r.proc)
        stopped = [r.events("index.stopped")[0] for r in (r0, r2)] + [stopped_r1]
    print("outage:", stopped)
    for s in stopped:
        # The outage is seen (a reconnect into a Redis still starting can count a second
        # degradation: CI saw 2 once) and nothing is dropped.
        assert s["index_degraded"] >= 1 and s["index_dropped"] == 0, s
        assert s["outbox"] == 0, s


def streamed(url: str, tenant: str, rid: str) -> tuple[str, str]:
    """A streamed answer the simulator corrupts with another tenant's entities: the text
    the client received, and the error that ended it ("code: message"; "" when none)."""
    c = client(url, tenant, **{"X-Request-ID": rid, "x-sim-fault": "entities"})
    text: list[str] = []
    try:
        for chunk in c.chat.completions.create(
            model="sim-llm-1",
            messages=[{"role": "user", "content": "Could you summarise what you can do for me?"}],
            stream=True,
        ):
            text += [choice.delta.content or "" for choice in chunk.choices]
    except openai.APIError as e:
        return "".join(text), f"{e.code}: {e}"
    return "".join(text), ""


def test_enforce_cuts_another_replicas_entities_before_the_client_sees_them(
    tmp_path, warm_state, redis_server_bin
):
    """The source's prompt went through r0; r1 knows its entities by id only (Redis
    carries no text). Enforce on r1 still cuts the stream before the other tenant's
    account number and address reach the client: they were matched only at the
    stream's end, after the holdback had released them."""
    with (
        redis_server(redis_server_bin, tmp_path) as server,
        run_sim(tmp_path, "--token-delay", "0.002", "--seed", "9") as sim,
    ):
        configs = [replica_config(tmp_path, f"r{i}", warm_state, server.url) for i in range(2)]
        for cfg in configs:
            cfg.write_text(cfg.read_text() + '[proxy]\nmode = "enforce"\n')
        r0, r1 = (start_replica(cfg, sim.url) for cfg in configs)
        try:
            sources: dict[str, str] = {}  # the only prompts with entities
            for n in range(3):
                src = f"src-{n}-{secrets.token_hex(4)}"
                sources[src] = f"source-{n}"
                ask(r0.url, sources[src], source_prompt(n), **{"X-Request-ID": src})
                time.sleep(0.5)  # r1 reads the record (visibility p99 ~13 ms)
                rid = f"victim-{n}-{secrets.token_hex(4)}"
                text, error = streamed(r1.url, f"victim-{n}", rid)
                truth = {t["request_id"]: t for t in load_truth(sim.truth)}[rid]
                assert "cross_tenant_leak" in error, (text[-200:], error)
                for entity in truth["entities"]:
                    assert entity.lower() not in text.lower(), (rid, entity, text[-200:])
                leaks = leaks_of(r1, rid)
                assert {(e["source_tenant"], e["kind"]) for e in leaks} == {
                    (sources[truth["source_request_id"]], "entity")
                }
        finally:
            stop(r0.proc)
            stop(r1.proc)
