"""The shadow path of a streamed response (compiled: proxy/pipeline/_monitor.pyx), held
to what it must do whatever the chunking: every delta counted and shown to ``on_delta``
in order, the output scanned in order (a call a delta, or batches of
``scan_batch_chars``: no more calls than that makes), nothing past ``max_scan_chars``
scanned, a failing scan stopping the scan and not the count."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.pipeline._monitor import MonitorFields, expose
from proxy.pipeline.exchange import ExchangeMonitor


class RecordingScan:
    """A ``ResponseScan`` stand-in: records what it is fed; raises once, at feed
    ``fail_at`` (a feed after that is recorded: the monitor must make none)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fed: list[tuple[int, str]] = []
        self.finished = False
        self.fail_at = fail_at
        self.output_words = 0.0

    def feed(self, text: str, choice: int = 0) -> list:
        if len(self.fed) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("engine failed")
        self.fed.append((choice, text))
        return []

    def finish(self, now: float | None = None) -> list:
        self.finished = True
        return []


def event(choice: int, text: str) -> bytes:
    body = {"model": "m", "choices": [{"index": choice, "delta": {"content": text}}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    return [body[a:b] for a, b in zip(points, points[1:], strict=False)]


deltas = st.lists(
    st.tuples(st.integers(0, 1), st.text(st.sampled_from("ab é\n"), max_size=9)),
    min_size=1,
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(
    deltas=deltas,
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
    batch=st.sampled_from([0, 1, 8, 64]),
    cap=st.sampled_from([0, 5, 40]),
    fail_at=st.one_of(st.none(), st.integers(0, 3)),
)
def test_every_chunking_counts_and_scans_the_same_output(deltas, cuts, batch, cap, fail_at):
    scan = RecordingScan(fail_at)
    seen: list[tuple[int, str]] = []
    m = ExchangeMonitor(
        route="chat", tenant="t", request_id="r", scan=scan,
        on_findings=lambda *_: None, scan_batch_chars=batch, max_scan_chars=cap,
        keep_text=True,
    )  # fmt: skip
    m.on_delta = lambda choice, text: seen.append((choice, text))
    m.start_stream(None)
    body = b"".join(event(c, t) for c, t in deltas) + b"data: [DONE]\n\n"
    for chunk in split(body, cuts):
        assert m.on_chunk(chunk) == [chunk]
    assert m.on_chunk(b"") == []

    sent = [(c, t) for c, t in deltas if t]
    total = sum(len(t) for _, t in sent)
    assert seen == sent
    assert m.output_chars == total and not m.truncated
    for choice in (0, 1):
        assert "".join(m._texts.get(choice, [])) == "".join(t for c, t in sent if c == choice)
    # What the scan got: the output in order, up to the cap, per choice.
    scanned = sent
    if cap:
        scanned, room = [], cap
        for c, t in sent:
            scanned.append((c, t[:room]))
            room = max(0, room - len(t))
    scanned = [(c, t) for c, t in scanned if t]
    if m.detector_error is not None:  # the scan stopped at the failure; the count went on
        assert m.detector_error.startswith("RuntimeError at "), m.detector_error
        assert len(scan.fed) == fail_at and scan.fail_at is None and not scan.finished
        return
    assert scan.finished and m.scan_capped == bool(cap and total > cap)
    for choice in (0, 1):
        fed = [t for c, t in scan.fed if c == choice]
        assert "".join(fed) == "".join(t for c, t in scanned if c == choice)
    if not batch:
        assert scan.fed == scanned  # a call a delta
    else:  # a batch is fed once it holds enough (each choice's part), and at the end
        batches = sum(len(t) for _, t in scanned) // batch + 1
        assert len(scan.fed) <= 2 * batches


def test_a_monitor_field_declared_without_a_default_is_refused():
    # The dataclass would take the C field's descriptor for its default: a silent bug.
    with pytest.raises(TypeError, match="on_delta: a field of MonitorFields needs a default"):

        @expose
        @dataclass
        class Monitor(MonitorFields):
            on_delta: object

    @expose
    @dataclass
    class Fine(MonitorFields):
        on_delta: object = None

    assert Fine().on_delta is None and Fine(on_delta=print).on_delta is print


def test_an_observer_that_raises_is_switched_off_and_the_scan_goes_on():
    scan = RecordingScan()
    m = ExchangeMonitor(
        route="chat", tenant="t", request_id="r", scan=scan, on_findings=lambda *_: None
    )
    seen: list[str] = []

    def observer(choice: int, text: str) -> None:
        seen.append(text)
        if text == "two ":
            raise ValueError("the observer's own bug")

    m.on_delta = observer
    m.start_stream(None)
    m.on_chunk(b"".join(event(0, w) for w in ("one ", "two ", "three ")))
    m.on_chunk(b"")
    assert seen == ["one ", "two "] and m.on_delta is None
    assert m.detector_error is None and scan.finished
    assert "".join(t for _, t in scan.fed) == "one two three " and m.output_chars == 14
