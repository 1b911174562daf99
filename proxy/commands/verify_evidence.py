"""``crosstalk verify-evidence``: check the SHA-256 of evidence records."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="an evidence directory, or one holding several")
    p.add_argument("--expect", metavar="SHA256", help="the record hash noted when it was made")


def main(args: argparse.Namespace) -> int:
    """Exit status: 0 every record intact, 1 a record fails, 2 no record found."""
    from proxy.assurance.evidence import find_records, verify

    directories = find_records(args.directory)
    if not directories:
        print(f"crosstalk verify-evidence: no evidence record under {args.directory}")
        return 2
    failed = 0
    for directory in directories:
        result = verify(directory, args.expect)
        if result.ok:
            print(f"OK      {directory}  sha256 {result.record_sha256}")
            continue
        failed += 1
        print(f"FAILED  {directory}")
        for problem in result.problems:
            print(f"        {problem}")
    return 1 if failed else 0
