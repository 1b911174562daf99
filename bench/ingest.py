"""What one replica spends ingesting another's exchange, in one process, without Redis.

How: engine A scans ``--fill`` + ``--exchanges`` exchanges of the scale-out workload
(bench/scaleout.py's ``prescan``, its learned state); each record becomes the stream entry
A's ``Publisher`` would send, in both encodings a replica reads (both zlib-compressed):
a packed record (this version's, which carries its scan's judgment of the text an
output met) and a journal line of every feed without it (what replicas before it sent,
still read: such an output is scanned again). For each
round and encoding, a fresh engine B (the same learned state) is handed the entries by
``Ingester.ingest``, as the Consumer hands them over: the first ``--fill`` exchanges
untimed (B's window fills), the next ``--exchanges`` timed with ``thread_time``. The
cost grows with what the window holds, so the default fill (13,000 exchanges: ~900,000
fingerprints in 8 frozen generations, the most there are) is near bench/core.py's
per-delta scale; the output says how many were held. The encodings alternate within each
round; the figure is the minimum over rounds (the machine is shared: the least
disturbed round), beside it the median of per-round ratios. Each of these timed runs also
splits its time into decoding (inflating, then ``unpack`` or the journal line's parse),
prompts (``Engine.ingest_prompt``) and outputs (``ResponseScan.ingest_output``); the
timers around the parts count in its total (``thread_time`` is a system call, ~0.6 us).
So each round also times the packed entries once more with nothing wrapped (but the
ingester's own timer, which a replica runs too): the target's figure. Within a round
the runs alternate their order.

This is the engine's part of a replica's cost per ingested exchange; bench/scaleout.py
measures the whole process (the consumer's Redis reads and the event loop as well).

Target (issue 45): at most ``TARGET_MS`` ms of CPU per ingested exchange, packed, not
split (the minimum over rounds). Exit status 1 when missed.

``--before TREE`` also compares this version with another checkout (from 996857c on, its
compiled parts built in place for this venv's Python: ``python setup.py build_ext
--inplace`` with a venv of the same Python version and numpy):
this script runs packed rounds in child processes that import the package from TREE and
from this tree, alternated ``--pairs`` times (which goes first alternates too); it prints
each side's min and median and the per-pair ratios.

``--cold`` also times the packed entries one at a time, with nothing, a 1 ms sleep or a
pass over 2, 8 or 48 MB before each (``cold_rounds``): reported only.

    python bench/ingest.py [--exchanges 1500] [--rounds 5] [--json out.json] [--cold]
                           [--before TREE [--pairs 3]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from scaleout import prescan, warm_state  # noqa: E402

import proxy.store.redis_index as redis_index  # noqa: E402
from proxy.config import load  # noqa: E402
from proxy.engine.detector import ResponseScan  # noqa: E402
from proxy.eventlog import make_logger  # noqa: E402
from proxy.factory import build_engine  # noqa: E402
from proxy.store.codec import pack  # noqa: E402
from proxy.store.journal import encode  # noqa: E402

TARGET_MS = 0.3
KEY = "ab" * 32
COUNTERS = ("index_ingested", "index_skipped", "index_remote_findings", "index_refused",
            "index_corrupt", "index_errors")  # fmt: skip
ENCODINGS: dict[str, Callable[[Any], bytes]] = {
    "packed": lambda record: _compressed(record),
    "zlib line (before)": lambda record: zlib.compress(encode(_unjudged(record)), 1),
}


def _compressed(record: Any) -> bytes:
    """The packed entry this version's ``Publisher`` sends (``--before`` runs this script
    with the package of a version that compressed with the standard library's zlib)."""
    compressed = getattr(redis_index, "compressed_record", None)
    if compressed is None:
        return zlib.compress(pack(redis_index.collapsed(record)), 1)
    return cast(bytes, compressed(record))


COMPRESSORS: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]] = {
    # name: (compress, inflate)
    "zlib (standard library)": (
        lambda data: zlib.compress(data, redis_index.COMPRESS_LEVEL),
        zlib.decompress,
    ),
    "ISA-L (isal), what replicas run": (redis_index.deflated, redis_index.inflated),
}


