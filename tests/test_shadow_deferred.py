"""Shadow mode defers the engine's work (proxy/mitm/idle.py): chunks go out at once, the
scan runs later in order, and what reads the outcome waits for it."""

from __future__ import annotations

from collections.abc import Generator

from test_enforce import PRIVATE, chunk_event, sse_stream

from proxy.engine import Engine, EngineConfig
from proxy.pipeline.exchange import ExchangeMonitor

# PRIVATE holds names, each an entity finding of its own (case identifiers); the engines
# here leave them out: these tests are about when fragment work runs.


def shadow_monitor(engine: Engine, deferred: list, findings: list) -> ExchangeMonitor:
    m = ExchangeMonitor(
        route="chat", tenant="B", request_id="b-1", scan=None,
        on_findings=lambda _, found: findings.extend(found),
        scan_batch_chars=64,
    )  # fmt: skip
    m.pending_observe = lambda: setattr(
        m, "scan", engine.observe_prompt("B", "b-1", "what is new", now=1000.0)
    )
    pushed = [0]

    def defer(fn, *args):  # as IdleQueue.push, counting the items queued
        pushed[0] += 1
        deferred.append((fn, args))

    m.defer, m.deferred_count = defer, lambda: pushed[0]
    deferred.append((m.observe_steps, ()))  # as the addon queues it at the request
    m.start_stream(None)
    return m


def run(deferred: list) -> None:
    """Run the deferred items in order, a generator item to its end (as the idle queue
    does, one step per turn, nothing overtaking it)."""
    while deferred:
        fn, args = deferred.pop(0)
        result = fn(*args)
        if isinstance(result, Generator):
            for _ in result:
                pass


def b_after_a_private_prompt() -> tuple[list, list, ExchangeMonitor]:
    """Tenant B's shadow monitor on an engine that holds tenant A's private prompt:
    (its deferred items, its findings, the monitor)."""
    engine = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    engine.observe_prompt("A", "a-1", PRIVATE, now=999.0).finish()
    deferred: list = []
    findings: list = []
    return deferred, findings, shadow_monitor(engine, deferred, findings)


def test_chunks_pass_at_once_and_the_leak_is_found_when_the_work_runs():
    deferred, findings, m = b_after_a_private_prompt()
    body = sse_stream(PRIVATE.split())
    out = [piece for i in range(0, len(body), 50) for piece in m.on_chunk(body[i : i + 50])]
    out += m.on_chunk(b"")
    assert b"".join(out) == body  # forwarded untouched, before any scan
    assert m.output_chars == 0 and m.scan is None and findings == []  # not even parsed
    assert len(deferred) == 2  # the prompt's observation, then one item for all chunks
    settled: list[str] = []
    m.when_settled(lambda: settled.append(m.verdict))
    run(deferred)
    assert [(f.kind, f.source_tenant, f.source_request_id) for f in findings] == [
        ("fragment", "A", "a-1")
    ]
    assert settled == ["leak"]  # ran after the scan, saw its outcome
    assert m.output_chars == len(" ".join(PRIVATE.split())) + 1
    assert m.scan.finished and m.detector_error is None


def test_a_failure_in_a_batched_scan_still_counts_the_whole_chunk():
    """The engine fails on the first batch of a chunk that holds the whole answer: the
    rest of its events are still parsed (counts, end of stream), never scanned."""
    engine = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    deferred: list = []
    m = shadow_monitor(engine, deferred, [])
    run(deferred[:1])  # the prompt is observed
    del deferred[0]
    m.scan.feed = None  # the engine breaks: calling it raises TypeError
    words = ["hello"] * 40
    m.on_chunk(sse_stream(words))
    m.on_chunk(b"")
    run(deferred)
    assert m.detector_error is not None and "TypeError" in m.detector_error
    assert m.output_chars == sum(len(w) + 1 for w in words) and not m.truncated


def test_a_deferred_failure_fails_open_and_is_reported():
    engine = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    deferred: list = []
    m = shadow_monitor(engine, deferred, [])
    m.on_chunk(sse_stream(["hello"] * 40))
    run(deferred[:1])  # the prompt is observed
    deferred.pop(0)
    m.scan.feed = None  # the engine breaks: calling it raises TypeError
    assert m.on_chunk(b"data: [DONE]\n\n") == [b"data: [DONE]\n\n"]
    m.on_chunk(b"")
    run(deferred)
    assert m.detector_error is not None and "TypeError" in m.detector_error
    assert m.verdict == "clean"


def test_an_exchange_that_errors_mid_stream_is_settled_after_its_last_scan():
    """The error hook's settle closes the monitor: the scan that closing starts runs in
    the same queued item, before the log reads the verdict."""
    deferred, findings, m = b_after_a_private_prompt()
    body = sse_stream(PRIVATE.split())
    m.on_chunk(body[: body.rfind(b"data: [DONE]")])  # the upstream drops: no end of body
    settled: list[str] = []
    m.when_settled(lambda: (m.close(), settled.append((m.verdict, m.scan.finished))))
    run(deferred)
    assert settled == [("leak", True)] and m.truncated


def test_queued_chunks_are_parsed_one_per_step_and_late_ones_join_the_item():
    """The idle queue runs a step per turn: one chunk's work holds the event loop, not a
    backlog; a chunk that arrives before the item is done is handled by it."""
    engine = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    deferred: list = []
    m = shadow_monitor(engine, deferred, [])
    run(deferred[:1])  # the prompt's observation
    del deferred[0]
    events = [chunk_event(w + " ") for w in ("alpha", "beta", "gamma")]
    m.on_chunk(events[0])
    m.on_chunk(events[1])
    assert len(deferred) == 1
    fn, args = deferred.pop()
    steps = fn(*args)
    next(steps)
    assert m.output_chars == len("alpha ")
    m.on_chunk(events[2])
    assert deferred == []  # joins the item under way
    assert list(steps) == [None] and m.output_chars == len("alpha beta gamma ")


def test_a_chunk_never_overtakes_work_queued_before_it_arrived():
    """A chunk joins its exchange's queued item only while nothing else was queued after
    that item: a prompt that came in between is observed before the later chunk is
    scanned (else a leak of that prompt in the chunk goes unseen, and the journal's
    replay, which keeps the order of arrival, disagrees with what was logged live)."""
    engine = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    deferred: list = []
    findings: list = []
    m = shadow_monitor(engine, deferred, findings)
    run(deferred[:1])
    del deferred[0]
    m.on_chunk(chunk_event("Summary: "))
    m.defer(lambda: engine.observe_prompt("A", "a-1", PRIVATE, now=1000.5).finish())
    for word in PRIVATE.split():
        m.on_chunk(chunk_event(word + " "))
    m.on_chunk(b"data: [DONE]\n\n")
    m.on_chunk(b"")
    assert len(deferred) == 3  # B's first chunk, A's prompt, B's later chunks
    run(deferred)
    assert [(f.kind, f.source_request_id) for f in findings] == [("fragment", "a-1")]


def test_findings_made_while_the_engine_learns_say_so_in_shadow_mode_too():
    """Shadow mode blocks nothing, but a fresh engine's false alarms (its cold start)
    must be tellable from the rest: the leak.detected fields carry learning: true."""
    for learning in (True, False):
        deferred, findings, m = b_after_a_private_prompt()
        m.learning = learning
        for piece in (sse_stream(PRIVATE.split()), b""):
            m.on_chunk(piece)
        run(deferred)
        fields = m.leak_fields(findings[0])
        assert fields["action"] == "logged" and fields.get("learning", False) is learning
