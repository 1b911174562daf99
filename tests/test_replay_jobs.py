"""Replay by time partitions: ``crosstalk replay --jobs N`` and ``--ray``.

The partitioned replay must report what the serial replay reports: the same findings
(the capture here is the replay bench's simulated workload, with the generator's list
of faulted exchanges as ground truth), each unreadable record once, positions and
request ids as a whole read gives them, one report and one exit status. The Ray test
starts a real Ray head on loopback (``ray start --head``) and replays on it.
"""

from __future__ import annotations

import gzip
import math
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, free_port

from proxy.cli import main as cli_main
from proxy.forensics.inputs import RecordedHeaders
from proxy.forensics.job import sampled
from proxy.forensics.partitions import (
    LineSpan,
    Partition,
    Timeline,
    plan,
    sampled_timeline,
)
from proxy.forensics.readers import open_input, read_records
from proxy.forensics.replayer import ExchangeRecord, RecordedResponse

sys.path.insert(0, str(ROOT / "bench"))
from replay import KEY, learn_state, write_capture  # noqa: E402

# Seconds: short beside the capture's ~10 minutes, so that the partitions' edges and
# warm-ups lie inside it (the default warm-up, two hours, would hold all of it).
WINDOW, WARM_UP = "60", "120"


class Workload:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.capture = root / "capture.jsonl"
        cuts, faults = write_capture(
            self.capture, [10_000_000], seed=11, tenants=12, leak_rate=0.1, rate=0.6
        )
        self.faulted = set(faults)
        self.exchanges = cuts[0].exchanges
        state = root / "state.npz"
        learn_state(state, requests=300)
        self.config = root / "crosstalk.toml"
        self.config.write_text(f'[detection]\nkey = "{KEY}"\nstate_file = "{state}"\n')

    def replay(self, *inputs: Path, name: str, extra: tuple[str, ...] = ()):
        log = self.root / f"{name}.jsonl"
        log.unlink(missing_ok=True)
        report = self.root / f"{name}.json"
        argv = ["replay", *map(str, inputs), "--config", str(self.config), "--window", WINDOW,
                "--warm-up", WARM_UP, "--log-file", str(log), "--report", str(report),
                *extra]  # fmt: skip
        status = cli_main(argv)
        events = [orjson.loads(line) for line in log.read_bytes().splitlines()]
        return status, events, orjson.loads(report.read_bytes())


def findings(events: list[dict]) -> set[tuple[str, str, str, str]]:
    """Victim request, source tenant, kind, and the capture position of the victim."""
    return {
        (e["request_id"], e["source_tenant"], e["kind"], e["capture"])
        for e in events
        if e["event"] == "leak.detected"
    }


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Workload:
    return Workload(tmp_path_factory.mktemp("jobs"))


@pytest.fixture(scope="module")
def serial(workload):
    return workload.replay(workload.capture, name="serial")


def assert_like_serial(serial, partitioned, workload: Workload, slack: int) -> None:
    status, events, report = partitioned
    s_status, s_events, s_report = serial
    assert status == s_status == 1
    here, there = findings(events), findings(s_events)
    differ = here ^ there
    print(f"{len(here)} findings, serial {len(there)}, {len(differ)} differ: {sorted(differ)}")
    assert len(there) >= 20
    assert len(differ) <= slack, sorted(differ)
    # A partition edge may change what commonness says of a word; it must never make a
    # finding on an exchange without a fault that the serial replay did not make.
    assert not [f for f in here - there if f[0] not in workload.faulted]
    assert report["summary"]["exchanges"] == s_report["summary"]["exchanges"] == workload.exchanges
    assert report["findings"] == len([e for e in events if e["event"] == "leak.detected"])
    assert len(report["incidents"]) >= len(s_report["incidents"]) - slack
    assert [e["event"] for e in events].count("replay.finished") == 1


def test_jobs_2_finds_what_the_serial_replay_finds(workload, serial):
    """Without words learned before the warm-up, each worker seeks to its line."""
    part = workload.replay(workload.capture, name="j2", extra=("--jobs", "2", "--learn-every", "0"))
    assert_like_serial(serial, part, workload, slack=0)


def test_jobs_4_finds_what_the_serial_replay_finds(workload, serial):
    part = workload.replay(workload.capture, name="j4", extra=("--jobs", "4"))
    assert_like_serial(serial, part, workload, slack=2)
    partitioned = next(e for e in part[1] if e["event"] == "replay.partitioned")
    assert partitioned["partitions"] == 4


