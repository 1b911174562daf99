"""What the benchmarks share: loopback ports, child processes that end with the
benchmark, and the statistics of their tables."""

from __future__ import annotations

import compileall
import contextlib
import ctypes
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent


def compile_package() -> None:
    """Byte-compile ``proxy`` and ``addons`` as installing a wheel does. Processes a
    benchmark times then load the package rather than compile it, as deployed ones do:
    with ``PYTHONDONTWRITEBYTECODE`` set (as on this project's machines) an editable
    checkout was compiled again by every process, ~0.13 s of each start."""
    for package in ("proxy", "addons"):
        compileall.compile_dir(ROOT / package, quiet=1)


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child (``preexec_fn``): get SIGTERM when the benchmark dies, however it
    dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_on_sigterm() -> None:
    """SIGTERM ends the benchmark like Ctrl-C: its ``finally`` blocks stop the children."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def wait_listening(port: int, proc: subprocess.Popen, name: str, timeout: float) -> None:
    """Until something accepts on ``port``; RuntimeError if ``proc`` exits first or
    nothing listens within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.2):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: nothing listening on {HOST}:{port} after {timeout:.0f} s")
        time.sleep(0.05)


def wait_healthy(url: str, proc: subprocess.Popen, name: str, timeout: float = 120) -> None:
    """Until ``url``/health answers 200 (llama-server listens before its model is
    loaded); RuntimeError if ``proc`` exits first, OSError after ``timeout`` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every process still running, then SIGKILL what is left after ``timeout``
    seconds (all share the one grace time)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_of(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def fmt(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted, ``-`` for none (None or nan)."""
    return "-" if value is None or value != value else format(value, spec)


def stream_all(
    base: str,
    keys: dict[str, str],
    requests: Sequence[Any],
    open_stream: Callable[[Any, int, Any], Iterable[str]],
    *,
    concurrency: int,
    timeout: float,
) -> tuple[dict[str, str], set[str], list[str]]:
    """Every request through the proxy at ``base`` with the real ``openai`` SDK, one
    client per tenant (``keys``: tenant -> API key), ``concurrency`` at a time.
    ``open_stream(client, i, request)`` starts request ``i``'s stream and yields its
    text. Returns what each client received (by ``request_id``), the ids of streams
    crosstalk cut (its in-stream error frame ends them), and the other errors."""
    import openai

    outputs: dict[str, str] = {}
    blocked: set[str] = set()
    errors: list[str] = []
    lock = threading.Lock()
    clients = {
        t: openai.OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=timeout)
        for t, k in keys.items()
    }

    def one(i: int, r: Any) -> None:
        text: list[str] = []
        cut = False
        try:
            text.extend(open_stream(clients[r.tenant], i, r))
        except openai.APIError as e:
            cut = "leak" in str(e).lower() or "crosstalk" in str(e).lower()
            if not cut:
                with lock:
                    errors.append(f"{r.request_id}: {type(e).__name__}: {str(e)[:120]}")
        with lock:
            outputs[r.request_id] = "".join(text)
            if cut:
                blocked.add(r.request_id)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(lambda a: one(*a), enumerate(requests)))
    return outputs, blocked, errors
