"""Scale-out: replicas share what they observe through a Redis Stream.

A gateway for many tenants runs several crosstalk replicas behind a load balancer: tenant
A's request may pass replica 1 while the leak of its words into tenant B's answer passes
replica 2. Every replica keeps its own engine (per-delta lookups stay in memory), publishes
the keyed records its engine makes (``proxy.engine.records``: keyed unit hashes, offsets,
entity ids, tenant and request ids, never text) to one Redis Stream, and ingests the
records the other replicas publish. So each engine holds every tenant's recent
fingerprints, whichever replica they came through.

Pieces, one concern each:

- ``Health``: Redis reachable or not. Logs ``index.degraded`` once per episode and
  ``index.recovered`` when it ends, and counts episodes; ``Backoff`` paces reconnection.
- ``Publisher``: a bounded in-memory outbox that the request path appends to (no Redis
  call there), drained by a background task with pipelined ``XADD``. Each entry trims
  the stream to the detection window (``MINID ~``: entry ids are millisecond times).
  While Redis is away the outbox holds the records (dropping the oldest beyond its
  bound, counted) and sends them when Redis returns: the others catch up.
- ``Ingester``: turns stream entries into engine state. Refuses entries made under
  another hashing key (logged once per key), skips this replica's own entries, and
  ingests each origin's records in arrival order (``OriginIngester``).
- ``Consumer``: a background task reading the stream (``XREAD BLOCK``) from the last
  entry it ingested; after an outage it resumes from there, so nothing still in the
  stream is missed.
- ``SharedIndex``: what the addon holds. ``load_window`` (at start, before the proxy
  listens) reads the current window with a synchronous client; ``start`` launches the
  two tasks on mitmproxy's event loop (the engine is single-threaded: ingestion runs on
  the same loop as the live scans); ``publish`` is the record sink; ``close`` stops.

Redis never blocks or slows traffic: the request path only appends to a deque, and
ingestion yields to the event loop every few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import random
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.asyncio as aredis
from isal import isal_zlib
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from proxy.engine import Engine
from proxy.engine.detector import ResponseScan
from proxy.engine.records import (
    CanaryRecord,
    OutputRecord,
    PromptRecord,
    Record,
    collapsed_choice,
)
from proxy.redaction import redacted
from proxy.store.codec import DECODE_ERRORS, from_journal_line, is_packed, pack, unpack
from proxy.store.domains import domain_of

# Stream entry fields: short names, since Redis stores them in every entry.
ORIGIN = b"o"  # the publishing replica's id
KEY = b"k"  # the hashing key's id (records of another key mean nothing here)
# The record: proxy.store.codec.pack, an output's choices collapsed to one feed,
# zlib-compressed (``compressed_record``). (Before it: a journal line, still read, so
# that a fleet can be upgraded a replica at a time.)
RECORD = b"r"
OFFERED = b"t"  # when the record entered the outbox (Unix time): for the latency figures
DOMAIN = b"d"  # the cache domain the record was made in (absent: the default domain)

COMPRESS_LEVEL = 1  # zlib level of a stream entry's record: the fastest
MAX_RECORD_BYTES = 64 << 20  # an entry that inflates to more is corrupt (a zip bomb)
_MAX_DEFLATE_RATIO = 1032  # deflate's limit: a 258-byte match in no less than 2 bits
# What inflating a record raises on bytes that are not zlib data (a class: isal's type
# stub declares an instance).
INFLATE_ERROR = cast("type[Exception]", isal_zlib.error)
BLOCK_MS = 1000  # XREAD BLOCK: how long one read waits for new entries
BATCH = 500  # entries per XADD pipeline / XREAD / XRANGE
YIELD_AFTER = 0.004  # seconds of ingestion before giving the event loop back
# A stream entry as this index's clients read it (RESP2, bytes): its id and its fields.
_Entry = tuple[bytes, dict[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class IndexSettings:
    """Where and how to reach Redis (``[index]`` of the configuration)."""

    url: str
    password: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    stream: str = "crosstalk:records"
    replica_name: str = ""
    outbox_records: int = 20000
    timeout_seconds: float = 1.0
    load_timeout_seconds: float = 30.0
    reconnect_max_seconds: float = 5.0
    batch_ms: float = 5.0  # at most one send and one read per this many ms (``Pacer``)
    domain: str = ""  # the cache domain of this replica's upstream ("": the default one)

    @property
    def domain_stream(self) -> str:
        """The stream of this replica's cache domain: the configured one for the default
        domain, ``STREAM:DOMAIN`` for a named one. A replica reads only its domain's."""
        return f"{self.stream}:{self.domain}" if self.domain else self.stream

    def client_kwargs(self, timeout: float) -> dict[str, Any]:
        """redis-py connection arguments: one attempt per call (``Health`` retries,
        with backoff, without holding anything up), ``timeout`` per socket operation."""
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": self.timeout_seconds,
        }
        if self.password:
            kwargs["password"] = self.password
        if self.tls_ca_file and self.client_url.startswith("rediss://"):
            kwargs["ssl_ca_certs"] = self.tls_ca_file
        return kwargs

    @property
    def client_url(self) -> str:
        if self.tls and self.url.startswith("redis://"):
            return "rediss://" + self.url.removeprefix("redis://")
        return self.url