def compression_rounds(packed: list[bytes], rounds: int) -> dict[str, dict[str, list[float]]]:
    """CPU us per record to compress and to inflate the ``packed`` records, and the
    bytes kept per byte packed, per ``COMPRESSORS`` entry; alternated within each round."""
    out: dict[str, dict[str, list[float]]] = {
        name: {"compress_us": [], "inflate_us": [], "ratio": []} for name in COMPRESSORS
    }
    order = list(COMPRESSORS.items())
    for n in range(rounds):
        for name, (compress, inflate) in order if n % 2 == 0 else order[::-1]:
            started = time.thread_time()
            compressed = [compress(data) for data in packed]
            middle = time.thread_time()
            inflated = [inflate(data) for data in compressed]
            ended = time.thread_time()
            if inflated != packed:
                raise SystemExit(f"{name}: a record did not inflate to its bytes")
            out[name]["compress_us"].append((middle - started) * 1e6 / len(packed))
            out[name]["inflate_us"].append((ended - middle) * 1e6 / len(packed))
            out[name]["ratio"].append(sum(map(len, compressed)) / sum(map(len, packed)))
    return out


def _unjudged(record: Any) -> Any:
    """``records.unjudged``, imported when used: ``--before`` runs this script's workers
    with the package of a version that has none."""
    from proxy.engine.records import unjudged

    return unjudged(record)


