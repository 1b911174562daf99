"""Concurrent streaming load on a real llama-server: does anything answer 502 that the
engine never sent?

llama.cpp's llama-server (scripts/ensure-llama-server.sh) serves Gemma 3 270M
(scripts/ensure-gemma.sh) on 4 slots. 8 tenants, one ``openai`` client each (kept-alive
connections, as an application holds them), send streamed completions 4 at a time; every
third request waits about llama-server's keep-alive timeout (5 s) first, so that
connections are reused just as the server closes them. The same requests go, in turn:

* ``direct``: straight to llama-server (the control: an error here is the engine's);
* ``bare mitmdump``: ``mitmdump --mode reverse:LLAMA``;
* ``crosstalk, retry off``: mitmdump with crosstalk's addon script and
  ``crosstalk_upstream_retry=false``;
* ``crosstalk``: the same with the retry on (the default).

A failed request is one whose client got an HTTP error or lost its connection. Target:
crosstalk (retry on) fails none, while the control fails none either (else the run says
nothing). The others are reported: they say whether the failure is mitmproxy's.

    python bench/upstream_load.py                 # 120 requests a phase
    python bench/upstream_load.py --requests 240

Exits 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HOST,
    ROOT,
    die_with_parent,
    free_port,
    stop_processes,
    wait_healthy,
    wait_listening,
)
from real_model import ensure  # noqa: E402

MITMDUMP = Path(sys.executable).with_name("mitmdump")
KEEP_ALIVE = 5.0  # llama-server's (cpp-httplib's) keep-alive timeout, seconds
TENANTS = 8
CONCURRENCY = 4
MAX_TOKENS = 16


def start_llama(tmp: Path) -> tuple[subprocess.Popen, str]:
    server, model = ensure("ensure-llama-server.sh"), ensure("ensure-gemma.sh")
    port = free_port()
    cmd = [str(server), "-m", str(model), "-c", "4096", "-np", str(CONCURRENCY),
           "-t", "2", "--alias", "gemma", "--host", HOST, "--port", str(port)]  # fmt: skip
    log = (tmp / "llama-server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, preexec_fn=die_with_parent)
    url = f"http://{HOST}:{port}"
    wait_healthy(url, proc, "llama-server")
    return proc, url


def start_mitmdump(tmp: Path, upstream: str, name: str, *sets: str, addon: bool) -> tuple:
    port = free_port()
    cmd = [str(MITMDUMP), "-q", "--mode", f"reverse:{upstream}", "--listen-host", HOST,
           "-p", str(port), "--set", f"confdir={tmp / 'mitmproxy-conf'}"]  # fmt: skip
    if addon:
        cmd += ["-s", str(ROOT / "addons" / "crosstalk.py"),
                "--set", f"crosstalk_log_file={tmp / f'events-{name}.jsonl'}"]  # fmt: skip
    for s in sets:
        cmd += ["--set", s]
    err = (tmp / f"{name}.stderr").open("wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=err, stderr=err, preexec_fn=die_with_parent)
    wait_listening(port, proc, name, 120)
    return proc, f"http://{HOST}:{port}"


def run_phase(base: str, n: int, seed: int) -> Counter:
    """``n`` streamed completions through ``base``; a count of outcomes ("ok", or the
    error's status or kind)."""
    import openai

    clients = [
        openai.OpenAI(base_url=f"{base}/v1", api_key=f"sk-load-{t}", max_retries=0, timeout=120)
        for t in range(TENANTS)
    ]
    rng = random.Random(seed)
    # Every third request first waits about the keep-alive timeout: its client's
    # connection is then reused just as llama-server closes it (or just after).
    pauses = [KEEP_ALIVE + rng.uniform(-0.15, 0.15) if i % 3 == 0 else 0.0 for i in range(n)]
    outcomes: Counter = Counter()
    lock = threading.Lock()

    def one(i: int) -> None:
        time.sleep(pauses[i])
        try:
            stream = clients[i % TENANTS].completions.create(
                model="gemma", prompt=f"Ticket {i}: my parcel is late. Reply:",
                max_tokens=MAX_TOKENS, stream=True, temperature=0.0,
            )  # fmt: skip
            for _ in stream:
                pass
            outcome = "ok"
        except openai.APIStatusError as e:
            outcome = f"HTTP {e.status_code}"
        except openai.APIError as e:
            outcome = type(e).__name__
        with lock:
            outcomes[outcome] += 1

    with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
        list(pool.map(one, range(n)))
    for client in clients:
        client.close()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=120, help="per phase")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="crosstalk-upstream-load-"))
    llama, url = start_llama(tmp)
    procs = [llama]
    results: dict[str, Counter] = {}
    try:
        phases = [
            ("direct", None),
            ("bare mitmdump", ((), False)),
            ("crosstalk, retry off", (("crosstalk_upstream_retry=false",), True)),
            ("crosstalk", ((), True)),
        ]
        for name, proxy in phases:
            base, proc = url, None
            if proxy is not None:
                sets, addon = proxy
                proc, base = start_mitmdump(tmp, url, name.replace(" ", "-").replace(",", ""),
                                            *sets, addon=addon)  # fmt: skip
                procs.append(proc)
            t0 = time.monotonic()
            results[name] = run_phase(base, args.requests, args.seed)
            print(f"  {name}: {dict(results[name])} in {time.monotonic() - t0:.0f} s")
            if proc is not None:
                stop_processes([proc], 30)
                procs.remove(proc)
    finally:
        stop_processes(procs, 30)
    print(f"\n## upstream load: {args.requests} streamed completions a phase, {TENANTS} "
          f"clients, {CONCURRENCY} at a time, every third after ~{KEEP_ALIVE:g} s idle; "
          f"logs in {tmp}\n")  # fmt: skip
    print("| phase | answered | failed | how |\n|---|---:|---:|---|")
    for name, outcomes in results.items():
        failed = {k: v for k, v in outcomes.items() if k != "ok"}
        how = ", ".join(f"{k} x{v}" for k, v in sorted(failed.items())) or "-"
        print(f"| {name} | {outcomes['ok']} | {sum(failed.values())} | {how} |")
    control_failed = results["direct"]["ok"] != args.requests
    missed = results["crosstalk"]["ok"] != args.requests
    if control_failed:
        print("\nthe engine itself failed requests: the run says nothing about the proxies")
    print("\nMISSED: crosstalk failed requests" if missed else "\nall targets met")
    return 1 if missed or control_failed else 0


if __name__ == "__main__":
    sys.exit(main())
