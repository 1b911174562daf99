"""Keyed records (proxy.engine.records): an engine that replays what another engine
recorded, text-free, makes the same findings as the one that saw the text."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from proxy.engine import Engine, EngineConfig
from proxy.engine.ordered_replay import replay
from proxy.engine.records import OutputRecord, PromptRecord
from proxy.sim.answers import answer_for
from proxy.sim.faults import FaultInjector
from proxy.sim.workload import Workload
from proxy.store.codec import DECODE_ERRORS, from_journal_line, journal_line, pack, unpack

KEY = b"r" * 32


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice((1, 3, 5, 8, 13))
        out.append(text[i : i + n])
        i += n
    return out


def live_traffic(engine: Engine, n: int, seed: int = 5):
    """Workload with fault injection, 4 streams at a time; returns the records in the
    order the engine made them and every finding."""
    rng = random.Random(seed)
    workload = Workload(tenants=8, seed=seed)
    injector = FaultInjector(0.3, seed=seed)
    records: list[PromptRecord | OutputRecord] = []
    findings = []
    canary = engine.register_canary("tenant-03", "CANARY-zq81-VX72-LLPW")
    clock = 1_000_000.0
    requests = list(workload.requests(n))
    for b in range(0, n, 4):
        batch = []
        for req in requests[b : b + 4]:
            clock += 0.1
            prompt = req.prompt_text()
            answer, _ = injector.apply(req.tenant, req.request_id, prompt, answer_for(prompt))
            if req.tenant == "tenant-05" and b % 40 == 0:
                answer += " ref CANARY-zq81-VX72-LLPW"
            scan = engine.observe_prompt(req.tenant, req.request_id, prompt, now=clock)
            records.append(scan.prompt)
            batch.append((req, scan, prompt, answer, pieces(answer, rng)))
        for step in range(max(len(p) for *_, p in batch)):
            for req, scan, _, _, ps in batch:
                if step < len(ps):
                    findings += [(req.request_id, f) for f in scan.feed(ps[step], now=clock)]
        for req, scan, prompt, answer, _ in batch:
            findings += [(req.request_id, f) for f in scan.finish(now=clock)]
            records.append(scan.record())
            injector.remember(req.tenant, req.request_id, prompt, answer)
    return canary, records, findings


def test_replayed_records_give_the_live_findings():
    live = Engine(EngineConfig(key=KEY))
    canary, records, live_findings = live_traffic(live, 400)
    kinds = {f.kind for _, f in live_findings}
    assert {"fragment", "entity", "canary"} <= kinds, kinds  # the test covers all three

    replica = Engine(EngineConfig(key=KEY))
    replayed = list(replay(replica, [canary, *records]))
    assert [(f.request_id, f.finding) for f in replayed] == live_findings
    assert replica.fingerprints == live.fingerprints
    assert replica.observed_requests == live.observed_requests


def test_records_hold_no_text():
    engine = Engine(EngineConfig(key=KEY))
    secret = "Kestrel Halvorsen QX7731 maria.jensen@fjordpost.no"
    scan = engine.observe_prompt("A", "a-1", f"Please handle {secret} today", now=1.0)
    scan.feed(f"Done: {secret}.")
    scan.finish()
    for record in (scan.prompt, scan.record()):
        blob = repr(record).encode() + b"".join(
            v.tobytes() for v in _arrays(record) if isinstance(v, np.ndarray)
        )
        for word in secret.split():
            assert word.encode() not in blob and word.lower().encode() not in blob


def _arrays(record):
    for name in record.__slots__:
        value = getattr(record, name)
        if isinstance(value, tuple):
            for item in value:
                if hasattr(item, "__slots__"):
                    yield from _arrays(item)
        yield value


def same_record(a: object, b: object) -> bool:
    """Field by field; arrays by value and dtype."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)  # type: ignore[attr-defined]
    if dataclasses.is_dataclass(a):
        return all(
            same_record(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(same_record, a, b))  # type: ignore[arg-type]
    return a == b


def test_both_encodings_give_back_every_field_and_the_findings():
    live = Engine(EngineConfig(key=KEY))
    canary, records, live_findings = live_traffic(live, 400)
    output = next(r for r in records if isinstance(r, OutputRecord) and r.choices[0].matches)
    # Offsets of every width: a word 300 characters long (two bytes), an output of
    # 70,000 characters before its first word (four).
    c = output.choices[0]
    long_word = dataclasses.replace(c, starts=c.starts + 300, ends=c.ends + 600)
    far = dataclasses.replace(c, starts=c.starts + 70_000, ends=c.ends + 70_000)
    extra = [dataclasses.replace(output, choices=(choice,)) for choice in (long_word, far)]
    # The origin's judgment of the text its outputs met (what an ingesting replica
    # reads instead of judging it again), and a record of a version before it.
    outputs = [r for r in records if isinstance(r, OutputRecord)]
    assert any(ch.foreign is None for r in outputs for ch in r.choices)  # a leak in it
    assert any(ch.foreign is not None and len(ch.foreign) for r in outputs for ch in r.choices)
    carrier = dataclasses.replace(output, carries=("tenant-1", "tenant-2"))
    before = dataclasses.replace(output, choices=(dataclasses.replace(c, foreign=None),))
    for record in [canary, *records, *extra, before, carrier]:
        assert same_record(unpack(pack(record)), record), record
        assert same_record(from_journal_line(journal_line(record)), record), record
    replica = Engine(EngineConfig(key=KEY))
    replayed = list(replay(replica, [unpack(pack(r)) for r in [canary, *records]]))
    assert [(f.request_id, f.finding) for f in replayed] == live_findings


def test_bytes_that_are_not_a_packed_record_raise_a_decode_error():
    engine = Engine(EngineConfig(key=KEY))
    _, records, _ = live_traffic(engine, 8)
    packed = pack(next(r for r in records if isinstance(r, OutputRecord)))
    arrays_at = 8 + int.from_bytes(packed[4:8], "little")
    wrong_width = packed.replace(b",1]", b",3]", 1)  # offsets neither 1, 2 nor 4 bytes wide
    assert wrong_width != packed
    # packed[:-8]: the last array cut (its padding to 8 bytes is shorter than that)
    for bad in (b"", b"\0ct1", packed[:-8], packed[: arrays_at - 1], wrong_width, b"x" + packed):
        with pytest.raises(DECODE_ERRORS):
            unpack(bad)

    def with_header(change: Callable[[dict[str, Any]], None]) -> bytes:
        header = orjson.loads(packed[8:arrays_at])
        change(header)
        head = orjson.dumps(header)
        head += b" " * (-len(head) % 8)
        return packed[:4] + len(head).to_bytes(4, "little") + head + packed[arrays_at:]

    assert same_record(unpack(with_header(lambda h: None)), unpack(packed))
    hostile: list[Callable[[dict[str, Any]], None]] = [
        lambda h: h["choices"][0].update(w=True),  # would make every unit one character
        lambda h: h["choices"][0].update(n=[-1]),  # would wrap to the last unit
        lambda h: h["choices"][0].update(n=[10**6]),
        lambda h: h["choices"][0].update(b=5),
        lambda h: h["choices"][0].update(q=[[1, 2]]),
        # foreign k-grams an ingesting engine would index by: in order, within the units
        lambda h: h["choices"][0].update(f=[2, 1]),
        lambda h: h["choices"][0].update(f=[1, 1]),
        lambda h: h["choices"][0].update(f=[10**6]),
        lambda h: h["choices"][0].update(f=[-1]),
        lambda h: h.update(cr="alpha"),  # would be five tenants
        lambda h: h.update(cr=[1]),
        lambda h: h.update(time="nan"),
        lambda h: h.update(choices=[{}]),
        lambda h: h.update(t="nothing"),
    ]
    for change in hostile:
        with pytest.raises(DECODE_ERRORS):
            unpack(with_header(change))


def test_packed_arrays_are_aligned_and_units_out_of_order_are_refused():
    engine = Engine(EngineConfig(key=KEY))
    _, records, _ = live_traffic(engine, 8)
    output = next(r for r in records if isinstance(r, OutputRecord))
    for record in records:
        back = unpack(pack(record))
        arrays = [back.units] if isinstance(back, PromptRecord) else [back.choices[0].units]
        assert all(a.flags.aligned for a in arrays)  # compiled code reads them as words
    c = output.choices[0]
    backwards = dataclasses.replace(c, starts=c.starts[::-1].copy(), ends=c.ends[::-1].copy())
    with pytest.raises(ValueError, match="out of order"):
        pack(dataclasses.replace(output, choices=(backwards,)))
