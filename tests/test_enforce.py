"""Enforce mode without a network: the holdback gate, the SSE framer and the exchange
monitor driving a real engine over OpenAI-format streams cut at every chunk size."""

from __future__ import annotations

import gc
import itertools
import time

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.config import ConfigError, load
from proxy.engine import Engine, EngineConfig
from proxy.pipeline.exchange import GC_PAUSES, Enforcement, ExchangeMonitor
from proxy.pipeline.gate import StreamGate
from proxy.protocols.sse import _EVENT_END, SSEFramer

PRIVATE = (
    "Invoice 77120 for Bellwether Marine covers hull repairs at Dock 14 in Gdansk and the "
    "replacement of two Volvo Penta engines billed to Kasia Wrobel"
)


def chunk_event(text: str) -> bytes:
    body = {
        "id": "x",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def sse_stream(words: list[str]) -> bytes:
    return b"".join(chunk_event(w + " ") for w in words) + b"data: [DONE]\n\n"


def monitor(
    engine: Engine, tenant: str, rid: str, prompt: str, *, learning: bool = False, **enforcement
) -> ExchangeMonitor:
    blocked: list[str] = []
    m = ExchangeMonitor(
        route="chat", tenant=tenant, request_id=rid,
        scan=engine.observe_prompt(tenant, rid, prompt, now=1000.0),
        on_findings=lambda *_: None,
        enforcement=Enforcement(**enforcement),
        learning=learning,
        on_block=lambda mon: blocked.append(mon.request_id),
    )  # fmt: skip
    m.start_stream(None)
    m.blocked_calls = blocked
    return m


def feed(m: ExchangeMonitor, data: bytes, size: int) -> bytes:
    out = []
    for i in range(0, len(data), size):
        out += m.on_chunk(data[i : i + size])
    out += m.on_chunk(b"")
    assert all(isinstance(b, bytes) and b for b in out)  # b"" would end the body early
    return b"".join(out)


@pytest.fixture
def engine() -> Engine:
    # PRIVATE holds names ("Kasia Wrobel"), each an entity finding of its own (case
    # identifiers, tests/test_case_identifiers.py); these tests are about fragments.
    e = Engine(EngineConfig(key=b"k" * 32, case_identifiers=False))
    e.observe_prompt("A", "a-1", PRIVATE, now=999.0).finish()
    return e


@pytest.mark.parametrize("size", [1, 7, 64, 100_000])
def test_clean_stream_passes_byte_for_byte(engine, size):
    data = sse_stream(
        ["the", "weather", "in", "Lisbon", "is", "mild", "and", "sunny", "all", "week", "long"] * 4
    )
    m = monitor(engine, "B", f"b-{size}", "weather in Lisbon?")
    assert feed(m, data, size) == data
    assert m.verdict == "clean" and not m.blocked_calls


def test_a_word_the_stream_may_still_continue_is_held_too(engine):
    """Models stream words with the space first (" Tell", " me"): the newest word is not
    finished, hence not scanned, until the next event. It must count in the holdback."""
    words = "Great question here is what the forecast says about Lisbon this week".split()  # noqa: SIM905
    m = monitor(engine, "B", "b-lead", "weather?", holdback_words=4)
    released = []
    for i, w in enumerate(words):
        released += m.on_chunk(chunk_event(w if i == 0 else " " + w))
        received = i + 1
        # released words <= received - holdback: never the newest, unfinished one
        assert len(released) <= max(0, received - 4), (received, released)
    assert len(released) == len(words) - 4


@pytest.mark.parametrize("size", [1, 13, 100_000])
def test_leak_is_cut_before_any_leaked_word_is_released(engine, size):
    lead = [
        "Here",
        "is",
        "the",
        "summary",
        "you",
        "asked",
        "for",
        "about",
        "the",
        "weather",
        "today",
    ]
    data = sse_stream(lead + PRIVATE.split() + ["and", "more", "text", "follows", "here"])
    m = monitor(engine, "B", f"b-{size}", "weather?", holdback_words=16)
    out = feed(m, data, size)
    assert m.verdict == "blocked" and m.blocked_by.source_tenant == "A"
    assert m.blocked_calls == [f"b-{size}"]
    assert b"Bellwether" not in out and b"77120" not in out and b"[DONE]" not in out
    last = out.rsplit(b"data: ", 1)[-1]
    assert orjson.loads(last)["error"]["code"] == "cross_tenant_leak"
    assert out.count(b'"error"') == 1


def test_holdback_zero_releases_leaked_words(engine):
    """Why the holdback exists: without it the first leaked words reach the client."""
    data = sse_stream(["Summary:"] + PRIVATE.split())
    out = feed(monitor(engine, "B", "b-0", "weather?", holdback_words=0), data, 1)
    assert b"Invoice" in out and b'"cross_tenant_leak"' in out


def test_detector_failure_fails_open_or_closed(engine):
    """Failing open, the rest passes unscanned but still parsed: the exchange line
    counts all of the output, not the part before the failure."""
    words = ["a", "perfectly", "clean", "answer", "about", "the", "weather", "in", "Porto"]
    data = sse_stream(words)
    m = monitor(engine, "B", "b-open", "weather?")
    m.scan.feed = lambda *a, **k: 1 / 0
    assert feed(m, data, 11) == data
    assert m.detector_error.startswith("ZeroDivisionError") and m.verdict == "clean"
    assert m.output_chars == sum(len(w) + 1 for w in words) and m.model == "m"
    assert not m.truncated

    m = monitor(engine, "B", "b-closed", "weather?", fail_closed=True)
    m.scan.feed = lambda *a, **k: 1 / 0
    out = feed(m, data, 11)
    assert b'"detector_failed"' in out and m.verdict == "blocked" and m.blocked_calls


def burn(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its CPU time (bounded: a sleep would
    only be the machine not running it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_an_event_whose_parsing_raised_is_released_and_never_parsed_again(engine):
    """A parser that raises mid-stream fails the detector open: the event's bytes are
    released in order with the rest, it is never parsed again, and no delta is counted
    twice. (An ``on_delta`` observer that raises is only switched off: test_shadow_path.)"""
    words = ["a", "clean", "answer", "about", "the", "weather", "in", "Porto"]
    data = sse_stream(words)
    m = monitor(engine, "B", "b-parser", "weather?")
    parser, read = m._parser, []

    class FailingOnce:  # the stream's parser, raising at its third event
        def __getattr__(self, name):
            return getattr(parser, name)

        def feed(self, event):
            read.append(event.data)
            if len(read) == 3:
                raise ValueError("parser read 'Okonkwo'")
            return parser.feed(event)

    m._parser = FailingOnce()
    assert feed(m, data, 1_000) == data
    # the type and the line that raised, never the message (it may quote the text)
    assert m.detector_error.startswith("ValueError at test_enforce.py:"), m.detector_error
    assert "Okonkwo" not in m.detector_error
    assert len(read) == len(set(read)) == len(words) + 1  # each event once, [DONE] too
    assert m.output_chars == sum(len(w) + 1 for w in words) - len("answer ")


def test_a_stream_whose_prompt_was_not_observed_passes_gated_and_unscanned(engine):
    """A failure before the stream (the prompt's observation) leaves it unscanned but
    gated as usual, even failing closed: only a failure while scanning it cuts."""
    words = ["a", "clean", "answer", "about", "the", "weather"]
    data = sse_stream(words)
    m = monitor(engine, "B", "b-unobserved", "weather?", fail_closed=True)
    m.scan, m.detector_error = None, "observe failed"
    assert feed(m, data, 11) == data
    assert m.output_chars == sum(len(w) + 1 for w in words) and not m.blocked_calls


def slowed(call, seconds: float, *, only_with_findings: bool = False, pause=burn):
    def slow(*args, **kwargs):
        found = call(*args, **kwargs)
        if found or not only_with_findings:
            pause(seconds)
        return found

    return slow


def test_a_scan_over_its_time_budget_fails_open_but_what_it_found_still_blocks(engine):
    """A blown budget is a detector failure (``detector_error``; fail open by default),
    but the scan did finish: a leak it found is still cut, not waved through."""
    clean = sse_stream(["a", "perfectly", "clean", "answer", "about", "Porto"] * 3)
    m = monitor(engine, "B", "b-slow", "weather?", budget_ms=5)
    m.scan.feed = slowed(m.scan.feed, 0.02)
    assert feed(m, clean, 40) == clean
    assert "budget" in m.detector_error and m.verdict == "clean"

    leak = sse_stream(["Summary:", *PRIVATE.split(), "and", "more"])
    m = monitor(engine, "B", "b-slow-leak", "weather?", budget_ms=5, holdback_words=16)
    m.scan.feed = slowed(m.scan.feed, 0.02, only_with_findings=True)
    out = feed(m, leak, 10_000)
    assert m.verdict == "blocked" and m.blocked_by.source_tenant == "A"
    assert b"Bellwether" not in out and b'"cross_tenant_leak"' in out


def test_a_scan_late_only_because_the_machine_was_busy_is_no_failure(engine):
    """Over budget on the wall clock but not in CPU time (the process not scheduled,
    as a sleep makes it): the detector did not fail, the stream stays gated."""
    clean = sse_stream(["a", "perfectly", "clean", "answer", "about", "Porto"] * 3)
    m = monitor(engine, "B", "b-busy", "weather?", budget_ms=5, fail_closed=True)
    m.scan.feed = slowed(m.scan.feed, 0.02, pause=time.sleep)
    assert feed(m, clean, 40) == clean
    assert m.detector_error is None and m.verdict == "clean"


def test_garbage_collector_pauses_do_not_count_against_the_time_budget(engine):
    """A collection of a large heap can stop the process for tens of milliseconds inside
    any call, the engine's included: that is not a slow detector, on the wall clock nor,
    when the machine was busy too, in CPU time."""
    clean = sse_stream(["a", "perfectly", "clean", "answer", "about", "Porto"] * 3)
    m = monitor(engine, "B", "b-gc", "weather?", budget_ms=250)
    real_feed = m.scan.feed

    def feed_during_a_pause(*args, **kwargs):
        GC_PAUSES("start", {"generation": 2})  # as gc.callbacks are called
        burn(0.5)  # the collector running: twice the budget
        GC_PAUSES("stop", {"generation": 2})
        time.sleep(0.3)  # and the process not scheduled for longer than the budget
        return real_feed(*args, **kwargs)

    m.scan.feed = feed_during_a_pause
    assert feed(m, clean, 40) == clean
    assert m.detector_error is None and m.verdict == "clean"


def test_the_pause_clock_counts_real_collections():
    before = GC_PAUSES.seconds
    garbage = [[i] for i in range(200_000)]  # enough tracked objects to take a while
    gc.collect()
    del garbage
    assert GC_PAUSES.seconds > before


def test_gate_holds_at_most_n_words_in_order():
    gate = StreamGate(3)
    released = []
    for i, words in enumerate([0, 1, 1, 2, 0, 1, 1]):
        gate.push(b"%d" % i, words)
        released += gate.release()
        assert gate.held_words <= 3
    assert released == [b"0", b"1", b"2", b"3", b"4"] and gate.held_words == 2
    assert released + gate.flush() == [b"%d" % i for i in range(7)]
    big = StreamGate(3)
    big.push(b"checked", 5)  # an event is scanned before it is pushed: never stuck
    assert big.release() == [b"checked"]
    gate.push(b"x", 1)
    gate.cut()
    assert gate.release() == [] and gate.flush() == [] and gate.cut_done


@pytest.mark.parametrize("chunk_type", [bytes, bytearray, memoryview])
def test_framer_keeps_bytes_and_event_boundaries(chunk_type):
    """Any cut, empty chunks between, and the buffer types a server's chunks come in."""
    data = b"data: a\r\n\r\n: ping\n\ndata: b\rdata: c\r\r" + b"data: d\n\n"
    for size in range(1, len(data) + 1):
        f, events = SSEFramer(), []
        for i in range(0, len(data), size):
            events += f.feed(chunk_type(data[i : i + size]))
            assert f.feed(chunk_type(b"")) == []
        assert all(type(event) is bytes for event in events)
        assert b"".join(events) + f.close() == data
        assert events == [b"data: a\r\n\r\n", b": ping\n\n", b"data: b\rdata: c\r\r",
                          b"data: d\n\n"]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b": p", b" "]), max_size=60),
    st.lists(st.integers(1, 12), min_size=1, max_size=20),
)
def test_framer_cuts_any_chunking_as_the_pattern_cuts_the_whole(pieces, sizes):
    data = b"".join(pieces)
    held = data.endswith(b"\r")  # a last "\r" waits for a "\n" that may follow
    ends = [m.end() for m in _EVENT_END.finditer(data, 0, len(data) - held)]
    expected = [data[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    f, events, i = SSEFramer(), [], 0
    for size in itertools.cycle(sizes):
        if i >= len(data):
            break
        events += f.feed(data[i : i + size])
        i += size
    assert events == expected
    assert b"".join(events) + f.close() == data


def test_policy_by_tenant_and_route():
    cfg = load(
        None,
        proxy__mode="shadow",
        policy__routes={"/v1/completions": {"mode": "enforce", "min_foreign_words": 12}},
        policy__tenants={"bank": {"mode": "enforce", "holdback_words": 24}},
    )
    assert cfg.policy_for("bank", "/v1/chat/completions").mode == "enforce"
    assert cfg.policy_for("bank", "/v1/chat/completions").holdback_words == 24
    assert cfg.policy_for("shop", "/v1/chat/completions").mode == "shadow"
    routed = cfg.policy_for("shop", "/v1/completions?x=1")
    assert routed.mode == "enforce" and routed.min_foreign_words == 12
    with pytest.raises(ConfigError, match="policy.tenants"):
        load(None, policy__tenants={"x": {"mode": "block"}})


def test_learning_engine_logs_fragments_but_still_blocks_entities(engine):
    """A fresh engine (policy.learn_requests not reached) does not yet know the
    deployment's boilerplate: its fragment findings are logged, not blocked. An entity
    is specific enough to block from the start."""
    data = sse_stream(["Summary:"] + PRIVATE.split())
    m = monitor(engine, "B", "b-learn", "weather?", learning=True)
    assert feed(m, data, 9) == data
    assert m.findings and m.verdict == "leak" and not m.blocked_calls

    engine.observe_prompt("A", "a-2", "Mail me at kasia.wrobel@bellwether-marine.pl", now=999.5)
    data = sse_stream(["You", "can", "write", "to", "kasia.wrobel@bellwether-marine.pl", "today"])
    m = monitor(engine, "C", "c-learn", "contact?", learning=True)
    out = feed(m, data, 9)
    assert m.verdict == "blocked" and m.blocked_by.kind == "entity"
    assert b"bellwether-marine" not in out


def test_learned_request_count_survives_a_restart(tmp_path):
    first = Engine(EngineConfig(key=b"k" * 32))
    for i in range(5):
        first.observe_prompt("A", f"a-{i}", f"question number {i}", now=1000.0 + i)
    first.save_commonness(tmp_path / "state.npz")
    second = Engine(EngineConfig(key=b"k" * 32))
    second.load_commonness(tmp_path / "state.npz")
    assert second.observed_requests == 5
    with pytest.raises(ValueError, match="made with key"):
        Engine(EngineConfig(key=b"x" * 32)).load_commonness(tmp_path / "state.npz")


def test_one_tenant_repeating_itself_across_restarts_stays_private(tmp_path):
    """The commonness sketch counts distinct tenants, and it is saved across restarts:
    a tenant sending the same private text after each restart must not become "three
    tenants" (the pair filter remembers who was counted)."""
    state = tmp_path / "state.npz"
    for restart in range(4):
        e = Engine(EngineConfig(key=b"k" * 32))
        if state.exists():
            e.load_commonness(state)
        e.observe_prompt("A", f"a-{restart}", PRIVATE, now=1000.0 + restart).finish()
        e.save_commonness(state)
    data = sse_stream(["Summary:", *PRIVATE.split()])
    m = monitor(e, "B", "b-1", "weather?")
    feed(m, data, 9)
    assert m.blocked_by is not None and m.blocked_by.source_tenant == "A"


def test_a_pair_filter_of_another_bit_layout_is_not_loaded(tmp_path):
    """A state file from before the pair filter's layout 2 (no ``pairs_layout``) keeps
    its sketch and vocabulary, but its pair bits would answer for other pairs: the
    filter starts empty. A file of this layout loads them."""
    import numpy as np

    first = Engine(EngineConfig(key=b"k" * 32))
    first.observe_prompt("A", "a-0", PRIVATE, now=1000.0).finish()
    first.save_commonness(tmp_path / "state.npz")
    saved = [bytes(g) for g in first.pairs.generations]
    assert any(saved[0])  # bytes: set bits
    same = Engine(EngineConfig(key=b"k" * 32))
    same.load_commonness(tmp_path / "state.npz")
    assert [bytes(g) for g in same.pairs.generations] == saved
    with np.load(tmp_path / "state.npz") as data:
        older = {name: data[name] for name in data.files if name != "pairs_layout"}
    np.savez(tmp_path / "older.npz", **older)
    upgraded = Engine(EngineConfig(key=b"k" * 32))
    upgraded.load_commonness(tmp_path / "older.npz")
    assert not any(b"".join(bytes(g) for g in upgraded.pairs.generations))
    assert upgraded.observed_requests == 1  # the rest of the file still loads


def test_every_engine_parameter_in_the_config_reaches_the_engine():
    """[detection] carries the engine's tuning; none may be silently dropped."""
    import dataclasses

    from proxy.config import DetectionSection

    overrides = {
        f.name: getattr(EngineConfig(), f.name) + 1
        for f in dataclasses.fields(DetectionSection)
        if f.name in {g.name for g in dataclasses.fields(EngineConfig)}
        and type(getattr(EngineConfig(), f.name)) in (int, float)
    }
    assert {"exclusive", "plain_share", "containment", "k"} <= set(overrides)
    engine_config = load(
        None, **{f"detection__{k}": v for k, v in overrides.items()}
    ).engine_config()
    assert {k: getattr(engine_config, k) for k in overrides} == overrides


def capped(engine: Engine, rid: str, cap: int) -> ExchangeMonitor:
    m = monitor(engine, "B", rid, "weather?", holdback_words=16)
    m.max_scan_chars = cap
    return m


@pytest.mark.parametrize("size", [1, 13, 100_000])
def test_the_scan_cap_never_lets_a_found_leak_through(engine, size):
    """Past ``max_scan_chars`` enforce mode stops holding words back, but first checks
    the words it holds: wherever the cap falls, a stream is either blocked before any
    leaked word went out, or passed byte for byte with every character counted."""
    lead = "Here is the summary you asked for about the weather today".split()  # noqa: SIM905
    words = lead + PRIVATE.split() + ["and", "more", "text", "follows", "here"]
    data, text = sse_stream(words), " ".join(words) + " "
    outcomes = set()
    for cap in range(40, 160, 3):
        m = capped(engine, f"b-{size}-{cap}", cap)
        out = feed(m, data, size)
        if m.verdict == "blocked":
            assert b"Bellwether" not in out and b"77120" not in out, cap
            assert out.count(b'"cross_tenant_leak"') == 1
        else:
            assert out == data and m.output_chars == len(text) and not m.truncated, cap
            assert m.scan_capped
        outcomes.add(m.verdict)
    assert outcomes == {"blocked", "clean"}  # caps before the leak let it pass, unscanned
