"""Replays keyed records through an engine in the order the live engine made them.

The live engine numbers every prompt and every feed of a scan (``Engine.tick``);
records carry those numbers, but come out in the order exchanges *finish*. The replayer
holds each record's steps in a heap and runs them in sequence order once the records'
low water marks show that nothing earlier can still arrive. Memory is bounded by the
exchanges that were in flight together, not by the length of the input.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from proxy.engine.detector import Engine, Finding, ResponseScan
from proxy.engine.records import CanaryRecord, ChoiceRecord, OutputRecord, PromptRecord, Record

# What the heap holds: a prompt, a canary, or one feed of an output's choice.
_Step = PromptRecord | CanaryRecord | tuple[OutputRecord, ChoiceRecord, int]


class ReplayedFinding(NamedTuple):
    tenant: str  # the victim
    request_id: str
    time: float
    finding: Finding


class RecordReplayer:
    """Feed records with ``push`` (any order within the low water marks), then
    ``close``; each returns the findings of the steps it ran."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._heap: list[tuple[int, int, int, _Step]] = []
        self._ties = itertools.count()
        self._scans: dict[int, ResponseScan] = {}  # prompt seq -> scan
        self.records = 0

    def push(self, record: Record) -> list[ReplayedFinding]:
        self.records += 1
        if isinstance(record, OutputRecord):
            for choice in record.choices:
                for i, seq in enumerate(choice.seqs.tolist()):
                    self._add(seq, choice.choice, (record, choice, i))
            return self._run_below(record.low_water)
        if isinstance(record, PromptRecord):
            self._add(record.seq, -1, record)
            return self._run_below(record.low_water)
        self._add(record.seq, -1, record)
        return []

    def close(self) -> list[ReplayedFinding]:
        """Run everything still held (the input ended)."""
        found = self._run_below(None)
        self._scans.clear()
        return found

    def _forget_before(self, horizon: float) -> None:
        """Drop scans whose output never came (the exchange failed, or its record was
        lost) once their prompt left the window: the dict is in prompt order."""
        scans = self._scans
        while scans:
            seq, scan = next(iter(scans.items()))
            if scan.prompt.time >= horizon:
                break
            del scans[seq]

    def _add(self, seq: int, order: int, step: _Step) -> None:
        heapq.heappush(self._heap, (seq, order, next(self._ties), step))

    def _run_below(self, low_water: int | None) -> list[ReplayedFinding]:
        found: list[ReplayedFinding] = []
        heap = self._heap
        while heap and (low_water is None or heap[0][0] < low_water):
            _, _, _, step = heapq.heappop(heap)
            found += self._run(step)
        return found

    def _run(self, step: _Step) -> list[ReplayedFinding]:
        if isinstance(step, PromptRecord):
            self._scans[step.seq] = self.engine.ingest_prompt(step)
            self._forget_before(step.time - self.engine.config.window_seconds)
            return []
        if isinstance(step, CanaryRecord):
            self.engine.ingest_canary(step)
            return []
        record, choice, i = step
        scan = self._scans.get(record.prompt_seq)
        if scan is None:
            return []  # its prompt was not in the input
        findings = scan.replay_step(record, choice, i)
        if scan.finished:
            del self._scans[record.prompt_seq]
        return [ReplayedFinding(record.tenant, record.request_id, record.time, f) for f in findings]


def replay(engine: Engine, records: Iterable[Record]) -> Iterator[ReplayedFinding]:
    """Every finding of ``records`` replayed through ``engine``, in live order."""
    replayer = RecordReplayer(engine)
    for record in records:
        yield from replayer.push(record)
    yield from replayer.close()


__all__ = ["ChoiceRecord", "RecordReplayer", "ReplayedFinding", "replay"]