def settings_from(config: Any, upstreams: Sequence[str] = ()) -> IndexSettings | None:
    """The settings of a ``proxy.config.Config`` (its ``[index]``, field for field, and the
    cache domain of ``upstreams``, the URLs this replica forwards to); None without
    ``index.url``."""
    section = config.index
    if not section.url:
        return None
    fields = {
        f.name: getattr(section, f.name)
        for f in dataclasses.fields(IndexSettings)
        if f.name != "domain"
    }
    return IndexSettings(**fields, domain=domain_of(section, upstreams))


def new_replica_id(name: str = "") -> str:
    """An id for this process: the name (default: host name), the pid and a random part.
    A restarted replica gets a new id, so it ingests its former self's records too."""
    return f"{name or socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def window_start_id(window_seconds: float, now: float | None = None) -> str:
    """The stream id of the oldest entry still in the detection window."""
    now = time.time() if now is None else now
    return f"{max(0, int((now - window_seconds) * 1000))}-0"


# -- connection health ----------------------------------------------------------------


class Backoff:
    """Exponential delays with jitter between reconnection attempts, reset on success."""

    def __init__(self, first: float = 0.05, ceiling: float = 5.0) -> None:
        self.first = first
        self.ceiling = ceiling
        self._next = first

    def delay(self) -> float:
        d = self._next
        self._next = min(self.ceiling, self._next * 2)
        return d * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.first


class Health:
    """Whether Redis answers, shared by the publisher and the consumer: one
    ``index.degraded`` per episode (whichever side notices first), one
    ``index.recovered`` when any call succeeds again."""

    def __init__(self, log: Any, counters: dict[str, int], url: str) -> None:
        self.log = log
        self.counters = counters
        self.url = redacted(url)
        self.degraded = False
        self._since = 0.0

    def failed(self, where: str, error: BaseException) -> None:
        self.counters["index_errors"] += 1
        if self.degraded:
            return
        self.degraded = True
        self._since = time.monotonic()
        self.counters["index_degraded"] += 1
        self.log.warning(
            "index.degraded",
            url=self.url,
            where=where,
            reason=f"{type(error).__name__}: {error}"[:300],
            detail="serving and detecting locally; reconnecting with backoff",
        )

    def succeeded(self, **fields: Any) -> None:
        if not self.degraded:
            return
        self.degraded = False
        self.log.info(
            "index.recovered",
            url=self.url,
            after_seconds=round(time.monotonic() - self._since, 3),
            **fields,
        )


REDIS_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


# -- publishing -------------------------------------------------------------------------


