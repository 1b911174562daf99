"""The engine bench's workload, for an instruction count: ``bench/engine.py``'s fill, then
``RESPONSES`` of its streamed responses (0: the fill alone), or with ``--whole N`` N
responses fed whole (one ``feed`` each, the bench's "whole response" row). Under ``valgrind
--tool=callgrind`` with ``PYTHONHASHSEED=0`` a run is repeatable, whatever else the
machine does; the streamed responses' instructions are a run's total less the fill-only
run's, and callgrind's inclusive cost of ``_scan.ScanFields.feed`` is the per-delta call's
(before the split of the core, ``_core.ScanFields.feed``).

    PYTHONHASHSEED=0 valgrind --tool=callgrind python bench/instructions.py 120
    PYTHONHASHSEED=0 valgrind --tool=callgrind python bench/instructions.py 0
    PYTHONHASHSEED=0 valgrind --tool=callgrind python bench/instructions.py 0 --whole 200

A 200,000-fingerprint index from 200 tenants keeps a run under valgrind to minutes;
``--full`` fills the engine bench's own (1M fingerprints, 1,000 tenants: ~10 minutes).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine as bench  # noqa: E402  (bench/engine.py)


def main(argv: list[str]) -> int:
    whole = 0
    full = "--full" in argv  # the engine bench's own index: 1M fingerprints, 1,000 tenants
    argv = [a for a in argv if a != "--full"]
    if "--whole" in argv:
        at = argv.index("--whole")
        whole = int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    responses = int(argv[0]) if argv else 120
    small = ["--quick", "--fingerprints", "200000", "--tenants", "200"]
    args = bench.parse_args([] if full else small)
    rng = random.Random(args.seed)
    gen = bench.TextGen(rng, args.vocabulary)
    engine = bench.make_engine(args)
    filled = bench.fill(engine, gen, args)
    if responses:
        result = bench.stream(engine, gen, filled, responses, bench.FILL_SECONDS + 1.0)
        print(f"{result.deltas:,} deltas, {result.bytes:,} bytes")
    if whole:
        size, _ = bench.bulk(engine, gen, filled, whole, bench.FILL_SECONDS + 60.0)
        print(f"{whole} whole responses, {size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
