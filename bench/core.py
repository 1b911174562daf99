"""The compiled core against the Python it replaced, side by side in one process: the
same texts (the quality workload's prompts and answers, ASCII ones, as the engine sees
them in 1-3 word deltas and whole) through ``_text.ascii_units`` and
``reference.ascii_units``, and their unit hashes through ``_text.kgrams`` and
``reference.kgrams``; the same deltas through the degenerate-output test
(``_degenerate.DegenerateFeed`` and ``reference.DegenerateDetector``). Alternating rounds,
best of ``--rounds``; MB/s of text, and the ratio. Exits 1 when the outputs differ, or
when a compiled function is not at least ``MIN_SPEEDUP`` times faster than its
reference on whole texts, hashes and the degenerate test's deltas. The units of 1-3
word deltas are reported, not judged: both spend their time in the call itself (the
engine's per-delta step is one compiled call that tokenises inside).

Second table, the index's per-delta queries: an index of ``--fingerprints`` (8 frozen
generations and a hot one, as a full window holds) and a commonness sketch, asked for
the 1-6 k-grams a delta completes, through ``_tables.FrozenGenerations`` / ``sketch_counts``
and their references (the Python and numpy the index ran before: the scalar path that
served batches of up to 8). Microseconds a call; judged like the first table.

    python bench/core.py [--rounds 5] [--requests 1500] [--fingerprints 1000000]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_core_parity import HASHER, workload_texts  # noqa: E402

from proxy.engine import _tables, _text, reference  # noqa: E402
from proxy.engine.degenerate import DegenerateDetector  # noqa: E402
from proxy.engine.index import _ANY_BITS, CommonnessSketch, FingerprintIndex  # noqa: E402

MIN_SPEEDUP = 2.0


def degenerate_run(detector, deltas: list[str]) -> tuple[str | None, int]:
    """A degenerate-output test over one output's deltas: (reason, units judged)."""
    for delta in deltas:
        detector.feed(delta)
    detector.finish()
    return detector.reason, detector.units


def deltas_of(text: str) -> list[str]:
    words = text.split(" ")
    return [" ".join(words[i : i + 2]) + " " for i in range(0, len(words), 2)]


QUERIES = 20_000


def index_calls(fingerprints: int):
    """(name, compiled, reference) callables, each asking ``QUERIES`` delta-sized
    batches of an index and a sketch filled with ``fingerprints`` random ones."""
    rng = random.Random(5)
    index = FingerprintIndex(freeze_size=fingerprints // 8 + 1)
    sketch = CommonnessSketch()
    stored = [rng.getrandbits(64) for _ in range(fingerprints)]
    for start in range(0, fingerprints, 256):
        index.add_many(stored[start : start + 256], start & 0xFFFF, now=float(start))
    sketch.increment(stored[: fingerprints // 4], now=0.0)
    batches = []
    for _ in range(QUERIES):  # a third of each batch stored (a leak's or boilerplate)
        size = rng.randint(1, 6)
        batches.append([rng.choice(stored) if rng.random() < 0.33 else rng.getrandbits(64)
                        for _ in range(size)])  # fmt: skip
    gens = [g.columns for g in index._generations]
    any_bits, shift = index._any, 64 - _ANY_BITS
    flat, seeds = sketch._flat, tuple(sketch._seed_ints)
    mask, width = sketch._mask_int, sketch._width

    def lookups(kind):
        values_into = kind(gens, any_bits, shift).values_into  # built once, as the index does
        return lambda: [values_into(b, [()] * len(b)) for b in batches]

    def counts(f):
        return lambda: [f(flat, seeds, mask, width, b) for b in batches]

    return [
        ("index lookup (frozen generations)", lookups(_tables.FrozenGenerations),
         lookups(reference.FrozenGenerations)),
        ("commonness sketch counts", counts(_tables.sketch_counts), counts(reference.sketch_counts)),
    ]  # fmt: skip


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--fingerprints", type=int, default=1_000_000)
    args = p.parse_args()
    texts = [t for t in workload_texts(args.requests) if t.isascii()]
    deltas = [d for t in texts for d in deltas_of(t)]
    per_text = [deltas_of(t) for t in texts]
    hashes = [HASHER.units(_text.ascii_units(t)[0]) for t in texts]
    mb_whole = sum(len(t) for t in texts) / 1e6
    mb_deltas = sum(len(d) for d in deltas) / 1e6
    rows, failed = [], []
    cases = [  # name, MB, run(f), compiled, reference, judged
        ("units, whole texts", mb_whole,
         lambda f: [f(t, 0) for t in texts], _text.ascii_units, reference.ascii_units, True),
        ("units, 2-word deltas", mb_deltas,
         lambda f: [f(d, 0) for d in deltas], _text.ascii_units, reference.ascii_units, False),
        ("k-gram fingerprints (k=4)", mb_whole,
         lambda f: [f(h, 4) for h in hashes], _text.kgrams, reference.kgrams, True),
        ("degenerate-output step, 2-word deltas", mb_deltas,
         lambda f: [degenerate_run(f(), d) for d in per_text], DegenerateDetector,
         reference.DegenerateDetector, True),
    ]  # fmt: skip
    for name, mb, run, compiled, python, judged in cases:
        if run(compiled) != run(python):
            failed.append(f"{name}: outputs differ")
        t_c, t_p = None, None
        for _ in range(args.rounds):  # alternate, so both see the same machine
            c = best(lambda run=run, f=compiled: run(f), 1)
            py = best(lambda run=run, f=python: run(f), 1)
            t_c, t_p = min(t_c or c, c), min(t_p or py, py)
        speedup = t_p / t_c
        rows.append((name, mb / t_p, mb / t_c, speedup))
        if judged and speedup < MIN_SPEEDUP:
            failed.append(f"{name}: {speedup:.1f}x, target >= {MIN_SPEEDUP}x")
    calls = index_calls(args.fingerprints)
    call_rows = []
    for name, compiled, python in calls:
        if compiled() != python():
            failed.append(f"{name}: outputs differ")
        t_c = t_p = float("inf")
        for _ in range(args.rounds):
            t_c, t_p = min(t_c, best(compiled, 1)), min(t_p, best(python, 1))
        call_rows.append((name, t_p / QUERIES * 1e6, t_c / QUERIES * 1e6, t_p / t_c))
        if t_p / t_c < MIN_SPEEDUP:
            failed.append(f"{name}: {t_p / t_c:.1f}x, target >= {MIN_SPEEDUP}x")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"{len(texts):,} ASCII texts ({mb_whole:.1f} MB), {len(deltas):,} deltas; best of "
          f"{args.rounds} alternating rounds; commit {commit}")  # fmt: skip
    print()
    print(f"| function | Python MB/s | compiled MB/s | speed-up (target >= {MIN_SPEEDUP:g}x) |")
    print("|---|---:|---:|---:|")
    for (name, py, c, x), case in zip(rows, cases, strict=True):
        print(f"| {name} | {py:.1f} | {c:.1f} | {x:.1f}x{'' if case[-1] else ' (not judged)'} |")
    print()
    print(f"| per-delta query ({args.fingerprints:,} fingerprints) | Python us | compiled us "
          f"| speed-up (target >= {MIN_SPEEDUP:g}x) |")  # fmt: skip
    print("|---|---:|---:|---:|")
    for name, py, c, x in call_rows:
        print(f"| {name} | {py:.2f} | {c:.2f} | {x:.1f}x |")
    for f in failed:
        print(f"  ! {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
