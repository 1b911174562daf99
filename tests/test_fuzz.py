"""A bounded fuzz run of every parser that reads outside input (tests/fuzz_targets.py):
no exception but the documented ones. bench/fuzz.py runs the same targets longer."""

from __future__ import annotations

import contextlib

import pytest
from fuzz_targets import TARGETS, Target
from hypothesis import HealthCheck, given, settings


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_parser_fails_only_the_documented_way(target: Target) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(target.inputs)
    def run(data) -> None:
        with contextlib.suppress(*target.allowed):
            target.call(data)

    run()


# Inputs the fuzzers found that crashed a parser once (bench/fuzz.py, 2026-12-01): a
# non-string "type" reached a set or dict lookup (TypeError: unhashable type: 'list').
REGRESSIONS = [
    ("responses.responses.stream", (b'data: {"type": [null]}\n\n', 0)),
    ("anthropic.messages.stream", (b'data: {"type": "content_block_delta", "delta": {"type": [1]}}\n\n', 0)),
    ("anthropic.messages.stream", (b'data: {"type": "content_block_start", "content_block": {"type": {}}}\n\n', 0)),
    ("openai.chat.request", b'{"messages": [{"role": "user", "content": [{"type": [1]}]}]}'),
    ("responses.responses.request", b'{"input": [{"type": [1]}, {"type": "message", "content": [{"type": []}]}]}'),
    ("anthropic.messages.request", b'{"messages": [{"role": "user", "content": [{"type": [2]}]}]}'),
    # A string literal with a broken escape in an engine log: ast.literal_eval raised
    # SyntaxError (the repr reader now decodes escapes itself).
    ("pyrepr", "f(text='\\u', rid='r')"),
    ("sglang_reader", b"[2026-05-04 10:15:02] Receive: obj=GenerateReqInput(rid='r', text={'\\u'x', a=1)\n"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "data"), REGRESSIONS)
def test_crashes_found_by_fuzzing_stay_fixed(name: str, data) -> None:
    target = next(t for t in TARGETS if t.name == name)
    with contextlib.suppress(*target.allowed):
        target.call(data)