class Pacer:
    """Spaces a loop's Redis calls at least ``interval`` seconds apart, so that under load
    each call carries what came in meanwhile. A redis-py call costs ~100 us of CPU
    whatever it carries (an ``XREAD`` of 1 entry ~100 us, of 8 entries ~110 us), and
    without pacing a replica made one per record: two sends and, for every replica of its
    domain, two reads an exchange. When calls are farther apart than ``interval`` (light
    load) nothing waits; under load a record waits at most ``interval`` more to be sent,
    and as much to be read. A backlog of a full call (``BATCH``) or more is not held
    back: waiting would only slow its draining (after an outage, say)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last = -math.inf

    async def wait(self, backlog: bool = False) -> None:
        """Sleep until ``interval`` has passed since the previous call to ``wait``; not at
        all when ``backlog`` (a full call is waiting)."""
        delay = self._last + self.interval - self._clock()
        if delay > 0 and not backlog:
            await asyncio.sleep(delay)
        self._last = self._clock()


@dataclass(slots=True)
class Pending:
    """A record waiting in the outbox, and its stream entry once encoded (kept, so
    that a batch retried after an outage is not encoded again)."""

    offered: float  # when it entered the outbox (Unix time)
    record: Record
    entry: dict[bytes, bytes] | None = None


class Publisher:
    """Sends this replica's records to the stream without ever making traffic wait.

    ``offer`` (request path) appends to a bounded deque; ``run`` (a background task)
    drains it in pipelined batches, encoding them a few milliseconds at a time. A batch
    that fails goes back to the front of the outbox and is retried after a backoff;
    beyond ``outbox_records`` the oldest records are dropped and counted
    (``index_dropped``)."""

    def __init__(
        self,
        settings: IndexSettings,
        replica_id: str,
        key_id: str,
        window_seconds: float,
        health: Health,
        counters: dict[str, int],
    ) -> None:
        self.settings = settings
        self.replica_id = replica_id.encode()
        self.key_id = key_id.encode()
        self.domain = settings.domain.encode()
        self.window_seconds = window_seconds
        self.health = health
        self.counters = counters
        self.outbox: deque[Pending] = deque()
        self.inflight: list[Pending] = []  # the batch being sent
        self.encode_seconds = 0.0  # CPU (thread time) spent encoding entries (cost figures)
        self.encoded = 0
        self.backoff = Backoff(ceiling=settings.reconnect_max_seconds)
        self.pacer = Pacer(settings.batch_ms / 1000)
        counters.setdefault("index_sends", 0)  # pipelines sent (each ~100 us of CPU)
        self._wake = asyncio.Event()

    def offer(self, record: Record) -> None:
        """Queue ``record`` for the stream (no I/O; called on the request path)."""
        self.outbox.append(Pending(time.time(), record))
        self._bound()
        self._wake.set()

    def _bound(self) -> None:
        while len(self.outbox) > self.settings.outbox_records:
            self.outbox.popleft()
            self.counters["index_dropped"] += 1

    def entry(self, pending: Pending) -> dict[bytes, bytes]:
        """The stream entry of ``pending`` (encoded once)."""
        if pending.entry is None:
            started = time.thread_time()
            pending.entry = {
                ORIGIN: self.replica_id,
                KEY: self.key_id,
                RECORD: compressed_record(pending.record),
                OFFERED: b"%.4f" % pending.offered,
            }
            if self.domain:
                pending.entry[DOMAIN] = self.domain
            self.encode_seconds += time.thread_time() - started
            self.encoded += 1
        return pending.entry

    async def run(self, client: aredis.Redis) -> None:
        while True:
            if not self.outbox:
                self._wake.clear()
                await self._wake.wait()
            # What is offered meanwhile joins this batch.
            await self.pacer.wait(backlog=len(self.outbox) >= BATCH)
            batch = [self.outbox.popleft() for _ in range(min(BATCH, len(self.outbox)))]
            # Stopped mid-send, the batch may or may not be in Redis: ``flush_sync``
            # sends it again (at least once; consumers ignore a duplicate).
            self.inflight = batch
            try:
                await self._send(client, batch)
            except REDIS_ERRORS as e:
                self.inflight = []
                self.outbox.extendleft(reversed(batch))
                self._bound()
                self.health.failed("publish", e)
                await asyncio.sleep(self.backoff.delay())
                continue
            self.inflight = []
            self.counters["index_published"] += len(batch)
            self.counters["index_sends"] += 1
            self.backoff.reset()
            self.health.succeeded(outbox=len(self.outbox))

    async def _send(self, client: aredis.Redis, batch: list[Pending]) -> None:
        minid = window_start_id(self.window_seconds).removesuffix("-0")
        started = time.perf_counter()
        async with client.pipeline(transaction=False) as pipe:
            for pending in batch:
                fields: dict[Any, Any] = self.entry(pending)  # invariant in redis-py's types
                pipe.xadd(self.settings.domain_stream, fields, minid=minid, approximate=True)
                if time.perf_counter() - started > YIELD_AFTER:
                    await asyncio.sleep(0)  # a backlog is encoded between live events
                    started = time.perf_counter()
            async with asyncio.timeout(self.settings.timeout_seconds):
                await pipe.execute()

    def flush_sync(self, client: redis.Redis) -> int:
        """At exit: send what is left, once, with a synchronous client. Returns how many
        records were sent (0 when Redis does not answer)."""
        batch = self.inflight + list(self.outbox)
        if not batch:
            return 0
        minid = window_start_id(self.window_seconds).removesuffix("-0")
        try:
            client.ping()  # before encoding a backlog for a Redis that is not there
            pipe = client.pipeline(transaction=False)
            for pending in batch:
                fields: dict[Any, Any] = self.entry(pending)  # invariant in redis-py's types
                pipe.xadd(self.settings.domain_stream, fields, minid=minid, approximate=True)
            pipe.execute()
        except REDIS_ERRORS:
            return 0
        self.inflight = []
        self.outbox.clear()
        self.counters["index_published"] += len(batch)
        return len(batch)


# -- ingesting ---------------------------------------------------------------------------


def compressed_record(record: Record) -> bytes:
    """``record`` as a stream entry carries it: ``pack`` of it ``collapsed``,
    ``deflated``."""
    return deflated(pack(collapsed(record)))


def deflated(data: bytes) -> bytes:
    """``data`` as zlib data (``inflated`` reverses it). A word's unit hash recurs
    within an exchange, so a packed record keeps ~0.78 of its bytes (Redis memory is
    the bound at scale). ISA-L (``isal``) writes the same format as the standard
    library, which still reads it (a fleet upgraded a replica at a time), in less than
    half its CPU (bench/ingest.py prints both; docs/operations.md)."""
    return isal_zlib.compress(data, COMPRESS_LEVEL)


def inflated(data: bytes) -> bytes:
    """A record's bytes, decompressed (``INFLATE_ERROR`` on bytes that are not zlib
    data); ValueError past ``MAX_RECORD_BYTES``."""
    if len(data) <= MAX_RECORD_BYTES // _MAX_DEFLATE_RATIO // 2:
        # Half the cap at most: one call, no stream object.
        return isal_zlib.decompress(data)
    inflater = isal_zlib.decompressobj()
    out = inflater.decompress(data, MAX_RECORD_BYTES)
    # Not at the end of the stream: more than the cap is left (ISA-L, having read all
    # its input, leaves no unconsumed tail to say so), or the data were cut short.
    if not inflater.eof:
        raise ValueError(f"a record of more than {MAX_RECORD_BYTES} bytes, or cut short")
    return out


def collapsed(record: Record) -> Record:
    """An output record whose choices are ``collapsed_choice``; any other as it is. What
    a replica publishes: all that another replica's ingestion uses, and the feeds'
    offsets and sequence numbers (12 bytes a feed) are not sent."""
    if not isinstance(record, OutputRecord):
        return record
    return dataclasses.replace(record, choices=tuple(map(collapsed_choice, record.choices)))


class OriginIngester:
    """Ingests one origin replica's records into the engine as they arrive.

    A prompt is ingested at once, so this replica sees its fingerprints while its
    response is still streaming elsewhere (a leak of it can already be on its way); an
    output record (made when its exchange finished) is ingested whole
    (``ResponseScan.ingest_output``: as the origin's scan judged its k-grams, or, where
    that scan found a leak, scanned again as one feed). That is the order in which the
    records reach this replica, which is the order the fingerprints came into existence, give or take the stream's
    latency. ``RecordReplayer`` instead reproduces the origin engine's own findings
    exactly, feed by feed, but holds a prompt back until every exchange in flight before
    it has finished on its origin (seconds of blindness to a streaming source), and
    replaying feed by feed costs what scanning the stream live did. The findings of an
    ingested record belong to the origin, which already reported them: only counted.

    Duplicates (a batch re-sent after a timeout that did reach Redis) are ignored: each
    prompt is known by its sequence number until it leaves the window."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # prompt seq -> (prompt time, its scan; None once its output was ingested)
        self._scans: OrderedDict[int, tuple[float, ResponseScan | None]] = OrderedDict()
        self.newest = time.time()  # the latest prompt's time (creation until the first)

    def push(self, record: Record) -> int | None:
        """Ingest ``record``; returns how many findings it made (already reported by the
        replica that served the exchange: counted, not logged again), or None when it
        was not used (a duplicate, or an output whose prompt is unknown here)."""
        if isinstance(record, PromptRecord):
            if record.seq in self._scans:
                return None
            self._scans[record.seq] = (record.time, self.engine.ingest_prompt(record))
            self.newest = max(self.newest, record.time)
            self._forget_before(record.time - self.engine.config.window_seconds)
            return 0
        if isinstance(record, OutputRecord):
            time_and_scan = self._scans.get(record.prompt_seq)
            if time_and_scan is None or time_and_scan[1] is None:
                return None  # its prompt left the window (or never came), or a duplicate
            prompt_time, scan = time_and_scan
            assert scan is not None  # checked above
            found = len(scan.ingest_output(record))
            self._scans[record.prompt_seq] = (prompt_time, None)
            return found
        if isinstance(record, CanaryRecord):
            self.engine.ingest_canary(record)
        return 0

    def _forget_before(self, horizon: float) -> None:
        scans = self._scans
        while scans:
            seq, (when, _) = next(iter(scans.items()))
            if when >= horizon:
                break
            del scans[seq]

    def __len__(self) -> int:
        return len(self._scans)


