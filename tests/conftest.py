"""Shared fixtures: real processes on loopback.

The simulator runs as ``python -m proxy sim`` and the proxy as a real ``mitmdump`` with
``addons/crosstalk.py``; clients are the real ``openai`` SDK. Every process is started
on a free 127.0.0.1 port and stopped at the end of its fixture.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MITMDUMP = BIN / "mitmdump"


def in_ci() -> bool:
    """CI declares itself with ``CI=true`` (GitHub, GitLab and ours do); ``CI=false`` or an
    empty value is a developer's machine."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing_tool(message: str) -> None:
    """A tool a test needs is not installed: the test fails in CI (where it must run),
    and is skipped elsewhere with the reason, which ``-ra`` prints in the summary."""
    if in_ci():
        pytest.fail(f"CI: {message}")
    pytest.skip(message)


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (outgoing connections use it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on, for a server a test starts. Chosen below the
    kernel's ephemeral range, so no outgoing connection takes it between this check and
    the server's bind, and never handed out twice in one session. (A port from
    ``bind(0)`` is ephemeral: any connection may take it once the check closes it.)"""
    rng = random.SystemRandom()
    high = _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(10_000, high) if high > 11_000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port found")


def start_server(
    command_for, timeout: float = 120.0, attempts: int = 3, stderr=subprocess.PIPE, cwd=ROOT,
    env: dict[str, str] | None = None,
):  # fmt: skip
    """Start ``command_for(port)`` on a free port; ``(proc, port)`` once it listens. A
    server that exits before listening (its port was taken after all) is started again
    on another port. A server that logs a lot needs ``stderr`` to be a file: nobody reads
    the pipe, and a full pipe blocks the server."""
    for attempt in range(attempts):
        port = free_port()
        proc = subprocess.Popen(
            command_for(port), cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr, env=env
        )
        try:
            wait_for_port(port, proc, timeout)
            return proc, port
        except RuntimeError:
            if attempt == attempts - 1:
                raise
        except BaseException:
            stop(proc)
            raise


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Returns once ``proc`` (or a child of it) listens on ``port``. RuntimeError when
    ``proc`` exits first, or when another process took the port between ``free_port``
    and ``proc``'s bind: a connection would reach that process, not the test's. The
    timeout is generous: on a loaded machine a proxy's detector process took over 30 s
    to load its state and open the metrics port (a clean-clone CI run beside benches);
    a process that dies fails at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            owner = _listener_pid(port)
            if owner is not None and not _descends_from(owner, proc.pid):
                stop(proc)
                raise RuntimeError(f"port {port} is held by process {owner}, not the test's")
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def _listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (Linux /proc), None when it cannot be told."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(fd_dir.parent.name)
    return None


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(64):  # a bounded walk up the parent chain
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True  # gone, or not ours to read: no evidence against it
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return False
    return False


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
    """Signal ``proc`` and wait for it; killed after ``timeout`` s. The default outlasts
    the proxy's own bound on stopping (its detector process may take STOP_TIMEOUT, 30 s,
    to finish the exchanges it was sent: on a busy machine a detector still starting
    needs that), so a proxy that stops cleanly is never counted as hung."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def bench_module(name: str):
    """A module of ``bench/`` (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: a dataclass with string annotations looks its module up.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def wait_for_events(path: Path, predicate, timeout: float = 60.0) -> list[dict]:
    """Events of ``path`` once ``predicate(events)`` holds (the proxy logs a streamed
    exchange after the client has its last byte), or all of them after ``timeout``. The
    default is long because it costs nothing when the events come: what the detector
    process logs waits for it to load its state, which took over 10 s on a loaded
    machine (a canary test saw one of its two events)."""
    deadline = time.monotonic() + timeout
    while True:
        events = read_events(path)
        if predicate(events) or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


@dataclass
class Sim:
    url: str
    port: int
    truth: Path
    proc: subprocess.Popen

    def sent(self, request_id: str) -> bytes:
        """The exact bytes the simulator sent for ``request_id``."""
        with urllib.request.urlopen(f"{self.url}/_sim/sent/{request_id}", timeout=10) as r:
            return r.read()

    def headers(self, request_id: str) -> dict:
        """The headers the simulator received for ``request_id`` (names lower-cased)."""
        with urllib.request.urlopen(f"{self.url}/_sim/headers/{request_id}", timeout=10) as r:
            return json.loads(r.read())

    def wait_received(self, request_id: str, timeout: float = 60.0) -> None:
        """Until the simulator has the request ``request_id`` (it is in flight)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.headers(request_id)
                return
            except urllib.error.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def outcome(self, request_id: str) -> str:
        """How the simulator's stream for ``request_id`` ended: ``complete``, or
        ``aborted after N of M events`` (the proxy or the client went away)."""
        with urllib.request.urlopen(f"{self.url}/_sim/outcome/{request_id}", timeout=10) as r:
            return json.loads(r.read())["outcome"]

    def answer(self, request_id: str) -> str:
        """Choice 0's text as the simulator generated it, faults applied: the ground
        truth of what the engine meant to send, also when a proxy cut it short."""
        with urllib.request.urlopen(f"{self.url}/_sim/answer/{request_id}", timeout=10) as r:
            return json.loads(r.read())["answers"][0]


