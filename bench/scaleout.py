"""Scale-out benchmark (issue 8): replicas sharing one view of every tenant through Redis.

Everything runs on 127.0.0.1 against one real ``redis-server`` that this script starts
on a free port (``--save "" --appendonly no``, its own directory). Every child process
gets SIGTERM if the benchmark dies (``PR_SET_PDEATHSIG``) and is stopped (SIGTERM, then
SIGKILL after 5 s) on the way out; every wait is bounded. Three measurements, one run:

1. *Visibility: publication on one replica -> visible on another.* Two worker
   processes (this script with ``--worker``), each an engine and its ``SharedIndex``
   exactly as the addon builds them (``proxy.factory.build_engine``,
   ``proxy.store.redis_index``; the learned state of step 0 loaded), each on its own asyncio
   loop, on one stream. A first scans ``sum(rate x --level-seconds)`` exchanges of the
   simulator's workload with its engine, untimed (prompt observed; answer fed in 1-3
   word deltas, some cut mid-word; finished), while the processes of step 3 start, and
   waits until they are all ready and idle, so that neither its scanning nor their
   start competes with the measurement for the cores. Then, for each rate of
   ``--rates`` (exchanges per second) for ``--level-seconds``, it hands each exchange's
   prompt record and output record to ``SharedIndex.publish`` at the paced instant, as
   a replica does when a prompt arrives and when its response ends (here back to
   back). That call is the publication: ``Publisher.offer`` stamps the record with the
   time (the stream entry's ``t`` field). B only ingests. A wrapper around B's
   ``Ingester.ingest`` (the Consumer calls it for every entry it reads) notes when the
   ingestion of each entry began and ended, and its CPU time (``thread_time``). When it
   ends, B's engine holds the record's fingerprints (``ingest_prompt`` /
   ``ingest_output`` have returned), so any scan on B from then on finds them
   (tests/test_scaleout.py checks that with a leak). Visibility = end of B's ingestion
   - A's publication, both ``time.time()`` on one host (one clock). Reported per rate:
   p50, p99, max (prompt and output records together, then each kind's p99); B's
   ingestion time per record, wall and CPU; the part spent reaching Redis (entry id,
   Redis's millisecond clock, minus publication: 1 ms resolution); the CPU used by A, B
   and Redis, and the machine's busy time, with the part of it spent by processes this
   benchmark did not start ("others"). ``SharedIndex``'s own ``visibility_ms`` (same
   definition, all rates together) is printed alongside. Target: p99 <= 50 ms, gated
   at the rates up to ``--gate-rate`` (default 100 exchanges/s, more than one replica
   serves on a 2-core machine); the higher rates show where one replica's ingestion
   saturates, reported only.
2. *Redis memory per stored fingerprint.* After the run, for each stream: ``MEMORY
   USAGE key SAMPLES 0`` (every node counted), divided by the exchanges it holds
   (prompt records), by its entries, and by the *unit hashes* its records carry (every
   entry decompressed and decoded). The engine fingerprints 4-unit k-grams and keeps
   every k-gram, so each unit hash starts one fingerprint: bytes
   per unit hash = bytes per fingerprint carried. Also: bytes per index entry that the
   receiving engine B made from the pair's stream (``engine.fingerprints`` after
   ingesting; the private fingerprints only, so fewer), and ``INFO memory``
   ``used_memory`` before and after.
3. *Throughput with 1 and 3 replicas.* One simulator (``python -m proxy sim``,
   ``--token-delay`` default 0: it answers as fast as it can, so the proxies, not the
   simulated generation, are the bound) and five ``crosstalk run`` processes, all
   started at once, each with its own copy of the learned state: a group of one
   replica without an index (the single-process baseline), a group of one replica with
   ``[index] url`` (stream ``bench:one``), and a group of three replicas with the index
   (stream ``bench:three``). Each group has its own stream, so nobody ingests another
   group's records; an idle replica only waits in ``XREAD BLOCK``. The client is this
   process: ``--concurrency`` aiohttp workers (default 16) share one list of requests
   of ``proxy.sim.workload.Workload`` (24 tenants; chat and completions, 60% streamed,
   tenant and request id headers, full-length answers, no injected leaks); request i of
   the list goes to replica ``i mod n`` of the group (the load balancer's round robin).
   Closed loop: requests/s = answered requests / wall time, what the group carries on
   this machine. Every answer must be HTTP 200 and complete (a stream ends with
   ``data: [DONE]``). Noise control as bench/passthrough.py: an unmeasured warm-up
   round, then ``--rounds`` rounds of ``--requests`` (consecutive slices of one
   workload, so that every tenant keeps its own private text), each round giving every
   group the same slice, in a shuffled group order; reported values are medians over
   rounds, ratios are per round, then medianed. Per round the CPU seconds of every
   process (``/proc/PID/stat``), of this client (``getrusage``) and of the whole
   machine (``/proc/stat``) are read, so the table says where the cores went: on 2
   cores the three replicas, the simulator, Redis, the client (and whatever else runs
   on the machine) compete, and the 3-replica figure is what this hardware allows, not
   what three machines would carry. CPU milliseconds per request are the figures that
   carry over to other hardware. At the end the replicas are stopped (SIGTERM); their
   ``index.stopped`` events give the visibility the replicas measured themselves while
   saturated, and their costs per record; their ``leak.detected`` events are compared
   (the same traffic went to every group: the same findings are expected).

Step 0 (untimed): the learned state every engine starts from, as a proxy that has run
for a while has it (1,500 earlier requests of the workload, another seed; the hashing
key is random per run and shared by every process). ``--wait-quiet S``: before
starting, wait up to S seconds for the machine to be mostly idle (other people's jobs).

    python bench/scaleout.py [--quick] [--rounds 5] [--requests 300] [--concurrency 16]
                             [--rates 20,100,300,1000] [--level-seconds 5]
                             [--gate-rate 100] [--wait-quiet 600]
                             [--json out.json] [--keep-logs DIR]

``--quick`` (~1 min): 1 s per rate, 2 rounds of 150 requests. Exit status: 0 when no
request failed, every record reached B and visibility p99 <= 50 ms at every gated
rate; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import orjson  # noqa: E402
import redis  # noqa: E402
from common import (  # noqa: E402
    die_with_parent,
    fmt,
    free_port,
    median_of,
    percentile,
    stop_on_sigterm,
    stop_processes,
    wait_listening,
)

from proxy.config import load  # noqa: E402
from proxy.engine.records import OutputRecord, PromptRecord  # noqa: E402
from proxy.eventlog import make_logger  # noqa: E402
from proxy.factory import build_engine  # noqa: E402
from proxy.sim.answers import answer_for  # noqa: E402
from proxy.sim.workload import SimRequest, Workload  # noqa: E402
from proxy.store.codec import unpack  # noqa: E402
from proxy.store.redis_index import OFFERED, RECORD, SharedIndex, settings_from  # noqa: E402

HOST = "127.0.0.1"
TARGET_P99_MS = 50.0
TENANTS = 24
PAIR_STREAM = "bench:pair"
GROUPS = (  # name, replicas, stream (None: no index), a cache domain per replica
    ("1 replica, no index", 1, None, False),
    ("1 replica + Redis", 1, "bench:one", False),
    ("2 replicas + Redis", 2, "bench:two", False),
    ("3 replicas + Redis", 3, "bench:three", False),
    ("2 replicas, 2 domains", 2, "bench:domains", True),
)
ONE, TWO, THREE, DOMAINS = GROUPS[1][0], GROUPS[2][0], GROUPS[3][0], GROUPS[4][0]
WARM_REQUESTS = 1500  # step 0
READY_TIMEOUT = 90.0  # seconds for every process to answer (engines load in parallel)
REQUEST_TIMEOUT = 120.0
STOP_TIMEOUT = 5.0
INTERNAL_ARGS = {"key", "json", "keep_logs", "worker", "redis", "stream", "state", "out", "plan",
                 "expected", "timeout", "watch", "state_path"}  # fmt: skip
LEVEL_PAUSE = 1.0  # seconds between two rates of the pair
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- processes ----------------------------------------------------------------------------


@dataclass
class Server:
    """A process this benchmark started, and where its output goes."""

    name: str
    proc: subprocess.Popen
    out: Path
    port: int | None = None
    log: Path | None = None  # crosstalk's JSON event log

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.out.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        """utime + stime so far of the process and its children (/proc): a replica's
        detector process is where its engine, and so its ingestion, runs in shadow mode
        (before 2026-12-06 only the proxy process was counted). 0 once it is gone."""
        return sum(pid_cpu(pid) for pid in process_tree(self.proc.pid))

    def events(self, name: str) -> list[dict]:
        if self.log is None or not self.log.exists():
            return []
        lines = self.log.read_bytes().splitlines()
        return [e for e in map(orjson.loads, filter(bytes.strip, lines)) if e["event"] == name]


def start(name: str, argv: list[str], workdir: Path, **kw: Any) -> Server:
    out = workdir / f"{name}.out"
    with out.open("wb") as f:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdin=kw.pop("stdin", subprocess.DEVNULL),
            stdout=kw.pop("stdout", f),
            stderr=f,
            preexec_fn=die_with_parent,
        )
    return Server(name, proc, out, **kw)


def stop_all(servers: Sequence[Server]) -> None:
    """SIGTERM every process still running, SIGKILL what is left after a grace time."""
    stop_processes([s.proc for s in servers], STOP_TIMEOUT)


def wait_port(server: Server, timeout: float = READY_TIMEOUT) -> None:
    try:
        wait_listening(server.port, server.proc, server.name, timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{server.tail()}") from None


def start_redis(workdir: Path, servers: list[Server]) -> tuple[Server, redis.Redis]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/ensure-redis.sh installs it)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]  # fmt: skip
    server = start("redis", argv, workdir, port=port)
    servers.append(server)
    wait_port(server, 10)
    client = redis.Redis(host=HOST, port=port, socket_timeout=10)
    deadline = time.monotonic() + 10
    while True:  # listening is not yet loaded: wait for PING
        with contextlib.suppress(redis.RedisError):
            if client.ping():
                return server, client
        if time.monotonic() > deadline:
            raise RuntimeError("redis-server does not answer PING")
        time.sleep(0.05)


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far, from /proc/stat."""
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def wait_quiet(limit: float, busy_max: float = 25.0) -> float:
    """Wait (at most ``limit`` seconds) until the machine was less than ``busy_max`` %
    busy over 2 s; returns the last busy % seen."""
    deadline = time.monotonic() + limit
    while True:
        b0, t0 = machine_jiffies()
        time.sleep(2.0)
        b1, t1 = machine_jiffies()
        busy = 100 * (b1 - b0) / max(1, t1 - t0)
        if busy < busy_max or time.monotonic() > deadline:
            return busy
        print(f"machine {busy:.0f}% busy: waiting for it to calm down", flush=True)
        time.sleep(8.0)


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now living (/proc/PID/task/TID/children)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(child) for child in task.read_text().split())
    return found


