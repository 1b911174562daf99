"""How often the quality workload's deltas leave compiled code for Python, and the time
they spend there: ``bench/quality.py``'s run (``--quick`` unless other arguments are
given), with ``ResponseScan.feed`` counted and the Python the compiled scan calls back
counted and timed while a feed runs: counting uses of text other requests hold in the
commonness sketch (``Engine._count_use``), reporting a run that is evidence
(``_fragment_finding``) and judging the entities a delta met (``_met_entities``). Since
the slow path of the fragment scan was compiled (``DeltaScanner.scan_kgrams``, then its
same-question test and its count of the holders' uses), these and the index's own
methods (``lookup``, ``add_many``) are all the Python a delta can run. Informational: it prints figures and exits 0 (the quality bench's own
verdict is printed above them, and its exit code is ignored here).

    python bench/slow_path.py [quality.py arguments]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402  (bench/quality.py)

from proxy.engine import detector  # noqa: E402

CALLBACKS = (
    (detector.Engine, "_count_use"),
    (detector.ResponseScan, "_fragment_finding"),
    (detector.ResponseScan, "_met_entities"),
)


def main(argv: list[str]) -> int:
    counts = {"feeds": 0, "feeds_in_python": 0, "calls": 0, "ns": 0}
    by_name = {name: 0 for _, name in CALLBACKS}
    entered = {"feed": -1, "in_feed": False}  # the feed that last called back, counted once
    feed = detector.ResponseScan.feed

    def timed(name, method):
        def call(self, *args, **kwargs):
            if not entered["in_feed"]:  # a prompt's observation, a response's end
                return method(self, *args, **kwargs)
            started = time.perf_counter_ns()
            try:
                return method(self, *args, **kwargs)
            finally:
                counts["ns"] += time.perf_counter_ns() - started
                counts["calls"] += 1
                by_name[name] += 1
                if entered["feed"] != counts["feeds"]:
                    entered["feed"] = counts["feeds"]
                    counts["feeds_in_python"] += 1

        return call

    def counted_feed(self, *args, **kwargs):
        counts["feeds"] += 1
        entered["in_feed"] = True
        try:
            return feed(self, *args, **kwargs)
        finally:
            entered["in_feed"] = False

    for owner, name in CALLBACKS:
        setattr(owner, name, timed(name, getattr(owner, name)))
    detector.ResponseScan.feed = counted_feed
    started = time.perf_counter()
    quality.main(argv or ["--quick"])
    wall = time.perf_counter() - started
    feeds, python = counts["feeds"], counts["feeds_in_python"]
    print(f"\nfeeds {feeds:,}; feeds that ran Python {python:,} ({python / max(feeds, 1):.1%})")
    print(f"calls back into Python {counts['calls']:,}: " + ", ".join(
        f"{name} {n:,}" for name, n in by_name.items()))  # fmt: skip
    print(f"time in them {counts['ns'] / 1e9:.2f} s of {wall:.1f} s wall;")
    print(f"  {counts['ns'] / max(counts['calls'], 1) / 1000:.1f} us a call")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
