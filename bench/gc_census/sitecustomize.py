"""A census of the garbage collector inside crosstalk's detector process, for
``bench/soak.py --gc-census DIR`` (which puts this directory on the proxy's
``PYTHONPATH``). Not part of crosstalk: a diagnostic that says what a collection walks.

Active only in a detector process (``proxy.mitm.detector_worker``) and only while
``CROSSTALK_GC_CENSUS`` names a directory; writes ``census-<pid>.txt`` there:

* every ``CENSUS_SECONDS``: the tracked objects (frozen start-up heap excluded), their
  referents by type, the containers with the most referents; then a full collection
  (its wall and CPU time, the unreachable objects it found, by type) and a second one
  straight after, which shows what walking alone costs;
* every young or middle collection that took more than ``SLOW_CPU_SECONDS`` of CPU or
  ``SLOW_WALL_SECONDS`` on the wall clock, with what its generations held: the
  objects by type, the referents by the type of their holder, the tracked referents by
  type (counting them costs time before the collection, not in it); tuples by the
  types of their items and, when the detector runs with ``PYTHONTRACEMALLOC=1``, by the
  line that made them; and the modules imported since start-up's heap was frozen.

Holds no text: type names and counts only.
"""

import os
import sys

CENSUS_SECONDS = 20.0
SLOW_CPU_SECONDS = 0.001
SLOW_WALL_SECONDS = 0.003
BIG_REFERENTS = 500


def _type_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _describe(obj: object) -> str:
    """A container's type and the type of its first item (and value, for a dict)."""
    name = _type_name(obj)
    if isinstance(obj, dict) and obj:
        key = next(iter(obj))
        return f"{name}[{type(key).__name__}: {type(obj[key]).__name__}]"
    if isinstance(obj, (list, tuple, set, frozenset)) and obj:
        return f"{name}[{type(next(iter(obj))).__name__}]"
    return name


def _biggest(objects: list, n: int) -> list[tuple[int, str]]:
    import gc

    sizes = []
    for obj in objects:
        if obj is objects:
            continue  # gc.get_objects() returns a list tracked in the youngest generation
        count = len(gc.get_referents(obj))
        if count > BIG_REFERENTS:
            sizes.append((count, _describe(obj)))
    return sorted(sizes, reverse=True)[:n]


def _start(directory: str) -> None:
    import collections
    import gc
    import threading
    import time
    import tracemalloc

    out = open(os.path.join(directory, f"census-{os.getpid()}.txt"), "a")  # noqa: SIM115
    slow: dict[str, object] = {}
    # Modules imported after start-up's heap was frozen: their objects are young and
    # reach the oldest generation through the middle collections.
    known_modules: set[str] = set()
    freeze = gc.freeze

    def freeze_and_note_modules() -> None:
        known_modules.update(sys.modules)
        print(f"freeze modules={len(known_modules)}", file=out, flush=True)
        freeze()

    gc.freeze = freeze_and_note_modules

    def late_modules() -> list[str]:
        if not known_modules:
            return []
        late = sorted(set(sys.modules) - known_modules)
        known_modules.update(late)
        return late

    def on_collection(phase: str, info: dict) -> None:
        generation = info.get("generation", 2)
        if generation == 2:
            return
        if phase == "start":
            tracing = tracemalloc.is_tracing()
            young = gc.get_objects(generation=0)
            for older in range(1, generation + 1):
                young += gc.get_objects(generation=older)
            kinds: collections.Counter[str] = collections.Counter()
            targets: collections.Counter[str] = collections.Counter()
            holders: collections.Counter[str] = collections.Counter()  # by referents held
            refs = 0
            for obj in young:
                if obj is young:
                    continue
                referents = gc.get_referents(obj)
                if type(obj) is tuple:  # which tuples: their items' types (referents)
                    kind = "tuple(" + ",".join(type(r).__name__ for r in referents[:4]) + ")"
                    if tracing:  # PYTHONTRACEMALLOC=1: where it was made
                        trace = tracemalloc.get_object_traceback(obj)
                        kind += (
                            f"@{trace[0].filename.rsplit('/', 2)[-1]}:{trace[0].lineno}"
                            if trace
                            else "@?"
                        )
                    kinds[kind] += 1
                else:
                    kinds[_type_name(obj)] += 1
                refs += len(referents)
                # The type only: looking into a container from inside a collection
                # (_describe on every young object) crashed the detector (SIGSEGV).
                holders[_type_name(obj)] += len(referents)
                # What the collection visits: tracked referents (untracked ones cost a
                # check only), by type.
                targets.update(_type_name(r) for r in referents if gc.is_tracked(r))
            slow.update(
                refs=refs, objects=len(young), big=_biggest(young, 5),
                kinds=kinds.most_common(12), targets=targets.most_common(6),
                holders=holders.most_common(6),
            )  # fmt: skip
            del young
            slow.update(wall=time.perf_counter(), cpu=time.thread_time())
            return
        cpu = time.thread_time() - slow.get("cpu", 0.0)
        wall = time.perf_counter() - slow.get("wall", 0.0)
        if cpu > SLOW_CPU_SECONDS or wall > SLOW_WALL_SECONDS:
            print(
                f"slow gen{generation} wall={wall * 1e3:.2f}ms cpu={cpu * 1e3:.2f}ms "
                f"collected={info.get('collected')} objects={slow.get('objects')} "
                f"refs={slow.get('refs')} big={slow.get('big')} "
                f"kinds={slow.get('kinds')} tracked_referents={slow.get('targets')} "
                f"referents_by_holder={slow.get('holders')} "
                f"imported_since={late_modules()}",
                file=out,
                flush=True,
            )

    def census() -> None:
        for round_ in range(10_000):
            time.sleep(CENSUS_SECONDS)
            objects = gc.get_objects()
            by_type: collections.Counter[str] = collections.Counter()
            refs_by_type: collections.Counter[str] = collections.Counter()
            for obj in objects:
                if obj is objects:
                    continue
                name = _type_name(obj)
                by_type[name] += 1
                refs_by_type[name] += len(gc.get_referents(obj))
            big = _biggest(objects, 8)
            del objects
            gc.set_debug(gc.DEBUG_SAVEALL)
            wall, cpu = time.perf_counter(), time.thread_time()
            unreachable = gc.collect()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            gc.set_debug(0)
            garbage = collections.Counter(_type_name(o) for o in gc.garbage)
            gc.garbage.clear()
            gc.collect()  # frees what DEBUG_SAVEALL kept
            again = time.perf_counter()
            gc.collect()
            again = time.perf_counter() - again
            print(
                f"round {round_} objects={sum(by_type.values())} "
                f"refs={sum(refs_by_type.values())} full={wall * 1e3:.2f}ms "
                f"cpu={cpu * 1e3:.2f}ms unreachable={unreachable} next={again * 1e3:.2f}ms",
                file=out,
            )
            for name, refs in refs_by_type.most_common(10):
                print(f"  type {name}: objects={by_type[name]} referents={refs}", file=out)
            for refs, name in big:
                print(f"  big {name}: referents={refs}", file=out)
            for name, count in garbage.most_common(10):
                print(f"  garbage {name}: {count}", file=out)
            out.flush()

    gc.callbacks.insert(0, on_collection)
    threading.Thread(target=census, name="gc-census", daemon=True).start()


if (directory := os.environ.get("CROSSTALK_GC_CENSUS")) and any(
    "detector_worker" in arg for arg in getattr(sys, "orig_argv", ())
):
    _start(directory)