class Ingester:
    """Stream entries -> engine state, one ``OriginIngester`` per origin replica (each
    engine numbers its own records)."""

    def __init__(
        self,
        engine: Engine,
        replica_id: str,
        log: Any,
        counters: dict[str, int],
        domain: str = "",
    ) -> None:
        self.engine = engine
        self.replica_id = replica_id.encode()
        self.domain = domain.encode()
        counters.setdefault("index_other_domain", 0)
        self.key_id = engine.hasher.key_id.encode()
        self.log = log
        self.counters = counters
        self.origins: dict[bytes, OriginIngester] = {}
        self._refused_keys: set[bytes] = set()
        # CPU (this thread's: the event loop's, which other processes' share of the
        # cores does not inflate) spent ingesting, decoding and engine, for the cost figures
        self.seconds = 0.0
        self.timed = 0  # other replicas' entries ingested (what ``seconds`` covers)
        self._logged: set[str] = set()  # events logged once

    def ingest(self, entry_id: bytes, fields: dict[bytes, bytes]) -> bool:
        """Ingest one stream entry; False when it is this replica's own (not timed)."""
        if fields.get(ORIGIN, b"") == self.replica_id:
            return False
        started = time.thread_time()
        try:
            self._ingest(entry_id, fields)
        finally:
            self.seconds += time.thread_time() - started
            self.timed += 1
        return True

    def _ingest(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        origin = fields.get(ORIGIN, b"")
        if fields.get(DOMAIN, b"") != self.domain:
            # Another cache domain's record in this domain's stream (two domains given one
            # stream name by hand): its requests never shared a cache with ours.
            self.counters["index_other_domain"] += 1
            return
        key = fields.get(KEY, b"")
        if key != self.key_id:
            self.counters["index_refused"] += 1
            if key not in self._refused_keys and len(self._refused_keys) < 100:
                self._refused_keys.add(key)
                self.log.error(
                    "index.refused",
                    origin=origin.decode(errors="replace"),
                    key_id=key.decode(errors="replace"),
                    our_key_id=self.key_id.decode(),
                    detail="records hashed under another detection.key: set the same key "
                    "on every replica",
                )
            return
        try:
            data = inflated(fields[RECORD])
            record = unpack(data) if is_packed(data) else from_journal_line(data)
        except (*DECODE_ERRORS, INFLATE_ERROR) as e:
            self._failed("index.corrupt", "index_corrupt", entry_id, origin, e)
            return
        origin_ingester = self.origins.get(origin)
        if origin_ingester is None:
            self._forget_idle_origins()
            origin_ingester = self.origins[origin] = OriginIngester(self.engine)
        try:
            found = origin_ingester.push(record)
        except Exception as e:  # noqa: BLE001 -- fail open: the engine must go on
            self._failed("index.ingest_failed", "index_errors", entry_id, origin, e)
            return
        if found is None:
            self.counters["index_skipped"] += 1
            return
        self.counters["index_ingested"] += 1
        self.counters["index_remote_findings"] += found

    def _failed(
        self, event: str, counter: str, entry_id: bytes, origin: bytes, error: Exception
    ) -> None:
        """Count an entry that could not be used; log the first of each kind."""
        self.counters[counter] += 1
        if event not in self._logged:
            self._logged.add(event)
            self.log.error(
                event,
                entry=entry_id.decode(errors="replace"),
                origin=origin.decode(errors="replace"),
                reason=f"{type(error).__name__}: {error}"[:300],
            )

    def _forget_idle_origins(self) -> None:
        """Drop what is kept for origins (replicas that stopped: a restart gets a new
        id) whose latest prompt left the window."""
        horizon = time.time() - self.engine.config.window_seconds
        for origin, ingester in list(self.origins.items()):
            if ingester.newest < horizon:
                del self.origins[origin]


class Consumer:
    """Reads the stream from the last entry ingested (``XREAD BLOCK``), forever; after a
    failure, reconnects with backoff and resumes where it stopped."""

    def __init__(
        self,
        settings: IndexSettings,
        ingester: Ingester,
        health: Health,
        window_seconds: float,
    ) -> None:
        self.settings = settings
        self.ingester = ingester
        self.health = health
        self.window_seconds = window_seconds
        self.last_id: bytes | None = None  # None: from the start of the window
        self.backoff = Backoff(ceiling=settings.reconnect_max_seconds)
        self.pacer = Pacer(settings.batch_ms / 1000)
        ingester.counters.setdefault("index_reads", 0)  # reads that returned entries
        # Seconds from a record's entry into its origin's outbox to its ingestion here
        # (live reads only; the latest 10,000).
        self.visibility: deque[float] = deque(maxlen=10_000)

    async def run(self, client: aredis.Redis) -> None:
        stream = self.settings.domain_stream
        full = False  # the last read brought all it could: more are waiting
        while True:
            since = self.last_id or window_start_id(self.window_seconds).encode()
            # Entries that arrive meanwhile come in this read; after a full read, more wait.
            await self.pacer.wait(backlog=full)
            try:
                reply = cast(
                    "list[tuple[bytes, list[_Entry]]] | None",
                    await client.xread({stream: since}, count=BATCH, block=BLOCK_MS),
                )
            except REDIS_ERRORS as e:
                self.health.failed("consume", e)
                await asyncio.sleep(self.backoff.delay())
                continue
            self.backoff.reset()
            self.health.succeeded()
            full = False
            for _, entries in reply or []:
                self.ingester.counters["index_reads"] += 1
                full = len(entries) >= BATCH
                await self._ingest(entries)

    async def _ingest(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        started = time.perf_counter()
        for entry_id, fields in entries:
            foreign = self.ingester.ingest(entry_id, fields)
            self.last_id = entry_id
            if foreign:  # one's own entries say nothing about visibility elsewhere
                with contextlib.suppress(KeyError, ValueError):
                    self.visibility.append(time.time() - float(fields[OFFERED]))
            if time.perf_counter() - started > YIELD_AFTER:
                # Live scans run on this loop too: never hold it for a whole batch.
                await asyncio.sleep(0)
                started = time.perf_counter()

    def visibility_ms(self) -> dict[str, float]:
        """p50, p99 and max of ``visibility``, in milliseconds (empty: no samples)."""
        if not self.visibility:
            return {}
        ordered = sorted(self.visibility)
        last = len(ordered) - 1
        return {
            name: round(ordered[min(last, int(q * len(ordered)))] * 1000, 2)
            for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))
        }

    def load_sync(self, client: redis.Redis, deadline: float) -> tuple[int, bool]:
        """Ingest the window already in the stream (``XRANGE``), until ``deadline``
        (monotonic). Returns (entries read, whether the whole window was read); the
        background task goes on from where this stopped."""
        stream = self.settings.domain_stream
        start = (self.last_id and b"(" + self.last_id) or window_start_id(self.window_seconds)
        read = 0
        while time.monotonic() < deadline:
            entries = cast(
                "list[_Entry] | None", client.xrange(stream, min=start, max="+", count=BATCH)
            )
            if not entries:
                return read, True
            for entry_id, fields in entries:
                self.ingester.ingest(entry_id, fields)
                self.last_id = entry_id
                read += 1
            assert self.last_id is not None  # entries were read
            start = b"(" + self.last_id
        return read, False


