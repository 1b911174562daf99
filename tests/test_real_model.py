"""A real model behind a real KV-cache fault, crosstalk in enforce mode in front (the
short form of bench/real_model.py): llama-server with the test-only fault of
scripts/llama_fault.py serves Gemma 3 270M; tenants send hand-written support-desk
tickets through ``crosstalk run`` with the real openai SDK. One slot and one client at a
time, so which request gets whose context is the same from run to run.

Judged from the workload's own record (bench/real_model.py's judge), never with the
engine: a faulted answer found is cut before the source's identifiers reach the client
and names the right source, what is missed is only a company (the documented limit:
names cut short, docs/real-model.md; the bench's held-out seed 9 missed none), no clean
answer is cut, and every request gets its answer or crosstalk's error frame.
"""

from __future__ import annotations

import pytest
from conftest import bench_module

real_model = bench_module("real_model")
human_text = real_model.human_text

REQUESTS = 60
SEED = 3  # a seed the detector was not tuned on (tuning: seed 1)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> real_model.Run:
    from faker import Faker

    fake = Faker()
    fake.seed_instance(SEED)
    tenants = human_text.make_tenants(6, fake)
    requests = human_text.make_workload(REQUESTS, tenants, SEED)
    tmp = tmp_path_factory.mktemp("real-model")
    return real_model.run_once(
        tmp, "enforce", requests, tenants, SEED, rate=0.5, slots=1, concurrency=1
    )


@pytest.mark.timeout(1200)
def test_every_request_is_answered_or_cut(run: real_model.Run) -> None:
    assert run.errors == []
    assert set(run.engine) == {r.request_id for r in run.requests}


@pytest.mark.timeout(1200)
def test_the_fault_fired_and_was_recorded(run: real_model.Run) -> None:
    """The ground truth exists: faults happened, across tenants."""
    s = real_model.score(run)
    assert s.faulted - s.same_tenant >= 5


@pytest.mark.timeout(1200)
def test_what_is_found_is_cut_before_it_reaches_the_client(run: real_model.Run) -> None:
    """A detected leak delivers none of the source's identifiers (the holdback), and
    every finding names the right source."""
    s = real_model.score(run)
    assert s.found >= 1, s.missed
    assert s.right_source == s.found
    missed = {rid for rid, _, _ in s.missed}
    assert set(s.delivered_ids) <= missed


@pytest.mark.timeout(1200)
def test_what_is_missed_is_the_documented_limit(run: real_model.Run) -> None:
    """Measured (docs/real-model.md): the misses are company names made of plain words
    or written cut; any other kind of miss is new and fails here."""
    s = real_model.score(run)
    for rid, kinds, private_run in s.missed:
        assert kinds and set(kinds) <= {"company"} and not private_run, (rid, kinds)


@pytest.mark.timeout(1200)
def test_no_clean_answer_is_cut(run: real_model.Run) -> None:
    s = real_model.score(run)
    assert s.clean_flagged == 0, s.flagged_clean


def test_the_judge_reads_values_whole() -> None:
    """The judge's own reading: a value counts whole, not inside a longer number."""
    assert real_model.holds_value("ticket TCK-408172, thanks", "TCK-408172")
    assert not real_model.holds_value("ticket TCK-4081729", "TCK-408172")
    assert real_model.holds_value("Dear  Suzanne\nWoodward", "Suzanne Woodward")
