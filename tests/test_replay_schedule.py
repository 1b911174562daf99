"""The replayer's clock: every record's steps run in recorded time order across records,
equal times in the order they were queued, as a plain heap of pending steps runs them
(the model below). The replayer lets a step run on without the heap when it is due
first anyway; that must never change the order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.forensics.replayer import Replayer

Log = list[tuple[str, float]]


@dataclass
class Scripted:
    """A record whose steps wait the given delays (0 included: ties) and log each run."""

    name: str
    time: float
    delays: list[float]
    log: Log

    @property
    def position(self) -> str:
        return self.name

    def steps(self, replayer: Replayer | None) -> Iterator[float]:
        when = self.time
        self.log.append((self.name, when))
        for delay in self.delays:
            when += delay
            yield when
            self.log.append((self.name, when))


def modelled(records: list[Scripted]) -> Log:
    """The order a heap of (time, queue order) runs the steps in: each record's first
    step when the input reaches it, after every pending step due by then."""
    log: Log = []
    pending: list[tuple[float, int, Iterator[float]]] = []
    seq = itertools.count()

    def resume(steps: Iterator[float]) -> None:
        when = next(steps, None)
        if when is not None:
            heapq.heappush(pending, (when, next(seq), steps))

    for record in records:
        while pending and pending[0][0] <= record.time:
            resume(heapq.heappop(pending)[2])
        resume(Scripted(record.name, record.time, record.delays, log).steps(None))
    while pending:
        resume(heapq.heappop(pending)[2])
    return log


class NoSink:
    def failure(self, position: str, reason: str) -> None:
        raise AssertionError(f"{position}: {reason}")


delays = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 3.0]), max_size=6)


@given(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0]), delays), max_size=6))
@settings(max_examples=300)
def test_steps_run_in_time_order_ties_in_queue_order(inputs):
    records, start = [], 0.0
    for i, (gap, steps) in enumerate(inputs):
        start += gap
        records.append(Scripted(f"r{i}", start, steps, []))
    log: Log = []
    replayer = Replayer(None, None, None, NoSink())  # type: ignore[arg-type]
    replayer.run(Scripted(r.name, r.time, r.delays, log) for r in records)
    assert log == modelled(records)
    assert [when for _, when in log] == sorted(when for _, when in log)
