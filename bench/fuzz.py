"""The longer fuzz run: every target of tests/fuzz_targets.py with many more inputs
than the test suite's 150 (hypothesis, coverage of the strategies, not of the code).
Prints the inputs tried and the time per target; exits 1 when a target raised an
exception its parser does not document (the failing input is printed by hypothesis).

    python bench/fuzz.py [--examples 5000] [--only NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fuzz_targets import TARGETS, Target  # noqa: E402


def fuzz(target: Target, examples: int) -> tuple[int, float, str | None]:
    tried = 0

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)  # fmt: skip
    @given(target.inputs)
    def run(data) -> None:
        nonlocal tried
        tried += 1
        with contextlib.suppress(*target.allowed):
            target.call(data)

    started = time.perf_counter()
    try:
        run()
    except Exception as e:  # noqa: BLE001 -- the finding of a fuzz run
        return tried, time.perf_counter() - started, f"{type(e).__name__}: {e}"[:500]
    return tried, time.perf_counter() - started, None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=5000)
    p.add_argument("--only", help="one target by name")
    args = p.parse_args()
    failed = 0
    print("| target | inputs tried | seconds | result |\n|---|---:|---:|---|")
    for target in TARGETS:
        if args.only and target.name != args.only:
            continue
        tried, seconds, error = fuzz(target, args.examples)
        failed += error is not None
        print(f"| {target.name} | {tried} | {seconds:.1f} | {error or 'ok'} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