# -- the addon's handle ---------------------------------------------------------------------


class SharedIndex:
    """One replica's link to the shared stream (see the module's docstring)."""

    def __init__(
        self,
        settings: IndexSettings,
        engine: Engine,
        log: Any,
        counters: dict[str, int],
    ) -> None:
        for name in (
            "index_degraded",
            "index_errors",
            "index_published",
            "index_dropped",
            "index_ingested",
            "index_refused",
            "index_corrupt",
            "index_skipped",
            "index_remote_findings",
            "index_other_domain",
        ):
            counters.setdefault(name, 0)
        self.settings = settings
        self.engine = engine
        self.log = log
        self.counters = counters
        self.replica_id = new_replica_id(settings.replica_name)
        window = engine.config.window_seconds
        self.health = Health(log, counters, settings.url)
        self.publisher = Publisher(
            settings, self.replica_id, engine.hasher.key_id, window, self.health, counters
        )
        self.ingester = Ingester(engine, self.replica_id, log, counters, settings.domain)
        self.consumer = Consumer(settings, self.ingester, self.health, window)
        self._tasks: list[asyncio.Task] = []
        self._clients: list[aredis.Redis] = []

    def publish(self, record: Record) -> None:
        """Record sink of the addon (request path: no I/O here)."""
        self.publisher.offer(record)

    def _sync_client(self) -> redis.Redis:
        s = self.settings
        return redis.Redis.from_url(
            s.client_url, retry=Retry(NoBackoff(), 0), **s.client_kwargs(s.timeout_seconds)
        )

    def _async_client(self, timeout: float) -> aredis.Redis:
        s = self.settings
        return aredis.Redis.from_url(
            s.client_url, retry=AsyncRetry(NoBackoff(), 0), **s.client_kwargs(timeout)
        )

    def load_window(self) -> None:
        """Ingest the current window from the stream, synchronously: called at start,
        before mitmproxy opens its listening port, so that a new or restarted replica
        is ready with every replica's recent fingerprints before it takes traffic.
        Bounded by ``load_timeout_seconds``; Redis down: logged, the replica starts
        with what it has and the consumer catches up once Redis answers."""
        started = time.monotonic()
        client = self._sync_client()
        try:
            read, complete = self.consumer.load_sync(
                client, started + self.settings.load_timeout_seconds
            )
        except REDIS_ERRORS as e:
            self.health.failed("load", e)
            read, complete = 0, False
        finally:
            client.close()
        self.log.info(
            "index.ready",
            replica=self.replica_id,
            url=redacted(self.settings.url),
            stream=self.settings.domain_stream,
            domain=self.settings.domain or None,
            entries=read,
            origins=len(self.ingester.origins),
            complete=complete,
            seconds=round(time.monotonic() - started, 3),
        )

    def start(self) -> None:
        """Launch the publisher and the consumer on the running (mitmproxy's) loop."""
        if self._tasks:
            return
        timeout = self.settings.timeout_seconds
        publish_client = self._async_client(timeout)
        consume_client = self._async_client(timeout + BLOCK_MS / 1000)
        self._clients = [publish_client, consume_client]
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.publisher.run(publish_client), name="crosstalk-index-publish"),
            loop.create_task(self.consumer.run(consume_client), name="crosstalk-index-consume"),
        ]

    def close(self) -> None:
        """Stop the tasks, send what the outbox still holds (once, bounded by the
        timeout) and log the counters (``index.stopped``)."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        client: aredis.Redis | redis.Redis  # the asynchronous ones, then a synchronous one
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to close
            loop = asyncio.get_running_loop()
            for client in self._clients:
                loop.create_task(client.aclose())
        self._clients = []
        client = self._sync_client()
        try:
            flushed = self.publisher.flush_sync(client)
        finally:
            client.close()
        self.log.info(
            "index.stopped",
            replica=self.replica_id,
            stream=self.settings.domain_stream,
            domain=self.settings.domain or None,
            flushed=flushed,
            outbox=len(self.publisher.outbox),
            visibility_ms=self.consumer.visibility_ms(),
            encode_us=round(
                self.publisher.encode_seconds * 1e6 / max(1, self.publisher.encoded), 1
            ),
            ingest_us=round(self.ingester.seconds * 1e6 / max(1, self.ingester.timed), 1),
            **{k: v for k, v in self.counters.items() if k.startswith("index_")},
        )


def open_index(
    config: Any,
    engine: Engine,
    log: Any,
    counters: dict[str, int],
    upstreams: Sequence[str] = (),
) -> SharedIndex | None:
    """The shared index ``config`` asks for (None without ``index.url``), in the cache
    domain of ``upstreams``. Raises ValueError when they lie in two domains."""
    settings = settings_from(config, upstreams)
    return None if settings is None else SharedIndex(settings, engine, log, counters)


__all__ = [
    "Backoff",
    "Consumer",
    "Health",
    "IndexSettings",
    "Ingester",
    "OriginIngester",
    "Publisher",
    "SharedIndex",
    "open_index",
]
