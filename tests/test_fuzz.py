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
