"""Replay of the logs real engines write: relative recall per producer variant.

The same exchanges of the simulated workload (``bench/replay.py``'s generator: tenants,
chat and completions, streamed and not, cross-tenant leaks injected at ``--leak-rate``)
are written twice:

* as crosstalk's own JSON-lines capture: the reference;
* as each producer's log, by the producers' own logging code at the pinned releases
  (``bench/producer_logs.py``, ``PINS``): vLLM at DEBUG and INFO, with and without
  ``--enable-log-outputs`` and ``--max-log-len``; SGLang ``--log-requests`` levels 1-3,
  text and JSON, one host and two hosts merged; LiteLLM's ``StandardLoggingPayload`` from
  an SDK and from a proxy setup; OpenLLMetry's OpenTelemetry spans of the ``openai`` SDK
  (OTLP/JSON, as the Collector's file exporter writes them), with and without content.

Each is replayed by ``crosstalk replay`` (the config's key, a cold engine) with the
tenant options a user of that log would give (docs/forensics.md). Ground truth is the
workload's own record of which exchanges were faulted; a variant's *relative recall* is
the share of the faulted exchanges the reference replay flagged that the variant's
replay flagged too. Targets (issue 43): relative recall >= ``TARGET_RELATIVE`` for every
replayable variant; every variant that is not replayable exits 3 (never 0) with a reason;
no variant reports every exchange complete while text went unscanned.

    python bench/producer_replay.py [--exchanges 400] [--seed 7] [--workdir DIR] [--json F]

Exit status 0 when every target is met, 1 otherwise. Loopback only (LiteLLM runs with
``mock_response``, OpenLLMetry's calls go to a stand-in engine on 127.0.0.1: no network).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

import producer_logs as producers  # noqa: E402
from replay import workload_exchanges  # noqa: E402

KEY = "be4c4b3e9c1d2a7f5e6b8a9c0d1e2f30415263748596a7b8c9d0e1f203142536"
TARGET_RELATIVE = 0.98
VLLM_TENANT = ["--tenant-from", "request_id", "--tenant-pattern", r"^(?:chat)?cmpl-([^:]+):"]
MAX_LOG_LEN = 400


@dataclass(frozen=True)
class Variant:
    name: str
    write: Callable[[list[producers.Exchange], Path], list[Path]]
    replay_args: tuple[str, ...] = ()
    replayable: bool = True  # False: the log lacks text by design; must exit 3
    why_not: str = ""


VARIANTS = [
    Variant("vllm-0.33 DEBUG, outputs", lambda xs, p: producers.vllm_log(xs, p), tuple(VLLM_TENANT)),
    Variant("vllm-0.33 DEBUG, outputs, no deltas",
            lambda xs, p: producers.vllm_log(xs, p, log_deltas=False), tuple(VLLM_TENANT)),
    Variant(f"vllm-0.33 DEBUG, --max-log-len {MAX_LOG_LEN} (inferred)",
            lambda xs, p: producers.vllm_log(xs, p, max_log_len=MAX_LOG_LEN), tuple(VLLM_TENANT),
            replayable=False, why_not="text cut by the log"),
    Variant(f"vllm-0.33 DEBUG, --max-log-len {MAX_LOG_LEN} (given)",
            lambda xs, p: producers.vllm_log(xs, p, max_log_len=MAX_LOG_LEN),
            (*VLLM_TENANT, "--max-log-len", str(MAX_LOG_LEN)),
            replayable=False, why_not="text cut by the log"),
    Variant("vllm-0.33 INFO (default), outputs", lambda xs, p: producers.vllm_log(xs, p, level="INFO"),
            tuple(VLLM_TENANT), replayable=False, why_not="no prompts at INFO"),
    Variant("vllm-0.33 DEBUG, no outputs",
            lambda xs, p: producers.vllm_log(xs, p, log_outputs=False), tuple(VLLM_TENANT),
            replayable=False, why_not="no outputs without --enable-log-outputs"),
    Variant("sglang-0.5.23 level 3, text", lambda xs, p: producers.sglang_log(xs, p, level=3)),
    Variant("sglang-0.5.23 level 3, json",
            lambda xs, p: producers.sglang_log(xs, p, level=3, fmt="json")),
    Variant("sglang-0.5.23 level 3, two hosts merged",
            lambda xs, p: producers.sglang_log(xs, p, level=3, hosts=2)),
    Variant("sglang-0.5.23 level 2, text", lambda xs, p: producers.sglang_log(xs, p, level=2),
            replayable=False, why_not="text cut by the log"),
    Variant("sglang-0.5.23 level 1, text", lambda xs, p: producers.sglang_log(xs, p, level=1),
            replayable=False, why_not="no text at levels 0 and 1"),
    Variant(f"litellm-{producers.PINS['litellm']} SDK (user=tenant)",
            lambda xs, p: producers.litellm_log(xs, p, setup="sdk")),
    Variant(f"litellm-{producers.PINS['litellm']} proxy (key team)",
            lambda xs, p: producers.litellm_log(xs, p, setup="proxy")),
    Variant(f"openllmetry-{producers.PINS['openllmetry']}, content on",
            lambda xs, p: producers.otel_log(xs, p)),
    Variant(f"openllmetry-{producers.PINS['openllmetry']}, content off",
            lambda xs, p: producers.otel_log(xs, p, capture_content=False),
            replayable=False, why_not="no text without content capture"),
]  # fmt: skip


@dataclass
class Row:
    variant: str
    replayable: bool
    exchanges: int
    returncode: int
    complete: int
    found_of_reference: int
    reference: int
    relative_recall: float | None
    clean_flagged: int
    reference_clean_flagged: int
    reason: str
    seconds: float


def exchanges(n: int, seed: int, tenants: int, leak_rate: float):
    """``n`` workload exchanges as producer inputs, and the faulted ones' ids."""
    out, faulted = [], set()
    for g, _rng in workload_exchanges(seed, tenants, leak_rate, rate=4.0):
        req = g.req
        chat = req.endpoint == "chat"
        prompt = req.messages if chat else req.body()["prompt"]
        out.append(producers.Exchange(req.tenant, req.request_id, "chat" if chat else "completions",
                                      prompt, g.answer, req.stream, g.start, g.end))  # fmt: skip
        if g.faulted:
            faulted.add(req.request_id)
        if len(out) == n:
            return out, faulted
    raise AssertionError("the workload is endless")