class Parts:
    """CPU time (``thread_time``) of the wrapped callables, by part; disabled, ``timed``
    returns the callable as it is (no timer of its own in the measured time)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.seconds = {"decode": 0.0, "prompt": 0.0, "output": 0.0}

    def timed[**P, R](self, part: str, f: Callable[P, R]) -> Callable[P, R]:
        if not self.enabled:
            return f

        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            started = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                self.seconds[part] += time.thread_time() - started

        return wrapper


class Timed(NamedTuple):
    ms: float  # CPU per ingested exchange of the timed entries
    parts: dict[str, float]  # the same by part (empty when not split)
    held: int  # fingerprints in the index when the timing began


def ingest_once(
    state: Path,
    entries: list[tuple[bytes, dict[bytes, bytes]]],
    fill: int,
    split: bool = True,
    between: Callable[[], object] | None = None,
) -> Timed:
    """A fresh engine ingests ``entries``: the first ``fill`` untimed, then the rest,
    timed; with ``split``, by part too (the parts' timers count in the total). With
    ``between``, each timed entry is timed alone, ``between()`` run (untimed) before it:
    what ingesting one record at a time among other work costs."""
    engine = build_engine(load(None, detection__key=KEY))
    engine.load_commonness(state)
    counters = dict.fromkeys(COUNTERS, 0)
    ingester = redis_index.Ingester(engine, "b", make_logger(None), counters)
    for entry in entries[:fill]:
        ingester.ingest(*entry)
    held = engine.fingerprints
    parts = Parts(enabled=split)
    # Not split, nothing is wrapped: a --before worker's package may name the steps
    # otherwise.
    saved = (redis_index.inflated, redis_index.unpack, redis_index.from_journal_line,
             ResponseScan.ingest_output) if split else ()  # fmt: skip
    if split:
        redis_index.inflated = parts.timed("decode", redis_index.inflated)
        redis_index.unpack = parts.timed("decode", redis_index.unpack)
        redis_index.from_journal_line = parts.timed("decode", redis_index.from_journal_line)
        ResponseScan.ingest_output = parts.timed("output", ResponseScan.ingest_output)  # type: ignore[method-assign]
        engine.ingest_prompt = parts.timed("prompt", engine.ingest_prompt)  # type: ignore[method-assign]
    try:
        if between is None:
            started = time.thread_time()
            for entry in entries[fill:]:
                ingester.ingest(*entry)
            seconds = time.thread_time() - started
        else:
            seconds = 0.0
            for entry in entries[fill:]:
                between()
                started = time.thread_time()
                ingester.ingest(*entry)
                seconds += time.thread_time() - started
    finally:
        if split:
            (redis_index.inflated, redis_index.unpack, redis_index.from_journal_line,
             ResponseScan.ingest_output) = saved  # fmt: skip
    if counters["index_ingested"] != len(entries):
        raise SystemExit(f"not every entry was ingested: {counters}")
    exchanges = (len(entries) - fill) / 2
    per = {part: s * 1000 / exchanges for part, s in parts.seconds.items()} if split else {}
    return Timed(seconds * 1000 / exchanges, per, held)


def workload(
    state: Path, exchanges: int, seed: int, encodings: dict[str, Callable[[Any], bytes]]
) -> tuple[list[Any], dict[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """Engine A's records of ``exchanges`` exchanges (its learned state saved to
    ``state``), and the stream entries A would publish of them, per encoding."""
    warm_state(KEY, state)
    origin = build_engine(load(None, detection__key=KEY))
    origin.load_commonness(state)
    records = [r for pair in prescan(origin, exchanges, seed) for r in pair]
    key_id = origin.hasher.key_id.encode()
    entries = {
        name: [
            (
                b"%d-0" % i,
                {
                    redis_index.ORIGIN: b"a",
                    redis_index.KEY: key_id,
                    redis_index.RECORD: encoded(r),
                    redis_index.OFFERED: b"0",
                },
            )  # fmt: skip
            for i, r in enumerate(records, 1)
        ]
        for name, encoded in encodings.items()
    }
    return records, entries


def cold_rounds(
    state: Path, entries: list[tuple[bytes, dict[bytes, bytes]]], args: argparse.Namespace
) -> dict[str, list[float]]:
    """``ingest_once`` of ``entries`` an entry at a time, alternated within each round:
    back to back; after a 1 ms sleep (as a replica that reads a record now and then); after
    a pass over 2, 8 or 48 MB (another process's work between two records: 2 MB is what
    the two cores' own caches hold, 48 MB more than the 32 MB they share). What the
    engine's tables and Python's objects cost when the caches no longer hold them."""
    passes = {mb: np.ones(mb * 1_000_000 // 8) for mb in (2, 8, 48)}
    modes: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "a 1 ms sleep": lambda: time.sleep(0.001),
        **{f"a pass over {mb} MB": junk.sum for mb, junk in passes.items()},
    }
    out: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, between in modes.items():
            timed = ingest_once(state, entries, 2 * args.fill, split=False, between=between)
            out[name].append(timed.ms)
    return out


CHILD = """import runpy, sys
sys.path.insert(0, {root!r})
import proxy
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def before_and_after(tree: Path, args: argparse.Namespace) -> None:
    """Packed rounds of ``tree``'s package and of this one, in alternated child processes
    (each imports one tree's package, and says which it imported); prints the comparison."""
    sides = {"before": tree.resolve(), "after": BENCH.parent}
    runs: dict[str, list[float]] = {side: [] for side in sides}
    pairs = []
    for n in range(args.pairs):
        pair = {}
        order = list(sides.items())
        for side, root in order if n % 2 == 0 else order[::-1]:  # neither always first
            # The package is imported from ``root`` before this script's imports, which
            # put this tree first on the path (bench/scaleout.py's REPO).
            argv = [__file__, "--worker", "--rounds", str(args.rounds),
                    "--exchanges", str(args.exchanges), "--fill", str(args.fill),
                    "--seed", str(args.seed)]  # fmt: skip
            child = subprocess.run(
                [sys.executable, "-c", CHILD.format(root=str(root), argv=argv)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(child.stdout.splitlines()[-1])
            if Path(result["tree"]) != root:  # an unbuilt tree falls back to this one
                raise SystemExit(f"the {side} side imported {result['tree']}, not {root}")
            pair[side] = result["ms"]
            runs[side] += pair[side]
        pairs.append(statistics.median(pair["before"]) / statistics.median(pair["after"]))
    print(f"\nbefore ({sides['before']}) and after (this tree), packed, {args.pairs} alternated "
          f"pairs of {args.rounds} rounds:")  # fmt: skip
    print("| code | CPU ms per ingested exchange, min | median |")
    print("|---|---:|---:|")
    for side in sides:
        print(f"| {side} | {min(runs[side]):.3f} | {statistics.median(runs[side]):.3f} |")
    print("before / after, per pair (ratio of the pair's medians): "
          + ", ".join(f"{r:.2f}" for r in pairs))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exchanges", type=int, default=750, help="timed, per round")
    parser.add_argument(
        "--fill", type=int, default=13_000, help="exchanges ingested first, untimed"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=77)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--before", metavar="TREE", type=Path)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--cold",
        action="store_true",
        help="also time packed entries one at a time: back to back, after a 1 ms sleep, "
        "after a pass over 2, 8 or 48 MB (reported only)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ingest-") as tmp:
        state = Path(tmp) / "state.npz"
        if args.worker:  # one side of --before: packed rounds, as JSON
            total = args.fill + args.exchanges
            _, packed = workload(state, total, args.seed, {"packed": ENCODINGS["packed"]})
            ms = [
                ingest_once(state, packed["packed"], 2 * args.fill, split=False).ms
                for _ in range(args.rounds)
            ]
            tree = Path(redis_index.__file__).resolve().parents[2]
            print(json.dumps({"tree": str(tree), "ms": ms}))
            return 0
        records, entries = workload(state, args.fill + args.exchanges, args.seed, ENCODINGS)
        runs: dict[str, list[Timed]] = {name: [] for name in ENCODINGS}
        plain: list[Timed] = []  # packed, nothing wrapped: the target's figure
        order = [*ENCODINGS, None]  # None: packed, not split
        for n in range(args.rounds):
            for name in order if n % 2 == 0 else order[::-1]:  # none always first
                if name is None:
                    plain.append(ingest_once(state, entries["packed"], 2 * args.fill, False))
                else:
                    runs[name].append(ingest_once(state, entries[name], 2 * args.fill))
        cold = cold_rounds(state, entries["packed"], args) if args.cold else {}
        packed = [pack(redis_index.collapsed(r)) for r in records]
        compression = compression_rounds(packed, args.rounds)

    names = list(ENCODINGS)
    best = {name: min(runs[name], key=lambda run: run.ms) for name in names}
    held = [run.held for name in names for run in runs[name]]
    ratios = [b.ms / a.ms for a, b in zip(runs[names[0]], runs[names[1]], strict=True)]
    size = {
        name: sum(len(fields[redis_index.RECORD]) for _, fields in entries[name]) * 2 / len(records)
        for name in names
    }
    uncompressed = sum(map(len, packed)) * 2 / len(records)
    medians = {name: statistics.median(run.ms for run in runs[name]) for name in names}
    print(
        f"ingest: {args.fill} exchanges untimed, then {args.exchanges} timed; "
        f"{args.rounds} rounds, seed {args.seed}; the index held {min(held):,}-{max(held):,} "
        "fingerprints when the timing began"
    )
    print("| encoding | CPU ms per ingested exchange, min (median) | decode | prompt | output | record B per exchange |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        total, per = best[name].ms, best[name].parts
        print(f"| {name} | {total:.3f} ({medians[name]:.3f}) | {per['decode']:.3f} "
              f"| {per['prompt']:.3f} | {per['output']:.3f} | {size[name]:.0f} |")  # fmt: skip
    print(f"\npacked records before compression: {uncompressed:.0f} B per exchange")
    print(f"\nzlib line / packed, median of per-round ratios: {statistics.median(ratios):.2f}")
    target = min(run.ms for run in plain)
    print(f"packed, not split (no timer around the parts): {target:.3f} ms min "
          f"({statistics.median(run.ms for run in plain):.3f} median)")  # fmt: skip
    met = target <= TARGET_MS
    print(f"target <= {TARGET_MS} ms per ingested exchange (packed, not split): "
          f"{'PASS' if met else 'MISS'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "runs": runs,
                    "plain": plain,
                    "cold": cold,
                    "size": size,
                    "ratios": ratios,
                    "compression": compression,
                }
            )
        )
    print(f"\npacked records compressed and inflated, {len(records)} records, "
          f"{args.rounds} rounds alternated (min over rounds):")  # fmt: skip
    print("| compression | CPU us to compress a record | to inflate one | bytes kept |")
    print("|---|---:|---:|---:|")
    for name, figures in compression.items():
        print(f"| {name} | {min(figures['compress_us']):.1f} | {min(figures['inflate_us']):.1f} "
              f"| {min(figures['ratio']):.3f} |")  # fmt: skip
    if cold:
        print(f"\npacked entries one at a time, {args.rounds} rounds (CPU of the ingestion "
              "only; each entry's own timer counts):")  # fmt: skip
        print("| before each entry | CPU ms per ingested exchange, min (median) |")
        print("|---|---:|")
        for name, ms in cold.items():
            print(f"| {name} | {min(ms):.3f} ({statistics.median(ms):.3f}) |")
    if args.before:
        before_and_after(args.before, args)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
