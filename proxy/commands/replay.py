"""``crosstalk replay FILE...``: find leaks after the fact in captured traffic.

Exit status: 0 no leak found and every exchange scanned whole, 1 leaks found, 2 unusable
arguments or unreadable input, 3 no leak found but not all of the traffic could be looked
at: bodies missing from the input, text the input cut, an input that names no tenant, a
record that could not be read, an input with no LLM exchange in it.
The work is in ``proxy.forensics.job`` (job), ``proxy.forensics.replayer`` (driver), ``proxy.forensics.readers``
(formats) and ``proxy.forensics.report``.
"""

from __future__ import annotations

import argparse
import re
import sys

from proxy.config import ConfigError, load
from proxy.forensics.readers import FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="mitmproxy flow files (mitmdump -w, crosstalk run --capture), HAR, crosstalk "
        "JSON-lines exchanges, LiteLLM logging payloads, SGLang --log-requests or vLLM "
        "request logs, OpenTelemetry GenAI trace exports; gzip allowed; merged in time order",
    )
    p.add_argument("--config", help="the TOML configuration the proxy ran with (tenant rules, key)")
    p.add_argument(
        "--window",
        help="detection window for the replay: seconds, or 30m, 2h, 3d (default: the config's)",
    )
    p.add_argument("--log-file", help="JSON-lines event log (appended); default stderr")
    p.add_argument("--log-level", choices=("debug", "info", "warning"), default="info")
    p.add_argument(
        "--report",
        metavar="PATH",
        action="append",
        help="incident report: .html, .md or .json (may be given once per format)",
    )
    p.add_argument(
        "--state",
        help="learned commonness to start from, read only (default: the config's "
        "detection.state_file; 'none': a cold engine)",
    )
    p.add_argument("--format", dest="fmt", choices=("auto", *FORMATS), default="auto")
    p.add_argument(
        "--tenant-from",
        metavar="FIELD",
        action="append",
        help="the field of a log record that names its tenant (a dotted path, e.g. "
        "request_id, headers.x-tenant-id, lora_request.lora_name, enduser.id; "
        "docs/forensics.md lists them per format); may be repeated, first found wins",
    )
    p.add_argument(
        "--tenant-pattern",
        metavar="REGEX",
        help="the tenant is this pattern's first group (else its match) in --tenant-from's "
        "value, e.g. '^chatcmpl-([a-z0-9]+)-'",
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        metavar="N",
        help="the engine cut logged text at N characters without a marker (vLLM's "
        "--max-log-len): text that long is reported as partial",
    )
    p.add_argument(
        "--sort-buffer",
        type=int,
        default=None,
        metavar="N",
        help="records sorted per file before the merge (default 1024, and at most 64 MB of "
        "bodies): a file may be this many records out of time order",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="replay in N time partitions, one process each (each replays the window "
        "before its start as warm-up; docs/forensics.md, 'Replay on every core')",
    )
    p.add_argument(
        "--warm-up",
        metavar="SECONDS",
        help="with --jobs/--ray: traffic before each partition replayed, unreported, to "
        "warm its engine: seconds or 30m, 2h (default and least: the detection window)",
    )
    p.add_argument(
        "--learn-every",
        type=int,
        default=1,
        metavar="N",
        help="with --jobs/--ray: of the traffic before a partition's warm-up, every Nth "
        "exchange teaches its engine its words (the plain vocabulary never forgets; "
        "default 1: every exchange; 0: none, and workers seek to their warm-up)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run the partitions as Ray tasks on the cluster at ADDRESS (without one: a "
        "Ray of this machine); one partition a CPU unless --jobs says; needs the ray extra",
    )
    p.add_argument(
        "--ray-ship",
        action="store_true",
        help="send the inputs to the Ray workers (default: they read the paths given, "
        "which must be on a file system every node sees)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")


def main(args: argparse.Namespace) -> int:
    from proxy.forensics.job import JobError, ReplayJob, parse_window, run_job
    from proxy.forensics.readers import TenantFrom
    from proxy.forensics.replayer import DEFAULT_SORT_BUFFER

    try:
        window = parse_window(args.window) if args.window else None
        warm_up = parse_window(args.warm_up) if args.warm_up else None
        config = load(args.config, detection__window_seconds=window)
        if args.tenant_pattern and not args.tenant_from:
            raise ValueError("--tenant-pattern needs --tenant-from FIELD")
        try:
            pattern = re.compile(args.tenant_pattern) if args.tenant_pattern else None
        except re.error as e:
            raise ValueError(f"--tenant-pattern: {e}") from None
        tenant_from = TenantFrom(tuple(args.tenant_from or ()), pattern)
    except (ValueError, ConfigError) as e:
        print(f"crosstalk replay: {e}", file=sys.stderr)
        return 2
    if not config.detection.key:
        print(
            "crosstalk replay: warning: no detection.key in the config: evidence hashes and "
            "API-key tenant names will not match the live proxy's log",
            file=sys.stderr,
        )
    job = ReplayJob(
        paths=args.files,
        config=config,
        log_file=args.log_file,
        log_level=args.log_level,
        reports=args.report or [],
        state=args.state,
        sort_buffer=args.sort_buffer if args.sort_buffer is not None else DEFAULT_SORT_BUFFER,
        fmt=args.fmt,
        progress=not args.no_progress and sys.stderr.isatty(),
        tenant_from=tenant_from,
        max_log_len=args.max_log_len,
        jobs=args.jobs,
        warm_up=warm_up,
        learn_every=args.learn_every,
        ray=args.ray,
        ray_ship=args.ray_ship,
    )
    try:
        outcome = run_job(job)
    except JobError as e:
        print(f"crosstalk replay: {e}", file=sys.stderr)
        return 2
    s = outcome.stats
    rate = s.records / outcome.seconds if outcome.seconds > 0 else 0.0
    print(
        f"crosstalk replay: {s.records} records ({s.exchanges} LLM exchanges) in "
        f"{outcome.seconds:.1f} s ({rate:,.0f} records/s): {s.findings} findings in "
        f"{outcome.incidents} incidents; {outcome.skipped} records skipped, "
        f"{s.detector_errors + s.unrecorded} not scannable"
        + (f" ({s.unrecorded} without bodies in the capture)" if s.unrecorded else "")
        + (f", {s.partial} with text cut by the input" if s.partial else "")
        + (f", {s.untenanted} without a tenant" if s.untenanted else "")
        + f", {s.late} out of order"
        + (f"; report: {', '.join(args.report)}" if args.report else ""),
        file=sys.stderr,
    )
    if s.findings:
        return 1
    unseen = [
        why
        for count, why in (
            (s.unrecorded, "bodies the input does not hold (a capture made with "
             "stream_large_bodies, a log that keeps no text)"),
            (s.detector_errors, "exchanges the detector could not scan"),
            (s.unparsed, "request bodies that are not an API request (their prompts "
             "were not learned)"),
            (s.partial, "text cut by the input (a log's length limit) or past "
             "limits.max_scanned_output_chars"),
            (s.untenanted, "exchanges without a tenant (give --tenant-from FIELD)"),
            (outcome.skipped, "records that could not be read (replay.skipped)"),
            (len(outcome.empty_inputs), "inputs with no LLM exchange in them, not even a "
             "broken one (is the format right? --format): " + ", ".join(outcome.empty_inputs)),
        )
        if count
    ]  # fmt: skip
    if unseen:
        print(
            "crosstalk replay: not clean: part of the traffic could not be looked at: "
            + "; ".join(unseen),
            file=sys.stderr,
        )
        return 3
    return 0