def reference_capture(xs: list[producers.Exchange], path: Path) -> list[Path]:
    """crosstalk's JSON-lines exchanges (docs/forensics.md), whole texts, tenant field."""
    with path.open("wb") as f:
        for x in xs:
            chat = x.api == "chat"
            line = {
                "time": x.start, "end_time": x.end, "tenant": x.tenant, "request_id": x.request_id,
                "path": "/v1/chat/completions" if chat else "/v1/completions",
                "request": {"model": "m", "messages": x.prompt} if chat else {"model": "m", "prompt": x.prompt},
                "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": x.output}}
                                         if chat else {"index": 0, "text": x.output}]},
            }  # fmt: skip
            f.write(orjson.dumps(line) + b"\n")
    return [path]


def workload_id(found: str, known: dict[str, str]) -> str | None:
    """The workload's request id behind a replayed request id: itself, SGLang's rid,
    vLLM's ``cmpl-<tenant>:<id>[-<i>]``, or the answer's ``chatcmpl-<id>`` / ``cmpl-<id>``
    (the OpenTelemetry spans' ``gen_ai.response.id``: an engine names its answer after
    the request's ``X-Request-Id``)."""
    if found in known:
        return known[found]
    tail = found.split(":", 1)[-1]
    for candidate in (tail, re.sub(r"-\d+$", "", tail), re.sub(r"^(?:chat)?cmpl-", "", found)):
        if candidate in known:
            return known[candidate]
    return None


def replay(
    files: list[Path], workdir: Path, name: str, extra: tuple[str, ...]
) -> tuple[int, dict, list[dict], str]:
    config = workdir / "replay.toml"
    config.write_text(f'[detection]\nkey = "{KEY}"\n')
    log, report = workdir / f"{name}-events.jsonl", workdir / f"{name}-report.json"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "proxy", "replay", *map(str, files), "--config", str(config),
            "--state", "none", "--log-file", str(log), "--report", str(report), "--no-progress", *extra]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    summary = orjson.loads(report.read_bytes())["summary"] if report.exists() else {}
    events = (
        [orjson.loads(line) for line in log.read_bytes().splitlines() if line.strip()]
        if log.exists()
        else []
    )
    return done.returncode, summary, events, done.stderr


