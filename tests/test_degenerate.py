"""Degenerate-output signal (proxy/engine/degenerate.py, proxy/mitm/degenerate_addon.py).

Library tests: each reason trips on the simulator's garbage and on hand-made cases, at
any delta cut; clean answers (the simulator's prose, code, CJK; hand-written text in a
dozen scripts, tables, trees, math, emoji) never trip; the sliding rate window. Then
through mitmdump: ``output.degenerate`` events for forced degenerate faults, streamed
and not, with the answer delivered untouched (never blocking, even in enforce mode).
"""

from __future__ import annotations

import random

import openai
import pytest
from conftest import bench_module, run_mitmdump, wait_for_events

from proxy.engine.degenerate import DegenerateDetector, RateWindow
from proxy.sim.answers import answer_for
from proxy.sim.faults import degenerate_text
from proxy.sim.workload import Workload

corpus = bench_module("degenerate_corpus")


def run(text: str, rng: random.Random, sizes=(1, 2, 3, 5, 8, 13)) -> str | None:
    detector = DegenerateDetector()
    i = 0
    while i < len(text):
        n = rng.choice(sizes)
        if detector.feed(text[i : i + n]):
            return detector.reason
        i += n
    detector.finish()
    return detector.reason


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("Here is the answer: " + "the the " * 12, "repetition"),
        ("Sure, " * 20, "repetition"),
        ("我们来看看。" + "的的" * 12, "repetition"),
        ("Step one. and then " * 1 + "and then " * 12, "repetition"),
        ("The result is ѮѯѰѱ҂ ⴰⴱⴲⴳᚠᚡᚢ ꓐꓑꓒ and more", "mixed_scripts"),
        ("The answer is 42 <|endoftext|> <unk> 0x1f2e", "token_artifacts"),
        ("Result: \ufffd\ufffd ok \ufffd", "replacement_chars"),
    ],
)
def test_each_reason(text, reason):
    for seed in range(5):
        assert run(text, random.Random(seed)) == reason


def test_simulator_garbage_is_detected():
    rng = random.Random(3)
    prompts = [r.prompt_text() for r in Workload(tenants=24, seed=5).requests(300)]
    missed = 0
    for prompt in prompts:
        text, _, _, _ = degenerate_text(answer_for(prompt), rng)
        missed += run(text, rng) is None
    assert missed <= 3  # measured: 1 in 3,000 (bench/quality.py reports the rate)


def test_clean_answers_never_trip():
    rng = random.Random(4)
    for req in Workload(tenants=24, seed=6).requests(600):
        answer = answer_for(req.prompt_text())
        assert run(answer, rng) is None, answer[:200]
    for name, text in corpus.MULTILINGUAL.items():
        for seed in range(3):
            assert run(text, random.Random(seed)) is None, name
    for _ in range(300):
        table = corpus.markdown_table(rng)
        assert run(table, rng) is None, table


def test_trips_once_and_keeps_no_text():
    detector = DegenerateDetector()
    reasons = [detector.feed("loop ") for _ in range(40)]
    assert [r for r in reasons if r] == ["repetition"]
    assert detector.finish() is None and detector.reason == "repetition"
    assert not hasattr(detector, "__dict__")  # slots: the recent units and counts only


def test_rate_window_slides():
    window = RateWindow(window_seconds=60, buckets=6, max_keys=2)
    for i in range(10):
        window.add("up-a", degenerate=i < 2, now=100.0)
    assert window.counts(now=100.0)["up-a"] == (2, 10)
    assert window.rate("up-a", now=100.0) == pytest.approx(0.2)
    window.add("up-a", degenerate=True, now=150.0)
    assert window.counts(now=150.0)["up-a"] == (3, 11)
    assert window.counts(now=165.0)["up-a"] == (1, 1)  # the first bucket fell out
    assert window.rate("up-a", now=1000.0) == 0.0
    window.add("up-b", False, now=1000.0)
    window.add("up-c", False, now=1000.0)  # over max_keys: the least recent is dropped
    assert set(window.counts(now=1000.0)) == {"up-b", "up-c"}


@pytest.mark.parametrize("mode", ["shadow", "enforce"])
def test_degenerate_events_through_the_proxy(tmp_path, sim, mode):
    with run_mitmdump(tmp_path, sim.url, f"crosstalk_mode={mode}") as proxy:
        expected = {}
        for i, (fault, stream) in enumerate(
            [("degenerate", True), ("degenerate", False), (None, True), (None, False)] * 2
        ):
            rid = f"deg-{mode}-{i}"
            headers = {"X-Tenant-ID": f"t{i % 3}", "X-Request-ID": rid}
            if fault:
                headers["x-sim-fault"] = fault
            c = openai.OpenAI(
                base_url=f"{proxy.url}/v1", api_key="k", max_retries=0, default_headers=headers
            )
            messages = [{"role": "user", "content": f"Explain item {i} of the invoice."}]
            if stream:
                text = "".join(
                    ch.choices[0].delta.content or ""
                    for ch in c.chat.completions.create(model="m", messages=messages, stream=True)
                    if ch.choices
                )
            else:
                text = c.chat.completions.create(model="m", messages=messages)
                text = text.choices[0].message.content
            assert text  # delivered, never blocked
            expected[rid] = fault is not None
        events = wait_for_events(
            proxy.log, lambda ev: sum(e["event"] == "exchange" for e in ev) >= len(expected)
        )
        flagged = {e["request_id"]: e for e in events if e["event"] == "output.degenerate"}
        assert set(flagged) == {rid for rid, bad in expected.items() if bad}
        for e in flagged.values():
            assert e["reason"] in ("repetition", "mixed_scripts", "token_artifacts")
            assert e["tenant"].startswith("t") and e["upstream"].endswith(f":{sim.port}")
            assert set(e) == {
                "request_id", "tenant", "reason", "upstream", "choice", "output_chars",
                "event", "level", "ts",
            }  # fmt: skip
        verdicts = {e["request_id"]: e["verdict"] for e in events if e["event"] == "exchange"}
        assert all(verdicts[rid] != "blocked" for rid in expected)
