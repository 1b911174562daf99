"""``crosstalk audit``: identify the engine behind a URL and check it against public
isolation advisories (``proxy/defaults/advisories.toml``)."""

from __future__ import annotations

import argparse
import asyncio
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="engine or crosstalk proxy base URL")
    p.add_argument(
        "--advisories", help="advisories file (default: the shipped proxy/defaults/advisories.toml)"
    )
    p.add_argument(
        "--assume",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="declare a setting the engine does not show (e.g. multimodal=false); repeatable",
    )
    p.add_argument("--api-key", help="bearer token for the info endpoints, if required")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    p.add_argument("--evidence", metavar="DIR", help="write an evidence record into DIR")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 no advisory applies, 1 one applies, 2 target or engine unknown."""
    from proxy.assurance.audit import (
        APPLIES,
        AdvisoryError,
        assess,
        audit_record,
        identify,
        load_advisories,
        parse_assumption,
        render,
    )

    try:
        db = load_advisories(args.advisories)
        assumed = dict(parse_assumption(a) for a in args.assume)
    except (AdvisoryError, ValueError) as e:
        print(f"crosstalk audit: {e}", file=sys.stderr)
        return 2
    ident = asyncio.run(identify(args.target, api_key=args.api_key, timeout=args.timeout))
    assessments = assess(ident, db, assumed)
    sys.stdout.write(render(ident, assessments, db.standards))
    if not ident.reachable or not ident.engine:
        status, verdict = 2, "engine not identified" if ident.reachable else "target unreachable"
    elif any(a.status == APPLIES for a in assessments):
        status, verdict = 1, "advisory applies"
    else:
        status, verdict = 0, "no advisory applies"
    print(f"verdict:  {verdict.upper()}")
    if args.evidence:
        from proxy.assurance.evidence import EvidenceError, new_record, write_evidence

        body = audit_record(ident, assessments, db, assumed)
        body.update(verdict=verdict, exit_status=status)
        config = {
            "advisories_sha256": db.sha256,
            "advisories_entries": len(db.advisories),
            "assumed": body["assumed"],
            "timeout": args.timeout,
        }
        try:
            written = write_evidence(args.evidence, new_record("audit", args.target, body, config))
        except EvidenceError as e:
            print(f"crosstalk audit: {e}", file=sys.stderr)
            return 2
        print(f"evidence: {written.directory} (record sha256 {written.record_sha256})")
    return status
