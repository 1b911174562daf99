"""Where a replay's time goes: ``crosstalk replay`` run in this process with the engine's
calls timed inside it (``Engine.observe_prompt``, and each scan call the exchange
monitor makes: ``feed`` and ``finish``), against the whole run's wall time. What is not
the engine's is the replay's own work: reading the input, the per-event path (SSE,
the API's JSON, counting, batching), the log and the report, and start-up.

With ``--engine-off`` the engine sees nothing (``observe_prompt`` returns a scan that
finds nothing): what is left is the replay's own floor, the rate no engine, however
fast, can lift a replay past.

Informational: prints one line a call kind and exits with the replay's own status.
The arguments are ``crosstalk replay``'s (the capture, ``--config``, ...); give
``--state`` a copy when the config's state file must stay as it is (replay only reads it).

    python bench/replay_split.py [--engine-off] CAPTURE --config crosstalk.toml [replay arguments]
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy import cli  # noqa: E402
from proxy.engine.detector import Engine  # noqa: E402
from proxy.pipeline.exchange import ExchangeMonitor  # noqa: E402

seconds: Counter[str] = Counter()
calls: Counter[str] = Counter()


def timed(function, name_of):
    """``function``, its calls counted and timed under ``name_of(args)``."""

    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            name = name_of(args)
            seconds[name] += time.perf_counter() - started
            calls[name] += 1

    return call


class BlindScan:
    """A scan that finds nothing: what ``ExchangeMonitor`` calls of a ``ResponseScan``."""

    finished = False
    output_words = 0.0

    def feed(self, delta: str, choice: int = 0, now: float | None = None) -> list:
        return []

    def finish(self, now: float | None = None) -> list:
        self.finished = True
        return []


def main(argv: list[str]) -> int:
    if "--engine-off" in argv:
        argv = [a for a in argv if a != "--engine-off"]
        Engine.observe_prompt = lambda *args, **kwargs: BlindScan()
    Engine.observe_prompt = timed(Engine.observe_prompt, lambda args: "observe_prompt")
    # ExchangeMonitor._scan(monitor, method, *args): the scan's method names the call
    ExchangeMonitor._scan = timed(ExchangeMonitor._scan, lambda args: args[1].__name__)
    started = time.perf_counter()
    try:
        status = cli.main(["replay", *argv])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    wall = time.perf_counter() - started
    engine = sum(seconds.values())
    print(f"replay: {wall:.2f} s in this process, {engine:.2f} s of it in the engine's calls")
    for name, spent in seconds.most_common():
        print(
            f"  {name}: {spent:.3f} s, {calls[name]:,} calls, {spent / calls[name] * 1e6:.1f} us a call"
        )
    print(f"  the rest: {wall - engine:.2f} s (reading, the per-event path, the log, the report)")
    return status or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