def test_an_input_read_whole_by_each_worker_gives_the_same_findings(workload, serial):
    """A gzip file cannot be entered at a line: each worker reads it from the start."""
    packed = workload.root / "capture.jsonl.gz"
    packed.write_bytes(gzip.compress(workload.capture.read_bytes(), compresslevel=1))
    status, events, report = workload.replay(packed, name="gz", extra=("--jobs", "2"))
    assert findings(events) and {f[:3] for f in findings(events)} == {
        f[:3] for f in findings(serial[1])
    }
    assert report["summary"]["exchanges"] == workload.exchanges


@pytest.mark.parametrize("learn_every", ["1", "0"])
def test_unreadable_lines_are_reported_once_at_their_own_positions(workload, tmp_path, learn_every):
    """Broken lines early, around the cut and late: each reported once, whether the
    workers read every input from its start (words learned) or seek to their lines."""
    lines = workload.capture.read_bytes().splitlines(keepends=True)
    bad = b'{"time": "not a time"}\n'
    spots = sorted({5, len(lines) // 2 - 3, len(lines) // 2, len(lines) // 2 + 4,
                    len(lines) * 3 // 4})  # fmt: skip
    broken, expected, offset = [], [], 0
    for i, line in enumerate(lines):
        if i in spots:
            expected.append((len(broken) + 1, offset))
            broken.append(bad)
            offset += len(bad)
        broken.append(line)
        offset += len(line)
    path = tmp_path / "broken.jsonl"
    path.write_bytes(b"".join(broken))
    for jobs in ("1", "2", "3"):
        status, events, report = workload.replay(
            path, name=f"broken{jobs}", extra=("--jobs", jobs, "--learn-every", learn_every)
        )
        skipped = [(e["record"], e["offset"]) for e in events if e["event"] == "replay.skipped"]
        assert sorted(skipped) == expected, jobs
        assert report["summary"]["skipped"] == len(spots)
        assert report["summary"]["exchanges"] == workload.exchanges


def test_a_capture_written_in_completion_order_loses_nothing_at_the_cuts(workload, tmp_path):
    """A log written as exchanges end is out of request order by up to the longest
    stream: a worker that seeks starts a sort buffer's lines before its warm-up, so it
    replays what the serial replay replays."""
    lines = workload.capture.read_bytes().splitlines(keepends=True)
    ended = sorted(lines, key=lambda line: orjson.loads(line)["end_time"])
    assert ended != lines
    path = tmp_path / "ended.jsonl"
    path.write_bytes(b"".join(ended))
    serial = workload.replay(path, name="ended1", extra=("--sort-buffer", "64"))
    for jobs in ("2", "3"):
        part = workload.replay(path, name=f"ended{jobs}", extra=(
            "--jobs", jobs, "--learn-every", "0", "--sort-buffer", "64"))  # fmt: skip
        assert part[2]["summary"]["exchanges"] == serial[2]["summary"]["exchanges"]
        assert part[2]["summary"]["late"] == serial[2]["summary"]["late"]
        assert {f[:3] for f in findings(part[1])} == {f[:3] for f in findings(serial[1])}


def test_sampled_learning_takes_every_nth_value():
    taken: list[int] = []
    learn = sampled(taken.append, 3)
    for i in range(10):
        learn(i)
    assert taken == [0, 3, 6, 9]


def test_jobs_and_ray_options_are_checked(workload, capsys):
    assert cli_main(["replay", str(workload.capture), "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err
    assert cli_main(["replay", str(workload.capture), "--ray-ship"]) == 2
    assert "give --ray too" in capsys.readouterr().err
    assert cli_main(["replay", str(workload.capture), "--learn-every", "-1"]) == 2
    assert "--learn-every must be >= 0" in capsys.readouterr().err


# -- the planner ----------------------------------------------------------------------------


def timeline(name: str, times: list[float], size_each: int = 100) -> Timeline:
    return Timeline(
        name, size_each * len(times), times, [size_each * i for i in range(len(times))],
        list(range(1, len(times) + 1)),
    )  # fmt: skip


def test_partitions_cover_the_span_once_and_balance_warm_up_and_span():
    line = timeline("a", [float(t) for t in range(10_000)])
    parts = plan([line], 3, window=600.0)
    assert [p.index for p in parts] == [0, 1, 2] and parts[0].start == -math.inf
    assert parts[-1].end == math.inf
    assert all(a.end == b.start for a, b in zip(parts, parts[1:], strict=False))
    costs = [
        line.bytes_before(p.end) - (line.bytes_before(p.warm_from) if p.index else 0) for p in parts
    ]
    assert max(costs) - min(costs) <= 0.01 * max(costs), costs
    assert parts[1].start - parts[0].end == 0 and parts[1].warm_from == parts[1].start - 600
    # The first partition has no warm-up, so it takes more of the span.
    assert parts[0].end > 10_000 / 3


def test_one_job_or_no_times_is_one_partition():
    assert len(plan([timeline("a", [1.0, 2.0])], 1, 60.0)) == 1
    assert len(plan([Timeline("a", 0, [], [], [])], 4, 60.0)) == 1


def record(when: float, end: float) -> ExchangeRecord:
    response = RecordedResponse(200, RecordedHeaders(), b"", when, end)
    return ExchangeRecord(when, f"#{when}", "POST", "/v1/chat/completions", RecordedHeaders(),
                          b"", response, f"id-{when}")  # fmt: skip


def test_a_partition_replays_its_warm_up_and_the_arrivals_during_its_last_streams():
    part = Partition(1, 3, start=100.0, end=200.0, warm_from=40.0)
    stream = [record(t, e) for t, e in [(10, 11), (50, 51), (150, 151), (199, 230),
                                        (220, 221), (231, 232), (240, 241)]]  # fmt: skip
    kept = [r.time for r in part.records(iter(stream))]
    assert kept == [50, 150, 199, 220]  # 231: after the last reported exchange ended


def test_sampled_timeline_names_the_line_at_each_offset(workload):
    source = open_input(workload.capture)
    try:
        line = sampled_timeline(source, samples=64)
    finally:
        source.close()
    starts, number = {}, 1
    with workload.capture.open("rb") as f:
        offset = 0
        for raw in f:
            starts[offset] = number
            number += 1
            offset += len(raw)
    assert line.lines is not None and len(line.offsets) >= 60
    assert all(starts[o] == n for o, n in zip(line.offsets, line.lines, strict=True))
    assert line.times == sorted(line.times)
    # A worker entering at a sampled line reads the records a whole read gives there.
    span = LineSpan(line.offsets[10], line.lines[10])
    entered = open_input(workload.capture)
    entered.first_offset, entered.first_line = span.offset, span.number
    whole = open_input(workload.capture)
    try:
        first = next(read_records(entered, lambda s: None))
        same = [r for r in read_records(whole, lambda s: None) if r.position == first.position]
        assert same and same[0].fallback_id == first.fallback_id and same[0].time == first.time
    finally:
        entered.close()
        whole.close()


# -- Ray --------------------------------------------------------------------------------------


# One token for the head and its drivers (Ray 2.60 authenticates clients, and would
# otherwise use whatever token another Ray left in ~/.ray/auth_token), and loopback
# only: with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 every Ray process names its node
# 127.0.0.1 (else the machine's address, however the head was started).
RAY_ENV = {
    **os.environ,
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(16),
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real Ray head on loopback, as an operator's cluster (two CPUs)."""
    cli = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    # Ray's workers take ports 10002-19999 by default: the head's must lie outside them.
    port = next(p for p in (free_port() for _ in range(100)) if not 10_000 <= p < 20_000)
    temp = Path("/tmp") / f"ray-ct-{os.getpid()}"  # Ray's socket paths must stay short
    env = RAY_ENV
    start = [cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", "2", "--include-dashboard", "false", "--temp-dir", str(temp),
             "--disable-usage-stats"]  # fmt: skip
    started = subprocess.run(start, env=env, capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def ray_replay(workload: Workload, address: str, name: str, *extra: str):
    """``crosstalk replay --ray ADDRESS`` as its own process (a Ray driver)."""
    log, report = workload.root / f"{name}.jsonl", workload.root / f"{name}.json"
    log.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "replay", str(workload.capture), "--config",
         str(workload.config), "--window", WINDOW, "--warm-up", WARM_UP, "--log-file",
         str(log), "--report",
         str(report), "--ray", address, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=RAY_ENV,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    events = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    return done.returncode, events, orjson.loads(report.read_bytes())


def test_ray_cluster_replay_finds_what_the_serial_replay_finds(workload, serial, ray_head):
    part = ray_replay(workload, ray_head, "ray", "--jobs", "2")
    assert_like_serial(serial, part, workload, slack=0)
    partitioned = next(e for e in part[1] if e["event"] == "replay.partitioned")
    assert partitioned["executor"] == "ray" and partitioned["partitions"] == 2


def test_ray_replay_with_shipped_inputs(workload, serial, ray_head):
    assert_like_serial(serial, ray_replay(workload, ray_head, "ship", "--ray-ship"), workload,
                       slack=0)  # fmt: skip