@dataclass
class Proxy:
    url: str
    port: int
    log: Path
    proc: subprocess.Popen

    def events(self, name: str | None = None) -> list[dict]:
        return [e for e in read_events(self.log) if name is None or e["event"] == name]


@contextlib.contextmanager
def run_sim(tmp: Path, *args: str) -> Iterator[Sim]:
    def command(port: int) -> list[str]:
        truth = tmp / f"truth-{port}.jsonl"
        return [
            sys.executable,
            "-m",
            "proxy",
            "sim",
            "--port",
            str(port),
            "--truth",
            str(truth),
            *args,
        ]

    proc, port = start_server(command)
    try:
        yield Sim(f"http://127.0.0.1:{port}", port, tmp / f"truth-{port}.jsonl", proc)
    finally:
        stop(proc)


@contextlib.contextmanager
def run_mitmdump(
    tmp: Path, upstream: str, *sets: str, scripts: Sequence[Path] = (), as_users_do: bool = False
) -> Iterator[Proxy]:
    """mitmdump with crosstalk's addon script (then ``scripts``, the user's own addons),
    in reverse mode in front of ``upstream``; ``sets`` are ``--set name=value``. Its
    confdir is under ``tmp``; ``as_users_do``: set no confdir (mitmproxy's default,
    ``~/.mitmproxy``, with HOME under ``tmp``), as a user's command line would not."""

    def command(port: int) -> list[str]:
        cmd = [
            str(MITMDUMP), "-q",
            "-s", str(ROOT / "addons" / "crosstalk.py"),
            *(arg for script in scripts for arg in ("-s", str(script))),
            "--mode", f"reverse:{upstream}",
            "--listen-host", "127.0.0.1", "-p", str(port),
            *(() if as_users_do else ("--set", f"confdir={tmp / 'mitmproxy-conf'}")),
            "--set", f"crosstalk_log_file={tmp / f'events-{port}.jsonl'}",
        ]  # fmt: skip
        for s in sets:
            cmd += ["--set", s]
        return cmd

    env = {**os.environ, "HOME": str(tmp / "home")} if as_users_do else None
    proc, port = start_server(command, env=env)
    try:
        yield Proxy(f"http://127.0.0.1:{port}", port, tmp / f"events-{port}.jsonl", proc)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("crosstalk")


@pytest.fixture(scope="module")
def sim(module_tmp: Path) -> Iterator[Sim]:
    with run_sim(module_tmp, "--token-delay", "0.002", "--split-words") as s:
        yield s


TEST_KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"


def learn_commonness(path: Path, requests: int = 1500) -> None:
    """What a proxy that has run for a while knows: commonness learned from earlier
    traffic of the simulated deployment (another seed: other prompts, other data)."""
    from proxy.config import load
    from proxy.factory import build_engine
    from proxy.sim.answers import answer_for
    from proxy.sim.workload import Workload

    cfg = load(None, detection__key=TEST_KEY)
    engine = build_engine(cfg)
    for i, req in enumerate(Workload(tenants=24, seed=4242).requests(requests)):
        prompt = req.prompt_text()
        scan = engine.observe_prompt(req.tenant, req.request_id, prompt, now=1000.0 + i)
        scan.feed(answer_for(prompt))
        scan.finish()
    engine.save_commonness(path)


@pytest.fixture(scope="session")
def warm_state(tmp_path_factory) -> Path:
    """Learned commonness (see learn_commonness), computed once per test session."""
    path = tmp_path_factory.mktemp("warm") / "state.npz"
    learn_commonness(path)
    return path


@pytest.fixture
def warm_config(warm_state: Path, tmp_path_factory) -> Path:
    """A config with its own copy of the learned state: each proxy saves its state at
    exit, and one test's traffic must not become the next test's common text."""
    root = tmp_path_factory.mktemp("warmcfg")
    shutil.copy(warm_state, root / "state.npz")
    cfg = root / "crosstalk.toml"
    cfg.write_text(f'[detection]\nkey = "{TEST_KEY}"\nstate_file = "{root / "state.npz"}"\n')
    return cfg


@pytest.fixture(scope="module")
def proxy(module_tmp: Path, sim: Sim, warm_state: Path) -> Iterator[Proxy]:
    shutil.copy(warm_state, module_tmp / "state.npz")
    cfg = module_tmp / "crosstalk.toml"
    cfg.write_text(f'[detection]\nkey = "{TEST_KEY}"\nstate_file = "{module_tmp / "state.npz"}"\n')
    with run_mitmdump(module_tmp, sim.url, f"crosstalk_config={cfg}") as p:
        yield p


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch):
    # The SDK must talk to loopback directly, whatever the environment says.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    yield


os.environ.setdefault("OPENAI_API_KEY", "test-key")