def pid_cpu(pid: int) -> float:
    """utime + stime of process ``pid`` so far (/proc); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


# --- statistics ---------------------------------------------------------------------------


# --- step 0: the learned state --------------------------------------------------------------


def warm_state(key: str, path: Path) -> float:
    """Commonness learned from earlier traffic (tests/conftest.py ``learn_commonness``, with
    this run's key). Returns the seconds it took."""
    started = time.perf_counter()
    engine = build_engine(load(None, detection__key=key))
    for i, req in enumerate(Workload(tenants=TENANTS, seed=4242).requests(WARM_REQUESTS)):
        prompt = req.prompt_text()
        scan = engine.observe_prompt(req.tenant, req.request_id, prompt, now=1000.0 + i)
        scan.feed(answer_for(prompt))
        scan.finish()
    engine.save_commonness(path)
    return time.perf_counter() - started


# --- step 1: the pair (worker processes) -----------------------------------------------------


def make_replica(args: argparse.Namespace, name: str) -> tuple[Any, SharedIndex, dict[str, int]]:
    """An engine and its SharedIndex, as the addon makes them (learned state loaded)."""
    cfg = load(
        None,
        detection__key=args.key,
        index__url=args.redis,
        index__stream=args.stream,
        index__replica_name=name,
        **({} if args.batch_ms is None else {"index__batch_ms": args.batch_ms}),
    )
    engine = build_engine(cfg)
    engine.load_commonness(args.state)
    counters: dict[str, int] = {}
    log = make_logger(Path(args.out).with_suffix(".jsonl"))
    return engine, SharedIndex(settings_from(cfg), engine, log, counters), counters


def deltas(text: str, rng: random.Random) -> list[str]:
    """1-3 words at a time, now and then cut mid-word, as the simulator streams."""
    words, out, i = text.split(" "), [], 0
    while i < len(words):
        n = rng.randint(1, 3)
        piece = " ".join(words[i : i + n]) + (" " if i + n < len(words) else "")
        if len(piece) > 6 and rng.random() < 0.2:
            cut = rng.randint(1, len(piece) - 1)
            out += [piece[:cut], piece[cut:]]
        else:
            out.append(piece)
        i += n
    return out


def prescan(engine: Any, n: int, seed: int) -> list[tuple[PromptRecord, OutputRecord]]:
    """``n`` exchanges of the workload through ``engine``: their (prompt, output) records."""
    rng = random.Random(seed)
    records = []
    for req in Workload(tenants=TENANTS, seed=seed).requests(n):
        prompt = req.prompt_text()
        scan = engine.observe_prompt(req.tenant, f"pair-{req.request_id}", prompt)
        for delta in deltas(answer_for(prompt), rng):
            scan.feed(delta)
        scan.finish()
        records.append((scan.prompt, scan.record()))
    return records


def record_kind(fields: dict[bytes, bytes]) -> str:
    """'prompt', 'output' or 'canary': the start of the entry's packed record."""
    with contextlib.suppress(KeyError, zlib.error):
        head = zlib.decompressobj().decompress(fields[RECORD], 24)
        for kind in ("prompt", "output", "canary"):
            if f'"t":"{kind}"'.encode() in head:
                return kind
    return "?"


async def worker_consume(args: argparse.Namespace) -> dict:
    """B: ingest until ``--expected`` entries were read (bounded), timing each one."""
    engine, index, counters = make_replica(args, "pair-b")
    # (published, Redis ms, ingestion began, ended, CPU seconds of the ingestion, kind)
    samples: list[tuple[float, int, float, float, float, str]] = []
    ingest = index.ingester.ingest

    def timed(entry_id: bytes, fields: dict[bytes, bytes]) -> bool:
        began, cpu = time.time(), time.thread_time()
        foreign = ingest(entry_id, fields)
        cpu, done = time.thread_time() - cpu, time.time()
        with contextlib.suppress(KeyError, ValueError):
            offered = float(fields[OFFERED])
            redis_ms = int(entry_id.split(b"-", 1)[0])
            samples.append((offered, redis_ms, began, done, cpu, record_kind(fields)))
        return foreign

    index.ingester.ingest = timed  # the Consumer calls it for every entry it reads
    index.load_window()
    fingerprints0 = engine.fingerprints
    index.start()
    print("ready", flush=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if counters["index_ingested"] + counters["index_skipped"] >= args.expected:
            break
        await asyncio.sleep(0.05)
    fingerprints = engine.fingerprints - fingerprints0
    visibility = index.consumer.visibility_ms()
    ingest_us = index.ingester.seconds * 1e6 / max(1, counters["index_ingested"])
    index.close()
    await asyncio.sleep(0)
    return {
        "samples": samples,
        "counters": counters,
        "fingerprints": fingerprints,
        "own_visibility_ms": visibility,
        "ingest_us": ingest_us,
    }


async def worker_publish(args: argparse.Namespace) -> dict:
    """A: scan the exchanges, wait for "go" on stdin, publish them at each paced rate.
    At each rate's start and end, reads the CPU time of the machine, of A, and of the
    ``--watch`` processes (B, Redis)."""
    engine, index, counters = make_replica(args, "pair-a")
    plan = json.loads(args.plan)  # [[rate, exchanges], ...]
    watch = [int(p) for p in args.watch.split(",")]
    total = sum(n for _, n in plan)
    t = time.perf_counter()
    records = prescan(engine, total, args.seed)
    scan_s = time.perf_counter() - t
    print(f"pair: A scanned {total} exchanges in {scan_s:.1f} s", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the parent's "go": the machine is quiet
    index.load_window()
    index.start()

    def cpu() -> tuple[tuple[int, int], float, list[float]]:
        return machine_jiffies(), self_cpu(), [pid_cpu(p) for p in watch]

    levels, it = [], iter(records)
    for rate, n in plan:
        await asyncio.sleep(LEVEL_PAUSE)  # the previous rate's last records are ingested
        start_wall, t0, cpu0 = time.time(), time.perf_counter(), cpu()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt, output = next(it)
            index.publish(prompt)
            index.publish(output)
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # B is still ingesting the last ones: count its CPU too
        cpu1, window = cpu(), time.perf_counter() - t0
        (busy0, all0), a0, w0 = cpu0
        (busy1, all1), a1, w1 = cpu1
        levels.append(
            {
                "rate": rate,
                "exchanges": n,
                "start": start_wall,
                "end": start_wall + elapsed,
                "achieved": n / elapsed if elapsed > 0 else float("nan"),
                "machine_busy_pct": 100 * (busy1 - busy0) / max(1, all1 - all0),
                "a_cpu_pct": 100 * (a1 - a0) / window,
                "watched_cpu_pct": [100 * (y - x) / window for x, y in zip(w0, w1, strict=True)],
            }
        )
    deadline = time.monotonic() + 30
    while counters["index_published"] < 2 * total and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    encode_us = index.publisher.encode_seconds * 1e6 / max(1, index.publisher.encoded)
    index.close()
    await asyncio.sleep(0)
    return {"levels": levels, "scan_s": scan_s, "counters": counters, "encode_us": encode_us}


def worker_main(args: argparse.Namespace) -> int:
    run = worker_consume if args.worker == "consume" else worker_publish
    result = asyncio.run(run(args))
    Path(args.out).write_bytes(orjson.dumps(result))
    return 0


@dataclass
class Level:
    """One rate of the pair."""

    rate: float
    exchanges: int
    achieved_rate: float
    records: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    prompt_p99_ms: float
    output_p99_ms: float
    ingest_prompt_us: float  # wall time of B's ingestion, mean
    ingest_output_us: float
    ingest_prompt_cpu_us: float  # CPU time of the same (thread_time), mean
    ingest_output_cpu_us: float
    to_redis_p50_ms: float
    to_redis_p99_ms: float
    b_cpu_pct: float  # of one core, during the rate (+0.2 s)
    a_cpu_pct: float
    redis_cpu_pct: float
    machine_busy_pct: float  # of all CPUs, every process of the machine
    others_pct: float  # of all CPUs: the machine's busy time not spent by A, B or Redis
    gated: bool
    passed: bool


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


class PairWorkers:
    """A and B of the pair: B started and listening, A scanning (``start``); ``run``
    lets A publish (once the caller has started the rest) and collects both results."""

    def __init__(
        self, args: argparse.Namespace, workdir: Path, redis_server: Server, url: str
    ) -> None:
        self.args = args
        self.plan = [[rate, max(1, round(rate * args.level_seconds))] for rate in args.rates]
        self.total = sum(n for _, n in self.plan)
        self.redis = redis_server
        self.url = url
        self.workdir = workdir
        self.timeout = 60 + 3 * self.total / min(args.rates) + args.level_seconds * len(self.plan)
        self.a: Server | None = None
        self.b: Server | None = None

    def start(self, servers: list[Server]) -> None:
        args, workdir = self.args, self.workdir
        common = [sys.executable, str(Path(__file__).resolve()), "--key", args.key,
                  "--redis", self.url, "--stream", PAIR_STREAM, "--state", str(args.state_path),
                  "--seed", str(args.seed + 500),
                  *(() if args.batch_ms is None else ("--batch-ms", str(args.batch_ms)))]  # fmt: skip
        self.b = b = start(
            "pair-b",
            [*common, "--worker", "consume", "--out", str(workdir / "pair-b.json"),
             "--expected", str(2 * self.total), "--timeout", str(self.timeout)],
            workdir, stdout=subprocess.PIPE,
        )  # fmt: skip
        servers.append(b)
        if b.proc.stdout.readline().strip() != b"ready":  # B reads the stream (or EOF)
            raise RuntimeError(f"pair consumer did not start:\n{b.tail()}")
        self.a = a = start(
            "pair-a",
            [*common, "--worker", "publish", "--out", str(workdir / "pair-a.json"),
             "--plan", json.dumps(self.plan), "--watch", f"{b.proc.pid},{self.redis.proc.pid}"],
            workdir, stdout=subprocess.PIPE, stdin=subprocess.PIPE,
        )  # fmt: skip
        servers.append(a)

    def run(self) -> dict:
        a, b = self.a, self.b
        assert a is not None and b is not None
        line = a.proc.stdout.readline().decode().strip()  # A has scanned (or EOF)
        if not line.startswith("pair: A scanned"):
            raise RuntimeError(f"pair publisher failed:\n{a.tail()}")
        print(line, flush=True)
        a.proc.stdin.write(b"go\n")
        a.proc.stdin.flush()
        for w in (a, b):
            try:
                w.proc.wait(self.timeout)
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"{w.name} did not finish in {self.timeout:.0f} s") from e
            if w.proc.returncode != 0:
                raise RuntimeError(f"{w.name} failed ({w.proc.returncode}):\n{w.tail()}")
        pub = orjson.loads((self.workdir / "pair-a.json").read_bytes())
        con = orjson.loads((self.workdir / "pair-b.json").read_bytes())
        levels = [self.level(lv, con["samples"]) for lv in pub["levels"]]
        return {
            "levels": levels,
            "publisher": {k: v for k, v in pub.items() if k != "levels"},
            "consumer": {k: v for k, v in con.items() if k != "samples"},
            "exchanges": self.total,
        }

    def level(self, lv: dict, samples: list) -> Level:
        # B's samples of this rate: published during it
        mine = [s for s in samples if lv["start"] - 0.001 <= s[0] <= lv["end"] + 0.001]
        vis = [(done - offered) * 1000 for offered, _, _, done, _, _ in mine]
        kinds = {
            kind: [
                ((done - offered) * 1000, (done - began) * 1e6, cpu * 1e6)
                for offered, _, began, done, cpu, k in mine
                if k == kind
            ]
            for kind in ("prompt", "output")
        }
        prompt, output = kinds["prompt"], kinds["output"]
        to_redis = [redis_ms - offered * 1000 for offered, redis_ms, *_ in mine]
        p99 = percentile(vis, 99)
        b_pct, redis_pct = lv["watched_cpu_pct"]
        ours = (lv["a_cpu_pct"] + b_pct + redis_pct) / (os.cpu_count() or 1)
        gated = lv["rate"] <= self.args.gate_rate
        return Level(
            rate=lv["rate"],
            exchanges=lv["exchanges"],
            achieved_rate=lv["achieved"],
            records=len(mine),
            p50_ms=percentile(vis, 50),
            p99_ms=p99,
            max_ms=max(vis, default=float("nan")),
            prompt_p99_ms=percentile([v for v, _, _ in prompt], 99),
            output_p99_ms=percentile([v for v, _, _ in output], 99),
            ingest_prompt_us=mean([u for _, u, _ in prompt]),
            ingest_output_us=mean([u for _, u, _ in output]),
            ingest_prompt_cpu_us=mean([c for _, _, c in prompt]),
            ingest_output_cpu_us=mean([c for _, _, c in output]),
            to_redis_p50_ms=percentile(to_redis, 50),
            to_redis_p99_ms=percentile(to_redis, 99),
            b_cpu_pct=b_pct,
            a_cpu_pct=lv["a_cpu_pct"],
            redis_cpu_pct=redis_pct,
            machine_busy_pct=lv["machine_busy_pct"],
            others_pct=lv["machine_busy_pct"] - ours,
            gated=gated,
            passed=len(mine) == 2 * lv["exchanges"] and (p99 <= TARGET_P99_MS or not gated),
        )


# --- step 3: throughput ----------------------------------------------------------------------


@dataclass
class Group:
    name: str
    replicas: list[Server]
    stream: str | None


def replica_config(
    root: Path,
    key: str,
    state: Path,
    url: str | None,
    stream: str | None,
    domain: str = "",
    batch_ms: float | None = None,
) -> Path:
    root.mkdir(parents=True)
    shutil.copy(state, root / "state.npz")
    cfg = root / "crosstalk.toml"
    text = f'[detection]\nkey = "{key}"\nstate_file = "{root / "state.npz"}"\n'
    if stream is not None:
        text += f'[index]\nurl = "{url}"\nstream = "{stream}"\nreplica_name = "{root.name}"\n'
        text += f'domain = "{domain}"\n' if domain else ""
        text += f"batch_ms = {batch_ms}\n" if batch_ms is not None else ""
    cfg.write_text(text)
    return cfg


def start_groups(
    args: argparse.Namespace, workdir: Path, redis_url: str, sim_url: str, servers: list[Server]
) -> list[Group]:
    groups = []
    for gi, (name, n, stream, domains) in enumerate(GROUPS):
        reps = []
        for r in range(n):
            label = f"g{gi}r{r}"
            domain = f"d{r}" if domains else ""
            cfg = replica_config(
                workdir / label, args.key, args.state_path, redis_url, stream, domain,
                args.batch_ms,
            )  # fmt: skip
            port = free_port()
            log = workdir / label / "events.jsonl"
            argv = [sys.executable, "-m", "proxy", "run", "--upstream", sim_url,
                    "--listen-host", HOST, "--listen-port", str(port), "--config", str(cfg),
                    "--log-file", str(log)]  # fmt: skip
            reps.append(start(label, argv, workdir, port=port, log=log))
        servers.extend(reps)
        groups.append(Group(name, reps, stream))
    return groups


@dataclass(slots=True)
class Outcome:
    nbytes: int = 0
    error: str | None = None


async def one_request(session: aiohttp.ClientSession, url: str, rid: str, req: SimRequest):
    headers = {"Content-Type": "application/json", "X-Tenant-ID": req.tenant,
               "X-Request-ID": rid}  # fmt: skip
    try:
        async with session.post(
            url + req.path(), data=orjson.dumps(req.body()), headers=headers
        ) as r:
            body = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return Outcome(error=f"{type(e).__name__}: {e}")
    if status != 200:
        return Outcome(len(body), f"HTTP {status}: {body[:120]!r}")
    if req.stream:
        if not body.rstrip().endswith(b"data: [DONE]"):
            return Outcome(len(body), "stream ended without data: [DONE]")
    else:
        try:
            if not orjson.loads(body).get("choices"):
                return Outcome(len(body), "no choices")
        except (orjson.JSONDecodeError, AttributeError):
            return Outcome(len(body), f"not JSON: {body[:120]!r}")
    return Outcome(len(body))


async def run_load(
    urls: list[str], jobs: list[tuple[str, SimRequest]], concurrency: int
) -> tuple[list[Outcome], float]:
    """Job i goes to ``urls[i % len(urls)]`` (round robin); (outcomes, wall seconds)."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        outcomes: list[Outcome] = []
        it = iter(enumerate(jobs))

        async def worker() -> None:
            for i, (rid, req) in it:
                outcomes.append(await one_request(session, urls[i % len(urls)], rid, req))

        gc.collect()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return outcomes, time.perf_counter() - t0


async def wait_ready(servers: Sequence[Server]) -> None:
    """``GET /v1/models`` through every replica answers 200 (bounded)."""
    deadline = time.monotonic() + READY_TIMEOUT
    pending = list(servers)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} exited ({s.proc.returncode}):\n{s.tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                    async with session.get(f"{s.url}/v1/models") as resp:
                        await resp.read()
                        if resp.status == 200:
                            pending.remove(s)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT:.0f} s: {pending[0].tail()}")
            await asyncio.sleep(0.1)


@dataclass
class RoundStats:
    group: str
    round: int
    order: int
    requests: int
    failures: int
    wall_s: float
    requests_per_s: float
    cpu_s: dict[str, float]  # replicas (this group), other replicas, sim, redis, client
    machine_busy_pct: float  # of all CPUs, every process on the machine
    others_pct: float  # of all CPUs: busy time of processes this benchmark did not start
    errors: list[str] = field(default_factory=list)


async def throughput(
    args: argparse.Namespace, groups: list[Group], sim: Server, redis_server: Server
) -> list[RoundStats]:
    everyone = [r for g in groups for r in g.replicas]
    await wait_ready(everyone)
    rng = random.Random(args.seed)
    rows = []
    # One workload, cut into rounds: a tenant keeps its own private text all along (with
    # a new seed per round, tenant 7's text of one round would be tenant 14's in the next,
    # which the replicas would rightly report as a leak).
    warm = args.concurrency * 2
    workload = list(
        Workload(tenants=TENANTS, seed=args.seed).requests(warm + args.rounds * args.requests)
    )
    for rnd in range(args.rounds + 1):  # round 0: warm-up, not reported
        lo = 0 if rnd == 0 else warm + (rnd - 1) * args.requests
        reqs = workload[lo : lo + (warm if rnd == 0 else args.requests)]
        jobs = [(req.request_id, req) for req in reqs]
        order = list(groups)
        rng.shuffle(order)
        for pos, g in enumerate(order):
            procs = {s.name: s.cpu_seconds() for s in [*everyone, sim, redis_server]}
            m0, c0 = machine_jiffies(), self_cpu()
            outcomes, wall = await run_load([r.url for r in g.replicas], jobs, args.concurrency)
            m1, c1 = machine_jiffies(), self_cpu()
            for s in [*everyone, sim, redis_server]:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.name} died during the load:\n{s.tail()}")
            used = {s.name: s.cpu_seconds() - procs[s.name] for s in [*everyone, sim, redis_server]}
            mine = {r.name for r in g.replicas}
            cpu = {
                "replicas": sum(v for k, v in used.items() if k in mine),
                "other replicas": sum(
                    v for k, v in used.items() if k.startswith("g") and k not in mine
                ),
                "sim": used[sim.name],
                "redis": used[redis_server.name],
                "client": c1 - c0,
            }
            errors = [o.error for o in outcomes if o.error]
            busy = 100 * (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
            ours = 100 * sum(cpu.values()) / (wall * (os.cpu_count() or 1))
            stats = RoundStats(
                group=g.name,
                round=rnd,
                order=pos,
                requests=len(outcomes),
                failures=len(errors),
                wall_s=wall,
                requests_per_s=(len(outcomes) - len(errors)) / wall,
                cpu_s=cpu,
                machine_busy_pct=busy,
                others_pct=busy - ours,
                errors=errors[:5],
            )
            label = "warm-up" if rnd == 0 else f"round {rnd}/{args.rounds}"
            print(
                f"{label:>11} {g.name:<20} {stats.requests_per_s:6.1f} req/s  wall {wall:5.1f} s  "
                f"replicas {100 * cpu['replicas'] / wall:3.0f}% sim {100 * cpu['sim'] / wall:3.0f}% "
                f"redis {100 * cpu['redis'] / wall:3.0f}% client {100 * cpu['client'] / wall:3.0f}% "
                f"machine {busy:3.0f}% (others {busy - ours:3.0f}%)  fail {stats.failures}",
                flush=True,
            )
            for err in stats.errors:
                print(f"{'':>11} ! {err}", flush=True)
            if rnd > 0:
                rows.append(stats)
    return rows


@dataclass
class GroupSummary:
    group: str
    replicas: int
    rounds: int
    failures: int
    requests_per_s: float | None
    ratio_to_one: float | None  # per round vs "1 replica + Redis", medianed
    ratio_to_no_index: float | None
    replica_cpu_ms_per_req: float | None  # all replicas of the group
    sim_cpu_ms_per_req: float | None
    redis_cpu_ms_per_req: float | None
    client_cpu_ms_per_req: float | None
    replicas_cpu_pct: float | None  # of one core
    machine_busy_pct: float | None
    others_pct: float | None
    ratios_to_one: list[float]


def summarise(groups: list[Group], rows: list[RoundStats]) -> list[GroupSummary]:
    by = {(r.group, r.round): r for r in rows}
    rounds = sorted({r.round for r in rows})
    base_name = GROUPS[0][0]
    out = []
    for g in groups:
        mine = [by[(g.name, n)] for n in rounds]

        def ratio(other: str, mine: list[RoundStats] = mine) -> list[float]:
            return [m.requests_per_s / by[(other, m.round)].requests_per_s for m in mine]

        def per_req(part: str, mine: list[RoundStats] = mine) -> float | None:
            return median_of([1000 * m.cpu_s[part] / m.requests for m in mine])

        to_one = ratio(ONE)
        out.append(
            GroupSummary(
                group=g.name,
                replicas=len(g.replicas),
                rounds=len(mine),
                failures=sum(m.failures for m in mine),
                requests_per_s=median_of([m.requests_per_s for m in mine]),
                ratio_to_one=median_of(to_one),
                ratio_to_no_index=median_of(ratio(base_name)),
                replica_cpu_ms_per_req=per_req("replicas"),
                sim_cpu_ms_per_req=per_req("sim"),
                redis_cpu_ms_per_req=per_req("redis"),
                client_cpu_ms_per_req=per_req("client"),
                replicas_cpu_pct=median_of([100 * m.cpu_s["replicas"] / m.wall_s for m in mine]),
                machine_busy_pct=median_of([m.machine_busy_pct for m in mine]),
                others_pct=median_of([m.others_pct for m in mine]),
                ratios_to_one=to_one,
            )
        )
    return out


def replica_reports(groups: list[Group]) -> list[dict]:
    """What each replica's ``index.stopped`` says (after SIGTERM), and its findings."""
    out = []
    for g in groups:
        for r in g.replicas:
            stopped = r.events("index.stopped")
            leaks = r.events("leak.detected")
            row = {"group": g.name, "replica": r.name, "leaks": len(leaks)}
            row["findings"] = sorted(
                {(e["request_id"], e["source_request_id"], e["kind"]) for e in leaks}
            )
            row["exchanges"] = len(r.events("exchange"))
            if stopped:
                s = stopped[0]
                row.update({k: s.get(k) for k in (
                    "visibility_ms", "encode_us", "ingest_us", "index_published",
                    "index_ingested", "index_skipped", "index_dropped", "index_degraded",
                    "index_errors", "outbox")})  # fmt: skip
            out.append(row)
    return out


# --- step 2: memory --------------------------------------------------------------------------


def stream_memory(client: redis.Redis, stream: str) -> dict[str, float]:
    entries = units = prompts = payload = 0
    last = "-"
    while True:  # XRANGE in pages (bounded by the stream's length)
        page = client.xrange(stream, min=last, max="+", count=1000)
        if not page:
            break
        for _, fields in page:
            entries += 1
            payload += sum(len(k) + len(v) for k, v in fields.items())
            record = unpack(zlib.decompress(fields[RECORD]))
            if isinstance(record, PromptRecord):
                prompts += 1
                units += len(record.units)
            elif isinstance(record, OutputRecord):
                units += sum(len(c.units) for c in record.choices)
        last = b"(" + page[-1][0]
    used = client.memory_usage(stream, samples=0) or 0
    return {
        "stream": stream,
        "entries": entries,
        "exchanges": prompts,
        "unit_hashes": units,
        "memory_usage_bytes": used,
        "bytes_per_exchange": used / max(1, prompts),
        "bytes_per_entry": used / max(1, entries),
        "bytes_per_unit_hash": used / max(1, units),
        "entry_fields_bytes_per_entry": payload / max(1, entries),
    }


# --- tables ----------------------------------------------------------------------------------


def pair_table(levels: list[Level]) -> str:
    head = (
        "| rate (exchanges/s) | records | visibility p50 ms | p99 ms | max ms "
        "| p99 prompt / output ms | to Redis p50 / p99 ms "
        "| B ingest us/record, prompt / output: wall (CPU) | CPU % A / B / Redis "
        "| machine busy % (others) | p99 <= 50 ms |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for lv in levels:
        verdict = ("PASS" if lv.passed else "FAIL") if lv.gated else "(not gated)"
        lines.append(
            f"| {lv.rate:g} ({lv.achieved_rate:.0f}) | {lv.records} | {fmt(lv.p50_ms, '.2f')} "
            f"| {fmt(lv.p99_ms, '.2f')} | {fmt(lv.max_ms, '.1f')} "
            f"| {fmt(lv.prompt_p99_ms, '.2f')} / {fmt(lv.output_p99_ms, '.2f')} "
            f"| {fmt(lv.to_redis_p50_ms, '.0f')} / {fmt(lv.to_redis_p99_ms, '.0f')} "
            f"| {fmt(lv.ingest_prompt_us, '.0f')} ({fmt(lv.ingest_prompt_cpu_us, '.0f')}) / "
            f"{fmt(lv.ingest_output_us, '.0f')} ({fmt(lv.ingest_output_cpu_us, '.0f')}) "
            f"| {lv.a_cpu_pct:.0f} / {lv.b_cpu_pct:.0f} / {lv.redis_cpu_pct:.0f} "
            f"| {lv.machine_busy_pct:.0f} ({lv.others_pct:.0f}) | {verdict} |"
        )
    return "\n".join(lines)


def memory_table(rows: list[dict], pair_fingerprints: int) -> str:
    head = (
        "| stream | entries | exchanges | unit hashes | MEMORY USAGE | B / exchange "
        "| B / unit hash (= per fingerprint carried) | B / entry | entry fields B |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m in rows:
        lines.append(
            f"| {m['stream']} | {m['entries']} | {m['exchanges']} | {m['unit_hashes']} "
            f"| {m['memory_usage_bytes'] / 1e6:.2f} MB | {m['bytes_per_exchange']:.0f} "
            f"| {m['bytes_per_unit_hash']:.1f} | {m['bytes_per_entry']:.0f} "
            f"| {m['entry_fields_bytes_per_entry']:.0f} |"
        )
    pair = next((m for m in rows if m["stream"] == PAIR_STREAM), None)
    if pair and pair_fingerprints:
        lines.append(
            f"\nPair stream: {pair['memory_usage_bytes'] / pair_fingerprints:.1f} B of Redis per "
            f"index entry the receiving engine made from it ({pair_fingerprints} entries: the "
            f"private fingerprints only)."
        )
    return "\n".join(lines)


def throughput_table(summaries: list[GroupSummary]) -> str:
    head = (
        "| group | requests/s | / 1 replica + Redis | / no index | replicas CPU ms/req "
        "| replicas CPU % (of 1 core) | sim / Redis / client CPU ms/req "
        "| machine busy % (others) | failures |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        lines.append(
            f"| {s.group} | {fmt(s.requests_per_s)} | {fmt(s.ratio_to_one, '.2f')} "
            f"| {fmt(s.ratio_to_no_index, '.2f')} | {fmt(s.replica_cpu_ms_per_req, '.2f')} "
            f"| {fmt(s.replicas_cpu_pct, '.0f')} | {fmt(s.sim_cpu_ms_per_req, '.2f')} / "
            f"{fmt(s.redis_cpu_ms_per_req, '.2f')} / {fmt(s.client_cpu_ms_per_req, '.2f')} "
            f"| {fmt(s.machine_busy_pct, '.0f')} ({fmt(s.others_pct, '.0f')}) | {s.failures} |"
        )
    return "\n".join(lines)


def replicas_table(reports: list[dict]) -> str:
    head = (
        "| replica | group | exchanges served | visibility here p50 / p99 / max ms "
        "| encode us/record | ingest us/record | published | ingested | dropped | degraded |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        if "visibility_ms" not in r:
            continue
        v = r["visibility_ms"] or {}
        lines.append(
            f"| {r['replica']} | {r['group']} | {r['exchanges']} "
            f"| {fmt(v.get('p50'), '.1f')} / {fmt(v.get('p99'), '.1f')} / "
            f"{fmt(v.get('max'), '.1f')} | {r['encode_us']} | {r['ingest_us']} "
            f"| {r['index_published']} | {r['index_ingested']} | {r['index_dropped']} "
            f"| {r['index_degraded']} |"
        )
    return "\n".join(lines)


def sizing(
    memory: dict, summaries: list[GroupSummary], levels: list[Level], window: float
) -> dict[str, Any]:
    """Per 1,000 requests/s, from this run's measured figures (the replicas' CPU is split
    and projected by ``cost_model``)."""
    by = {s.group: s for s in summaries}
    one, three = by[ONE], by[THREE]
    nan = float("nan")
    pair_cpu = median_of(
        [(lv.ingest_prompt_cpu_us + lv.ingest_output_cpu_us) / 1000 for lv in levels]
    )
    return {
        "redis_bytes_per_exchange": memory["bytes_per_exchange"],
        "redis_stream_gb": memory["bytes_per_exchange"] * 1000 * window / 1e9,
        # entry fields of a prompt and an output entry per exchange
        "stream_mb_per_s_in": memory["entry_fields_bytes_per_entry"] * 2 * 1000 / 1e6,
        "redis_cpu_ms_per_req": three.redis_cpu_ms_per_req or nan,
        "replica_cpu_ms_per_req_alone": one.replica_cpu_ms_per_req or nan,
        "replica_cpu_ms_per_req_of_3": three.replica_cpu_ms_per_req or nan,
        "ingest_cpu_ms_per_exchange_pair": pair_cpu,
    }


def ingest_cpu_ms(reports: list[dict], groups: tuple[str, ...]) -> float:
    """CPU per exchange ingested from another replica, in ms, as the replicas of
    ``groups`` measured it (``index.stopped``'s ``ingest_us``: decoding and the engine, in
    the loop thread's CPU time), weighted by what each ingested; an exchange is two
    records. ``ingest_us`` is per entry read from another replica, used or not: here
    every one is used (each group's stream is its own: no duplicates, no other key or
    domain). NaN when none ingested."""
    mine = [r for r in reports if r.get("group") in groups and r.get("index_ingested")]
    records = sum(r["index_ingested"] for r in mine)
    if not records:
        return float("nan")
    return 2 * sum(r["ingest_us"] * r["index_ingested"] for r in mine) / records / 1000


def cost_model(summaries: list[GroupSummary], reports: list[dict]) -> dict[str, Any]:
    """The replicas' CPU per request as a function of replicas N and cache domains D, from
    four measured costs, and its prediction next to the group it was not fitted on.

    - ``c_serve``: what the replica that serves a request spends on it (proxying,
      scanning, publishing: the "1 replica + Redis" group).
    - ``c_more``: what one more replica costs per request when it shares nothing (the
      "2 replicas, 2 domains" group minus ``c_serve``): its own event loops and timers,
      and on this machine more processes on the same two cores.
    - ``c_ingest``: what each other replica of the request's domain spends ingesting it,
      as the 2-replica group's replicas measure it themselves (``ingest_cpu_ms``:
      decoding and the engine; reading the stream is not in it).
    - ``c_shared``: what the "2 replicas + Redis" group spends beyond the three above:
      what a replica that shares a view pays on every request it serves, however many
      others there are (its streams look the others' entities up by keyed id,
      docs/detection.md), and reading the stream, which grows with the others' traffic
      but is counted here once. A residual of noisy group figures: it can come out
      below zero.

    Summed over the replicas: ``c(N, D) = c_serve + (N - 1) c_more + (N / D - 1)
    c_ingest``, plus ``c_shared`` when ``N / D > 1``; it predicts the 3-replica group,
    whose figures none of the terms reads.
    The fitted groups' rows show the fit. On this machine the cores are shared, so
    requests/s follow the whole machine's CPU per request (the simulator, Redis and
    the client's share from the 1-replica group): ratio to one replica = (c_serve +
    rest) / (c(N, D) + rest). With one core per replica ``c_more`` is left out (a
    replica's own overhead takes the same share of every core, whatever N is): N
    replicas carry ``1000 N / (c(N, D) - (N - 1) c_more)`` requests/s, which without
    domains bends towards ``1000 / c_ingest``; in D domains each domain is its own such
    curve."""
    by = {s.group: s for s in summaries}
    nan = float("nan")

    def cpu(s: GroupSummary) -> float:
        return s.replica_cpu_ms_per_req if s.replica_cpu_ms_per_req is not None else nan

    one = by[ONE]
    c_serve = cpu(one)
    c_more = cpu(by[DOMAINS]) - c_serve
    c_ingest = ingest_cpu_ms(reports, (TWO,))
    c_shared = cpu(by[TWO]) - c_serve - c_more - c_ingest
    rest = sum(
        v or 0.0
        for v in (one.sim_cpu_ms_per_req, one.redis_cpu_ms_per_req, one.client_cpu_ms_per_req)
    )

    def c(n: int, domains: int, more: float = c_more) -> float:
        per_domain = n / domains
        if per_domain == 1:  # shares nothing (and a NaN of a run without ingestion stays out)
            return c_serve + (n - 1) * more
        return c_serve + (n - 1) * more + (per_domain - 1) * c_ingest + c_shared

    rows = []
    for name, n, domains in ((ONE, 1, 1), (DOMAINS, 2, 2), (TWO, 2, 1), (THREE, 3, 1)):
        predicted = c(n, domains)
        rows.append(
            {
                "group": name,
                "replicas": n,
                "domains": domains,
                "fitted": name != THREE,
                "predicted_cpu_ms_per_req": predicted,
                "measured_cpu_ms_per_req": cpu(by[name]),
                "predicted_ratio_to_one": (c_serve + rest) / (predicted + rest),
                "measured_ratio_to_one": by[name].ratio_to_one,
            }
        )
    return {
        "c_serve_ms": c_serve,
        "c_more_ms": c_more,
        "c_ingest_ms": c_ingest,
        "c_shared_ms": c_shared,
        # the two-term model of earlier versions: everything beyond c_serve per other replica
        "c_ingest_two_term_ms": cpu(by[TWO]) - c_serve,
        "rest_ms": rest,
        "rows": rows,
        "one_core_per_replica": {
            "one_domain": {n: 1000 * n / c(n, 1, 0.0) for n in (1, 2, 3, 4, 8, 16)},
            "domains_of_2_replicas": {n: 1000 * n / c(n, n // 2, 0.0) for n in (2, 4, 8, 16)},
            "ceiling_one_domain": 1000 / c_ingest if c_ingest > 0 else nan,
        },
    }


def model_table(model: dict[str, Any]) -> str:
    lines = [
        "| group | replicas | domains | replica CPU ms/req predicted | measured "
        "| req/s vs 1 replica predicted | measured |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in model["rows"]:
        lines.append(
            f"| {r['group']}{' (fitted)' if r['fitted'] else ''} | {r['replicas']} "
            f"| {r['domains']} | {r['predicted_cpu_ms_per_req']:.2f} "
            f"| {fmt(r['measured_cpu_ms_per_req'], '.2f')} "
            f"| {r['predicted_ratio_to_one']:.2f} | {fmt(r['measured_ratio_to_one'], '.2f')} |"
        )
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="~1 min: shorter rates, 2 small rounds")
    p.add_argument("--rounds", type=int, help="throughput rounds (default 5, --quick 2)")
    p.add_argument("--requests", type=int, help="per group per round (default 300, quick 150)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients")
    p.add_argument("--token-delay", type=float, default=0.0, help="simulator s per event")
    p.add_argument("--rates", help="pair rates, exchanges/s (default 20,100,300,1000)")
    p.add_argument("--level-seconds", type=float, help="seconds per rate (default 5, quick 1)")
    p.add_argument(
        "--gate-rate",
        type=float,
        default=100.0,
        help="rates up to this must meet p99 <= 50 ms; above: reported only (default 100)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--batch-ms", type=float, help="[index] batch_ms of every replica (default: the config's)"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for the machine to be < 25%% busy (shared machines)",
    )
    p.add_argument("--keep-logs", metavar="DIR", help="keep every process's output and logs here")
    p.add_argument("--json", metavar="PATH", help="write every number here")
    # Worker processes of the pair (started by this script).
    p.add_argument("--worker", choices=("consume", "publish"), help=argparse.SUPPRESS)
    for name in ("--key", "--redis", "--stream", "--state", "--out", "--plan", "--watch"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--expected", type=int, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    args.rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    args.requests = args.requests if args.requests is not None else (150 if args.quick else 300)
    args.rates = [float(r) for r in (args.rates or "20,100,300,1000").split(",")]
    if args.level_seconds is None:
        args.level_seconds = 1.0 if args.quick else 5.0
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1 or min(args.rates) <= 0:
        p.error("--rounds, --requests, --concurrency and --rates must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    stop_on_sigterm()
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"
    args.key = secrets.token_hex(32)
    if args.wait_quiet > 0:
        print(f"machine {wait_quiet(args.wait_quiet):.0f}% busy over 2 s", flush=True)
    servers: list[Server] = []
    started = time.monotonic()
    print(
        f"scaleout: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; rates "
        f"{','.join(f'{r:g}' for r in args.rates)}/s x {args.level_seconds:g} s; "
        f"{args.rounds} rounds x {args.requests} requests, {args.concurrency} clients",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            workdir = Path(args.keep_logs)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="scaleout-")))
        stack.callback(stop_all, servers)  # runs first: before the directory goes
        try:
            args.state_path = workdir / "warm-state.npz"
            took = warm_state(args.key, args.state_path)
            print(f"learned state: {WARM_REQUESTS} requests in {took:.1f} s", flush=True)
            redis_server, client = start_redis(workdir, servers)
            redis_url = f"redis://{HOST}:{redis_server.port}/0"
            used_before = client.info("memory")["used_memory"]

            # B listens and A scans (untimed) while the simulator and the replicas start;
            # A publishes once they are all idle and ready.
            workers = PairWorkers(args, workdir, redis_server, redis_url)
            workers.start(servers)
            sim_port = free_port()
            sim_argv = [sys.executable, "-m", "proxy", "sim", "--host", HOST,
                        "--port", str(sim_port), "--token-delay", str(args.token_delay),
                        "--split-words", "--seed", str(args.seed)]  # fmt: skip
            sim = start("sim", sim_argv, workdir, port=sim_port)
            servers.append(sim)
            groups = start_groups(args, workdir, redis_url, sim.url, servers)
            t = time.monotonic()
            wait_port(sim)
            asyncio.run(wait_ready([r for g in groups for r in g.replicas]))
            count = sum(g.replicas.__len__() for g in groups)
            print(f"{count} replicas and the simulator ready in {time.monotonic() - t:.0f} s",
                  flush=True)  # fmt: skip
            pair = workers.run()
            print("\n" + pair_table(pair["levels"]) + "\n", flush=True)
            rows = asyncio.run(throughput(args, groups, sim, redis_server))
            replicas = [r for g in groups for r in g.replicas]
            stop_all(replicas)  # index.stopped: counters and visibility
            reports = replica_reports(groups)
            memory = [stream_memory(client, s) for s in (PAIR_STREAM, "bench:one", "bench:three")]
            used_after = client.info("memory")["used_memory"]
        except KeyboardInterrupt:
            print("\ninterrupted; stopping processes", file=sys.stderr)
            return 130
        except (RuntimeError, redis.RedisError) as e:
            print(f"scaleout: {e}", file=sys.stderr)
            return 1
    elapsed = time.monotonic() - started

    summaries = summarise(groups, rows)
    window = load(None).detection.window_seconds
    three_memory = next(m for m in memory if m["stream"] == "bench:three")
    size = sizing(three_memory, summaries, pair["levels"], window)
    levels: list[Level] = pair["levels"]
    con = pair["consumer"]
    print("## Visibility: publication on A -> ingested by B (two processes, one Redis)\n")
    print(pair_table(levels))
    print(
        f"\nA encodes a record in {pair['publisher']['encode_us']:.0f} us; B ingests one in "
        f"{con['ingest_us']:.0f} us on average. SharedIndex's own visibility_ms on B (all "
        f"rates): {con['own_visibility_ms']}. B's counters: ingested "
        f"{con['counters']['index_ingested']}, skipped {con['counters']['index_skipped']}."
    )
    print("\n## Redis memory (after the run)\n")
    print(memory_table(memory, con["fingerprints"]))
    total_entries = sum(m["entries"] for m in memory)
    print(
        f"\nINFO used_memory: {used_before / 1e6:.2f} MB empty, {used_after / 1e6:.2f} MB "
        f"after ({(used_after - used_before) / max(1, total_entries):.0f} B per entry of all "
        f"streams; MEMORY USAGE of the streams: "
        f"{sum(m['memory_usage_bytes'] for m in memory) / 1e6:.2f} MB)."
    )
    print("\n## Throughput through 1 and 3 replicas (round robin by the client)\n")
    print(throughput_table(summaries))
    print(
        f"\nMedians over {args.rounds} rounds of {args.requests} requests, {args.concurrency} "
        f"clients, simulator token delay {args.token_delay:g} s, {os.cpu_count()} CPUs "
        f"shared by every process. Per-round ratios of 3 replicas to 1: "
        + " ".join(f"{r:.2f}" for r in next(s for s in summaries if s.group == THREE).ratios_to_one)
    )
    print("\n## The replicas' own figures (index.stopped, over the whole run)\n")
    print(replicas_table(reports))
    found = {g[0]: set() for g in GROUPS}
    for r in reports:
        found[r["group"]].update(map(tuple, r["findings"]))
    print(
        "\nleak.detected on this clean traffic (each finding a false positive), per group: "
        + "; ".join(f"{g}: {len(f)}" for g, f in found.items())
        + (
            " (the same findings in every group)"
            if len({frozenset(f) for f in found.values()}) == 1
            else f" -- they differ: {found}"
        )
    )
    print(
        f"\n## Sizing per 1,000 requests/s (this run's figures, window {window:g} s)\n\n"
        f"- Redis: {size['redis_stream_gb']:.2f} GB of stream "
        f"({size['redis_bytes_per_exchange']:.0f} B per exchange x 1,000/s x {window:g} s); "
        f"{size['stream_mb_per_s_in']:.1f} MB/s of entries in, the same out to each replica; "
        f"{size['redis_cpu_ms_per_req']:.2f} ms of Redis CPU per request.\n"
        f"- Replica CPU per request: {size['replica_cpu_ms_per_req_alone']:.2f} ms alone "
        f"(proxying, scanning, publishing); {size['replica_cpu_ms_per_req_of_3']:.2f} ms "
        "summed over the group of 3 (split below). `Ingester.ingest` in the pair's B: "
        f"{fmt(size['ingest_cpu_ms_per_exchange_pair'], '.2f')} ms of CPU per exchange."
    )
    model = cost_model(summaries, reports)
    projection = model["one_core_per_replica"]
    print(
        f"\n## Cost model (c_serve {model['c_serve_ms']:.2f} ms, c_more "
        f"{model['c_more_ms']:.2f} ms, c_ingest "
        f"{model['c_ingest_ms']:.2f} ms as the replicas measured it, c_shared "
        f"{model['c_shared_ms']:.2f} ms per request; simulator, Redis and client "
        f"{model['rest_ms']:.2f} ms; the two-term model's c_ingest: "
        f"{model['c_ingest_two_term_ms']:.2f} ms)\n\n"
        + model_table(model)
        + "\n\nOne core per replica, "
        "one domain: "
        + ", ".join(f"{n}: {v:.0f}/s" for n, v in projection["one_domain"].items())
        + f" (ceiling {projection['ceiling_one_domain']:.0f}/s); domains of 2 replicas: "
        + ", ".join(f"{n}: {v:.0f}/s" for n, v in projection["domains_of_2_replicas"].items())
    )
    ok = all(lv.passed for lv in levels) and not any(s.failures for s in summaries)
    print(f"\nRun took {elapsed:.0f} s. {'PASS' if ok else 'FAIL'}")
    if args.json:
        doc = {
            "config": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k not in INTERNAL_ARGS
            },
            "cpus": os.cpu_count(),
            "pair": {
                "levels": [asdict(lv) for lv in levels],
                "publisher": pair["publisher"],
                "consumer": con,
            },
            "memory": memory,
            "redis_used_memory": {"before": used_before, "after": used_after},
            "throughput": {
                "summary": [asdict(s) for s in summaries],
                "rounds": [asdict(r) for r in rows],
            },
            "replicas": reports,
            "sizing_per_1000_rps": size,
            "cost_model": model,
            "elapsed_s": elapsed,
            "pass": ok,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