def flagged(events: list[dict], known: dict[str, str]) -> set[str]:
    return {
        rid for e in events if e.get("event") == "leak.detected"
        if (rid := workload_id(str(e.get("request_id")), known)) is not None
    }  # fmt: skip


def run(args: argparse.Namespace, workdir: Path) -> list[Row]:
    xs, faulted = exchanges(args.exchanges, args.seed, args.tenants, args.leak_rate)
    known = {x.request_id: x.request_id for x in xs}
    known.update({producers.sglang_rid(x): x.request_id for x in xs})
    print(
        f"# {len(xs)} exchanges, {len(faulted)} faulted, seed {args.seed}; producers {producers.PINS}"
    )
    code, summary, events, _ = replay(
        reference_capture(xs, workdir / "reference.jsonl"), workdir, "reference", ()
    )
    reference = flagged(events, known) & faulted
    reference_clean = len(flagged(events, known) - faulted)
    print(f"reference (crosstalk JSON lines): exit {code}, {len(reference)}/{len(faulted)} faulted flagged, "
          f"{len(flagged(events, known) - faulted)} clean flagged")  # fmt: skip
    rows = []
    for i, v in enumerate(VARIANTS):
        if getattr(args, "only", None) and args.only not in v.name:
            continue
        t0 = time.monotonic()
        files = v.write(xs, workdir / f"v{i}.log")
        code, summary, events, stderr = replay(files, workdir, f"v{i}", v.replay_args)
        found = flagged(events, known)
        both = len(found & reference)
        reason = next(
            (ln.split("not clean: ", 1)[1] for ln in stderr.splitlines() if "not clean:" in ln), ""
        )
        rows.append(Row(
            v.name, v.replayable, int(summary.get("exchanges", 0)), code, int(summary.get("per_input", [{}])[0].get("complete", 0))
            if len(summary.get("per_input", [])) == 1 else sum(p.get("complete", 0) for p in summary.get("per_input", [])),
            both, len(reference), both / len(reference) if reference else None, len(found - faulted),
            reference_clean, reason[:160], time.monotonic() - t0,
        ))  # fmt: skip
        r = rows[-1]
        print(f"| {r.variant} | {r.exchanges} | {r.complete} | {r.returncode} | "
              f"{r.found_of_reference}/{r.reference} = {r.relative_recall or 0:.2f} | {r.clean_flagged} | {r.reason[:90]} |",
              flush=True)  # fmt: skip
    return rows


def misses(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        if r.replayable:
            if r.relative_recall is None or r.relative_recall < TARGET_RELATIVE:
                out.append(f"{r.variant}: relative recall {r.relative_recall}")
            if r.returncode not in (0, 1):
                out.append(f"{r.variant}: exit {r.returncode}")
        elif r.returncode == 0 or r.complete == r.exchanges:
            out.append(f"{r.variant}: not replayable whole, yet exit {r.returncode}, "
                       f"{r.complete}/{r.exchanges} complete")  # fmt: skip
        elif r.returncode == 3 and not r.reason:
            out.append(f"{r.variant}: exit 3 without a reason")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exchanges", type=int, default=400)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--leak-rate", type=float, default=0.1)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only", default=None, help="the variants whose name holds this text")
    args = p.parse_args(argv)
    os.environ.setdefault("TZ", "UTC")
    time.tzset()
    with tempfile.TemporaryDirectory(prefix="crosstalk-producers-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print(
            "| variant | exchanges | complete | exit | relative recall | clean flagged | reason (exit 3) |"
        )
        print("|---|---:|---:|---:|---:|---:|---|")
        rows = run(args, workdir)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    missed = misses(rows)
    for m in missed:
        print(f"MISSED: {m}")
    print("all targets met" if not missed else f"{len(missed)} targets missed")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
