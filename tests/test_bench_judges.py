"""The benches' judges fail what misses (issue 44: a bench that prints more than it
judges passes a broken build). Each judge is given a result that misses one target."""

from __future__ import annotations

import dataclasses

from conftest import bench_module

producer_replay = bench_module("producer_replay")  # puts bench/ on sys.path first
replay = bench_module("replay")


def journal(**changes):
    good = replay.JournalResult(
        requests=80, exchanges=80, live_findings=9, segments=1, journal_bytes=1, journal_bytes_uncompressed=1,
        bytes_per_exchange=1.0, bytes_per_exchange_uncompressed=1.0, replay_wall_s=1.0, replay_cpu_s=1.0,
        replay_peak_rss_mb=1.0, replayed_seconds=1.0, replay_findings=9, same_findings=True, returncode=1,
    )  # fmt: skip
    return dataclasses.replace(good, **changes)


def test_the_journal_judge():
    assert replay.journal_misses(journal()) == []
    assert replay.journal_misses(journal(same_findings=False, replay_findings=7))
    assert replay.journal_misses(journal(errors=["client: connection reset"]))
    assert replay.journal_misses(journal(returncode=2))
    assert replay.journal_misses(journal(exchanges=0))


def producer_row(**changes):
    good = producer_replay.Row(
        variant="v", replayable=True, exchanges=400, returncode=1, complete=400, found_of_reference=28,
        reference=28, relative_recall=1.0, clean_flagged=0, reference_clean_flagged=0, reason="", seconds=1.0,
    )  # fmt: skip
    return dataclasses.replace(good, **changes)


def test_the_producer_judge():
    assert producer_replay.misses([producer_row()]) == []
    assert producer_replay.misses([producer_row(relative_recall=0.9, found_of_reference=25)])
    assert producer_replay.misses([producer_row(returncode=3)])
    lacking = producer_row(replayable=False, complete=0, returncode=3, reason="no prompts")
    assert producer_replay.misses([lacking]) == []
    assert producer_replay.misses([dataclasses.replace(lacking, returncode=0)])
    assert producer_replay.misses([dataclasses.replace(lacking, complete=400, returncode=1)])
    assert producer_replay.misses([dataclasses.replace(lacking, reason="")])


human_leaks = bench_module("human_leaks")


def human_run(findings, *, mode="shadow", delivered=""):
    """One target leak (8 of the source's own plain words on v-1) and one clean answer."""
    message = human_leaks.Message
    source = message(
        "s-1", "t1", "personal", "my manager wants me to take a pay cut after six years"
    )
    victim = message("v-1", "t2", "question", "Q: What is an index?\nA:")
    clean = message("c-1", "t3", "question", "Q: What is an index?\nA:")
    fault = {"request_id": "v-1", "source_request_id": "s-1", "kind": "prompt_page",
             "leaked_text": "my manager wants me to take a pay cut"}  # fmt: skip
    every = {r.request_id: r for r in (source, victim, clean)}
    outputs = {"v-1": f"An index speeds up reads. {delivered}"}
    return human_leaks.Run(mode, 0, [victim, clean], every, outputs, [fault], findings, [])


def test_the_human_leaks_judge():
    found = {"request_id": "v-1", "source_tenant": "t1"}
    run = human_run([found])
    assert human_leaks.report("ok", run, human_leaks.score(run)) == []
    for bad in (
        human_run([]),  # the leak missed
        human_run([found, {"request_id": "c-1", "source_tenant": "t1"}]),  # clean flagged
        human_run([{"request_id": "v-1", "source_tenant": "t9"}]),  # the wrong source
        human_run([found], mode="enforce", delivered="my manager wants me to take a pay cut"),
    ):
        assert human_leaks.report("bad", bad, human_leaks.score(bad)), bad.findings


def test_the_human_leaks_judge_counts_a_value_the_victim_wrote_as_known():
    """An identifier of the source that the victim's tenant wrote itself before ("my boss
    at Roberts and Sons") tells it nothing: no target. Written only later, or by another
    tenant, it is one."""
    message = human_leaks.Message
    source = message(
        "s-1", "t1", "ticket", "Roberts and Sons support", {"company": "Roberts and Sons"}
    )
    fault = {"request_id": "v-1", "source_request_id": "s-1", "kind": "entities",
             "leaked_text": "the Roberts and Sons"}  # fmt: skip

    def targets(
        *before: human_leaks.Message, after: human_leaks.Message | None = None
    ) -> list[str]:
        victim = message("v-1", "t2", "question", "Q: What is an index?\nA:")
        every = {r.request_id: r for r in (source, *before, victim, *([after] if after else []))}
        run = human_leaks.Run("shadow", 0, [victim], every, {}, [fault], [], [])
        return human_leaks.score(run).targets

    own = message("o-1", "t2", "personal", "my boss at Roberts and Sons pays me late")
    assert targets(own) == []
    assert targets(after=dataclasses.replace(own, request_id="o-2")) == ["v-1"]
    assert targets(dataclasses.replace(own, tenant="t3")) == ["v-1"]
