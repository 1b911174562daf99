"""The fingerprint journal (proxy.store.journal): records written, rotated, pruned and read
back; another key refused; a corrupt line skipped with its position."""

from __future__ import annotations

import gzip
import os

import openai
import pytest
from conftest import TEST_KEY, run_mitmdump, run_sim, wait_for_events
from test_records import live_traffic
from traffic import load_truth

from proxy.engine import Engine, EngineConfig
from proxy.engine.ordered_replay import replay
from proxy.store import journal

KEY = b"r" * 32


def write_journal(directory, records, **settings) -> journal.JournalWriter:
    engine = Engine(EngineConfig(key=KEY))
    writer = journal.JournalWriter(
        journal.JournalSettings(str(directory), **settings), engine.hasher.key_id, 4
    )
    for record in records:
        writer.write(record)
    writer.close()
    return writer


@pytest.fixture(scope="module")
def traffic():
    live = Engine(EngineConfig(key=KEY))
    canary, records, findings = live_traffic(live, 200)
    return [canary, *records], findings


def test_journal_replays_to_the_live_findings_and_stays_compact(tmp_path, traffic):
    records, live_findings = traffic
    write_journal(tmp_path, records)
    replica = Engine(EngineConfig(key=KEY))
    read = list(journal.read([tmp_path], replica.hasher.key_id, 4))
    assert len(read) == len(records)
    assert [(f.request_id, f.finding) for f in replay(replica, read)] == live_findings
    units = sum(len(r.units) for r in records if hasattr(r, "units")) + sum(
        len(c.units) for r in records if hasattr(r, "choices") for c in r.choices
    )
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    # 8 bytes of keyed hash a unit, which do not compress, plus offsets and ordering
    assert size / units < 13, size / units


def test_journal_of_another_key_is_refused(tmp_path, traffic):
    write_journal(tmp_path, traffic[0][:5])
    other = Engine(EngineConfig(key=b"x" * 32))
    with pytest.raises(journal.JournalError, match="key"):
        list(journal.read([tmp_path], other.hasher.key_id, 4))


def test_corrupt_line_is_skipped_with_its_position(tmp_path, traffic):
    records = traffic[0][:20]
    write_journal(tmp_path, records)
    [segment] = tmp_path.iterdir()
    lines = gzip.decompress(segment.read_bytes()).splitlines(keepends=True)
    lines[3] = b'{"t": "output", "choices": [{"u": "!!"}]}\n'
    lines[7] = lines[7][:40] + b"\n"
    segment.write_bytes(gzip.compress(b"".join(lines)))
    corrupt: list[journal.Corrupt] = []
    read = list(
        journal.read([tmp_path], Engine(EngineConfig(key=KEY)).hasher.key_id, 4, corrupt.append)
    )
    assert len(read) == len(records) - 2
    assert [c.position for c in corrupt] == [f"{segment}:4", f"{segment}:8"]


def test_truncated_segment_keeps_what_was_flushed(tmp_path, traffic):
    records = traffic[0][:30]
    write_journal(tmp_path, records)
    [segment] = tmp_path.iterdir()
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) * 2 // 3])  # the process died mid-write
    corrupt: list[journal.Corrupt] = []
    read = list(
        journal.read([tmp_path], Engine(EngineConfig(key=KEY)).hasher.key_id, 4, corrupt.append)
    )
    assert 0 < len(read) < len(records)
    assert "cut short" in corrupt[-1].reason, corrupt


def test_segments_rotate_by_size_and_old_ones_are_pruned(tmp_path, traffic):
    records = traffic[0]
    stale = tmp_path / "journal-20200101T000000-1-0001.ctj.gz"
    stale.write_bytes(gzip.compress(b""))
    os.utime(stale, (0, 0))
    write_journal(tmp_path, records, max_segment_bytes=20_000, retention_days=1)
    segments = sorted(tmp_path.iterdir())
    assert stale not in segments
    assert len(segments) > 3
    key_id = Engine(EngineConfig(key=KEY)).hasher.key_id
    assert len(list(journal.read([tmp_path], key_id, 4))) == len(records)


PRIVATE = (
    "Please draft the settlement letter for Harriet Okonkwo-Lindqvist: invoice 88213 from "
    "Brightwater Aquafarms was disputed because the salmon pens at Skjervoy failed the "
    "inspection twice, and the 41,700 euro settlement stays confidential until the board "
    "of Nordhavn Seafood signs it next Thursday."
)


@pytest.mark.parametrize("with_journal", [True, False])
def test_restarted_proxy_still_catches_a_leak_of_a_prompt_seen_before(tmp_path, with_journal):
    """The source's prompt passes one proxy process; the proxy restarts; the leak of that
    prompt into another tenant's answer is still caught, from the journal's window (the
    control without a journal misses it)."""
    config = tmp_path / "crosstalk.toml"
    config.write_text(f'[detection]\nkey = "{TEST_KEY}"\n')
    sets = [f"crosstalk_config={config}"]
    if with_journal:
        sets.append(f"crosstalk_journal={tmp_path / 'journal'}")
    sim_args = ("--leak-rate", "1", "--fault-kinds", "prompt_page", "--seed", "3")
    with run_sim(tmp_path, *sim_args) as sim:
        with run_mitmdump(tmp_path, sim.url, *sets) as proxy:
            chat(proxy.url, "owner", PRIVATE, "owner-0")
        with run_mitmdump(tmp_path, sim.url, *sets) as proxy:
            for i in range(4):
                chat(proxy.url, "victim", f"Tips for a picnic with {i + 2} friends?", f"victim-{i}")
            ids = {f"victim-{i}" for i in range(4)}
            events = wait_for_events(
                proxy.log,
                lambda ev: ids <= {e.get("request_id") for e in ev if e["event"] == "exchange"},
            )
        truth = load_truth(sim.truth)
    # Pages of 16 words or more (the simulator also leaks 4- and 8-word pages, too short
    # to tell apart from chance by design)
    leaked = {
        t["request_id"] for t in truth if t["source_tenant"] == "owner" and t["leaked_words"] >= 16
    }
    found = {
        e["request_id"]
        for e in events
        if e["event"] == "leak.detected" and e["source_tenant"] == "owner"
    }
    assert len(leaked) >= 2, truth  # the simulator leaked the owner's prompt after the restart
    if with_journal:
        assert any(e["event"] == "journal.loaded" and e["records"] >= 2 for e in events)
        assert leaked <= found
    else:
        assert not found


def chat(url: str, tenant: str, content: str, request_id: str) -> None:
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="x", default_headers={"X-Tenant-ID": tenant}
    )
    client.chat.completions.create(
        model="sim-llm-1",
        messages=[{"role": "user", "content": content}],
        extra_headers={"X-Request-ID": request_id},
    )
