"""How many deltas of the quality workload leave the compiled step for the Python scan,
and the time they spend there: ``bench/quality.py``'s run (``--quick`` unless other
arguments are given), with ``ResponseScan._scan_kgrams`` and ``ResponseScan.feed``
counted and timed. The engine bench's synthetic text sends about 1% of its deltas
there; this workload's shared system prompts, popular questions and same-tenant repeats
are what a deployment sees. Informational: it prints figures and exits 0 (the quality
bench's own verdict is printed above them, and its exit code is ignored here).

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


def main(argv: list[str]) -> int:
    counts = {"feeds": 0, "scans": 0, "scan_ns": 0}
    scan, feed = detector.ResponseScan._scan_kgrams, detector.ResponseScan.feed

    def timed_scan(self, *args, **kwargs):
        started = time.perf_counter_ns()
        try:
            return scan(self, *args, **kwargs)
        finally:
            counts["scan_ns"] += time.perf_counter_ns() - started
            counts["scans"] += 1

    def counted_feed(self, *args, **kwargs):
        counts["feeds"] += 1
        return feed(self, *args, **kwargs)

    detector.ResponseScan._scan_kgrams = timed_scan
    detector.ResponseScan.feed = counted_feed
    started = time.perf_counter()
    quality.main(argv or ["--quick"])
    wall = time.perf_counter() - started
    feeds, scans = counts["feeds"], counts["scans"]
    print(f"\nfeeds {feeds:,}; Python scans {scans:,} ({scans / max(feeds, 1):.1%} of feeds,")
    print("  the ends of responses included)")
    print(f"time in the Python scan {counts['scan_ns'] / 1e9:.2f} s of {wall:.1f} s wall;")
    print(f"  {counts['scan_ns'] / max(scans, 1) / 1000:.1f} us a scan")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
