"""The same traffic gives the same findings: a replay of one capture, run twice in fresh
processes with different hash seeds (Python's set and dict order of strings differs
between them), reports the same leaks with the same spans and evidence (issue 44: a
detector whose findings can differ on the same input is a bug)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from conftest import ROOT, bench_module, read_events

producer_replay = bench_module("producer_replay")
KEY = "be4c4b3e9c1d2a7f5e6b8a9c0d1e2f30415263748596a7b8c9d0e1f203142536"
FIELDS = ("request_id", "tenant", "kind", "source_tenant", "source_request_id", "choice",
          "output_offset", "detected_at", "evidence", "score", "foreign_units")  # fmt: skip


def findings(tmp_path, capture, hash_seed: str) -> list[tuple]:
    config = tmp_path / "replay.toml"
    config.write_text(f'[detection]\nkey = "{KEY}"\n')
    log = tmp_path / f"events-{hash_seed}.jsonl"
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "replay", str(capture), "--config", str(config),
         "--state", "none", "--log-file", str(log), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    return sorted(
        tuple(str(e.get(f)) for f in FIELDS)
        for e in read_events(log)
        if e["event"] == "leak.detected"
    )


def test_two_processes_with_other_hash_seeds_find_the_same(tmp_path):
    ns = argparse.Namespace(exchanges=600, seed=13, tenants=8, leak_rate=0.15)
    xs, faulted = producer_replay.exchanges(ns.exchanges, ns.seed, ns.tenants, ns.leak_rate)
    capture = producer_replay.reference_capture(xs, tmp_path / "capture.jsonl")[0]
    first = findings(tmp_path, capture, "1")
    assert len(first) > 20  # the workload's leaks are there to be found
    assert findings(tmp_path, capture, "2") == first
    assert findings(tmp_path, capture, "3") == first
